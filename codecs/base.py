"""The codec interface: the three parts of a codec, and the helpers they share.

A codec turns one chunk of a worker's gradient into payload frames, and turns the frames of N
workers back into one aggregate on the server. It is split into three objects, so that
hyperparameters, per-worker state and per-server state never mix:

* :class:`Codec` holds validated hyperparameters (``threshold``, ``k``, ``rank``...). It is cheap,
  immutable, compared across workers via :meth:`Codec.spec`, and builds the two stateful parts.
* :class:`Encoder` lives on a worker, one per key chunk. It owns the codec's per-worker state
  (2-bit residuals, error-feedback memory, DGC momentum, PowerSGD's Q matrix) and the
  preallocated output buffers, and lives where the value lives (CPU or GPU).
* :class:`Aggregator` lives on a server, one per key chunk. It owns the round's accumulator and
  turns each worker's payloads into its contribution (decode and sum for 2-bit; scatter-add of
  index/value pairs for top-k; sum of factors for low-rank codecs).

Payloads are a list of frames, so codecs with several parts (scale + packed codes, indices +
values) need nothing special from the transport. :meth:`Codec.payload_nbytes` lets the server
reject a malformed payload before it touches state; codecs with data-dependent sizes return
``None`` and validate in :meth:`Aggregator.add`.

The dense result of a round is ``Aggregator.result`` (in the accumulator dtype: fp32 for fp16/fp32
values), which the server stores or hands to the optimizer. Codecs that need more than one round
trip per step (PowerSGD sums the workers' P factors, returns the sum, then sums their Q factors)
return the intermediate aggregate from :meth:`Aggregator.finish`: the server then sends those
frames back to the round's pushers instead of updating the key.

*Relayed pulls.* Without an optimizer a ``dist_sync`` round stores the sum of its decoded pushes.
For a codec whose decoded sum a worker can recompute bit for bit (:attr:`Codec.relayable`: 2-bit,
whose decode is exact and whose server sum is a fixed sequence of float32 additions), the server
may answer a pull with the round's push payloads themselves, in the order it summed them, instead
of the dense sum; the worker runs :meth:`Codec.sum_relay` and gets the identical array. With N
workers a 2-bit relay is N/16 of the dense bytes, so workers ask for it only while that is at
most half (:meth:`Codec.relay_limit`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from kvstore.codecs.xp import array_module, is_cupy_array
from kvstore.errors import CodecError, did_you_mean

Payloads = Sequence[Any]
"""Payload frames: zmq Frames, numpy arrays, bytes or memoryviews."""

ParamValue = bool | int | float | str | None

_ACCUMULATOR_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float32),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int64),
    "int64": np.dtype(np.int64),
}


def accumulator_dtype(dtype: str) -> np.dtype:
    """The dtype a server sums and stores a key of ``dtype`` in (fp16 is kept in fp32)."""
    try:
        return _ACCUMULATOR_DTYPES[dtype]
    except KeyError:
        raise CodecError(
            f"dtype {dtype!r} is not supported; supported: {sorted(_ACCUMULATOR_DTYPES)}"
        ) from None


def squared_norm(values: Any) -> float:
    """``||values||^2`` of a flat numpy or CuPy array, computed where the array lives.

    Float16 and integer values are summed in float64 (their own dtype would overflow)."""
    xp = array_module(values)
    if values.dtype.kind != "f" or values.dtype.itemsize < 4:
        values = values.astype(xp.float64)
    return float(xp.dot(values, values))


class PushQuality(NamedTuple):
    """What one push of a chunk sent and kept back (see :meth:`Encoder.quality`).

    Attributes:
        gradient_sq: ``||g||^2`` of the values pushed.
        residual_sq: ``||r||^2`` of the residual left after the push (what error feedback
            carries into the next push; 0 for codecs without one).
        sent_nonzero: how many elements the push sent as nonzero.
    """

    gradient_sq: float
    residual_sq: float
    sent_nonzero: int


def frame_nbytes(frame: Any) -> int:
    """The byte length of a payload frame."""
    buffer: Any = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    return memoryview(buffer).nbytes


def frame_array(frame: Any, dtype: np.dtype | type, count: int | None = None) -> np.ndarray:
    """A read-only numpy view of a payload frame, without copying."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    arr = np.frombuffer(buf, dtype=dtype)
    return arr if count is None else arr[:count]


def check_saved_state(
    owner: object, names: Sequence[str], state: Mapping[str, Any], hint: str = ""
) -> None:
    """Raise CodecError unless ``state`` holds exactly ``names``, each with the shape and dtype
    of ``owner``'s attribute of that name (an encoder's or aggregator's saved state)."""
    kind = type(owner).__name__
    if set(state) != set(names):
        raise CodecError(f"{kind} keeps state {sorted(names)}, got {sorted(state)}")
    for name in names:
        own, saved = getattr(owner, name), state[name]
        if tuple(saved.shape) != tuple(own.shape) or np.dtype(saved.dtype) != own.dtype:
            raise CodecError(
                f"{kind}.{name} is {own.dtype}{list(own.shape)}, the saved state is "
                f"{saved.dtype}{list(saved.shape)}{hint}"
            )


class Encoder(ABC):
    """Worker-side encoder of one key chunk; holds the codec's per-worker state.

    Attributes:
        numel: elements per call.
        dtype: the value dtype name.
    """

    label: str = "a key"
    """What the encoder's log messages call its key; the client sets it to the key's
    description (``key 'w' (shape (3, 4), float32)``)."""

    state_names: tuple[str, ...] = ()
    """The attributes (numpy or CuPy arrays) that hold the encoder's state between pushes:
    everything the next :meth:`encode` depends on besides its input (2-bit: ``residual``).
    :meth:`state` and :meth:`load_state` save and restore them for checkpoints; an encoder
    whose state is not such arrays overrides those two."""

    def __init__(self, numel: int, dtype: str) -> None:
        self.numel = numel
        self.dtype = dtype

    def state(self) -> dict[str, np.ndarray]:
        """A copy of the encoder's state (:attr:`state_names`) in host memory, for a checkpoint
        (device arrays are copied to the host). Call it between pushes, not during one."""
        result = {}
        for name in self.state_names:
            array = getattr(self, name)
            result[name] = array.get() if is_cupy_array(array) else np.array(array, copy=True)
        return result

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` returned (copied into the encoder's own arrays, on their
        device), so the next push encodes exactly as it would have.

        Raises:
            CodecError: the names, shapes or dtypes are not this encoder's.
        """
        check_saved_state(self, self.state_names, state)
        for name in self.state_names:
            own, saved = getattr(self, name), state[name]
            if is_cupy_array(own):
                own.set(np.ascontiguousarray(saved))
            else:
                np.copyto(own, saved, casting="no")

    @abstractmethod
    def encode(self, values: Any) -> list[Any]:
        """Encode a flat, contiguous array of ``numel`` elements (numpy or CuPy).

        Returns the payload frames as host buffers owned by the encoder. They stay valid until
        the next ``encode`` call; the caller must not call ``encode`` again before the previous
        frames were sent. When this returns, ``values`` is no longer needed.
        """

    def borrow(self, values: Any) -> list[Any] | None:
        """The payload frames of ``values`` without encoding them into buffers of the
        encoder's own: frames that are ``values``' memory, which the caller then keeps
        unchanged until they were sent. None (the default) where the codec must encode, or
        where ``values`` is not host memory: the caller then calls :meth:`encode`.
        """
        return None

    round_trips: int = 1
    """Round trips the push just encoded takes (read after :meth:`encode`): 1 for codecs that
    push once per step. A multi-round codec (PowerSGD) sets it per push: the caller then sends
    each reply of the step's intermediate rounds to :meth:`next_round` and pushes what it
    returns, and hands the final round's acknowledgement to :meth:`end_step`."""

    def next_round(self, reply: Payloads) -> list[Any]:
        """The payload of the push's next round, from the frames the server sent back for the
        previous one (its :meth:`Aggregator.finish`). Only called while :attr:`round_trips`
        says more rounds follow; the frames returned stay valid until :meth:`end_step`.

        Raises:
            CodecError: the reply is not what this encoder expects.
        """
        raise CodecError(f"{type(self).__name__} pushes once per step")

    def end_step(self, reply: Payloads) -> None:
        """End a multi-round push with the frames that acknowledged its final round
        (:meth:`Aggregator.reply_frames`); the encoder's state is then that of the next step.

        Raises:
            CodecError: the reply is not what this encoder expects.
        """
        return None

    def quality(self, values: Any) -> PushQuality | None:
        """Measure the push just made of ``values`` (by :meth:`encode` or :meth:`borrow`), before
        the next one: the metrics' residual norm and density (:mod:`kvstore.metrics`).

        Called only with metrics on, and then on one push in ``KVSTORE_METRICS_EVERY``, so it
        may make passes over the chunk; for GPU values it computes on the device. None (the
        default) where the codec does not say.
        """
        return None


class KeyEncoder:
    """Worker-side encoder of one whole key: one :class:`Encoder` per chunk, plus the work a
    codec does once per push over the whole key (:meth:`begin`).

    Most codecs encode each chunk on its own, and their key encoder is just the chunks'
    encoders (this class as it is). A codec whose selection spans the whole key (top-k's ``k``
    is per key) does it in :meth:`begin` and lets each chunk's :meth:`Encoder.encode` return
    that chunk's share; its chunk encoders may be views into key-level state.

    Attributes:
        chunks: one encoder per chunk, in chunk order. Their :meth:`~Encoder.encode`,
            :meth:`~Encoder.quality`, :meth:`~Encoder.state` and :meth:`~Encoder.load_state`
            work per chunk, as without a key encoder.
    """

    whole_key: ClassVar[bool] = False
    """True when :meth:`begin` writes the payload buffers of every chunk: the caller then
    lets the previous push of every chunk be sent before calling it."""

    def __init__(self, chunks: Sequence[Encoder]) -> None:
        self.chunks: Sequence[Encoder] = list(chunks)

    def begin(self, values: Any, *, finite: bool = False) -> None:
        """Called once per push with the whole key's flat values (numpy or CuPy), before any
        chunk is encoded; then each chunk's ``encode`` gets its slice of ``values``. Does
        nothing by default.

        ``finite``: the caller has checked that ``values`` hold no NaN or infinity (the client
        does, before any chunk of a push is sent), so an encoder that would check it itself
        may skip that pass.
        """


class Aggregator(ABC):
    """Server-side accumulator of one key chunk for one round.

    Attributes:
        numel: elements of the chunk.
        dtype: the value dtype name.
        result: the dense accumulator (``accumulator_dtype(dtype)``), holding the round's sum
            once :meth:`finish` returned (an aggregator may defer work until then). Between
            rounds the server may replace it with another array of the same length and dtype
            (it publishes the old one as the key's value instead of copying it), so a round
            must overwrite every element and nothing may cache the array.
    """

    def __init__(self, numel: int, dtype: str) -> None:
        self.numel = numel
        self.dtype = dtype
        self.result = np.zeros(numel, dtype=accumulator_dtype(dtype))

    @abstractmethod
    def add(self, payloads: Payloads, first: bool) -> None:
        """Decode one worker's payloads and add them to :attr:`result`.

        ``first`` marks the round's first contribution: it overwrites :attr:`result` instead of
        adding (no separate zeroing pass). Calls on one aggregator are serialized by the server;
        calls on different aggregators may run on different threads at once.
        """

    def finish(self) -> list[Any] | None:
        """End a round (all workers' contributions are in); runs on an executor thread.

        Returns None when :attr:`result` holds the round's dense aggregate, which the server
        then stores or hands to the optimizer (single-round codecs: the default). A codec with
        several round trips per step returns the payload frames of an intermediate round
        instead; the server sends them back to every pusher of the round and leaves the key's
        value unchanged.
        """
        return None

    def reply_frames(self) -> list[Any] | None:
        """Frames that acknowledge the pushes of a round that stored its result (asked right
        after :meth:`finish` returned None): what a multi-round codec's workers need to end
        their step (PowerSGD's sum of Q). None (the default): plain acknowledgements."""
        return None

    def abandon(self) -> None:
        """The round failed (a push refused, a finish that raised): forget what the round
        started, so the next one begins afresh. State kept between rounds (:attr:`state_names`)
        changes only in a :meth:`finish` that succeeds. Does nothing by default."""
        return None

    def relay_frames(self) -> list[Any] | None:
        """For a codec whose round value is itself a compressed payload
        (:attr:`Codec.relays_round_result`): the frames of one push whose
        :meth:`Codec.sum_relay` gives :attr:`result` bit for bit, which a relayed pull sends
        instead of the dense value. None (the default): the server relays the round's pushes,
        where the codec can."""
        return None

    state_names: tuple[str, ...] = ()
    """The attributes (numpy arrays) an aggregator carries from one round to the next (a
    codec that keeps momentum or error feedback on the server); checkpoints save them. Most
    aggregators start every round from nothing and have none."""

    step_size: float = 1.0
    """For a codec that :attr:`~Codec.applies_step_size`: the server optimizer's step scale
    (``learning_rate * rescale_grad``), which the server sets before every :meth:`finish`."""

    def state(self) -> dict[str, np.ndarray]:
        """The arrays of :attr:`state_names` (the live ones: save them while the chunk is
        quiescent)."""
        return {name: getattr(self, name) for name in self.state_names}

    def check_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Raise CodecError unless ``state`` has this aggregator's names, shapes and dtypes."""
        check_saved_state(self, self.state_names, state, " (saved with other chunk sizes?)")

    def load_state(self, state: Mapping[str, np.ndarray] | None) -> None:
        """Copy a checked :meth:`state` into the aggregator's own arrays; None zeroes them (a
        checkpoint taken before the chunk's first round)."""
        for name in self.state_names:
            own = getattr(self, name)
            if state is None:
                own.fill(0)
            else:
                np.copyto(own, state[name], casting="no")


class Codec(ABC):
    """Hyperparameters of a compression method, and the factory of its stateful parts.

    Subclasses set :attr:`name` (the wire and registry name), :attr:`dtypes` (the value dtypes
    they accept) and :attr:`param_defaults`, validate their parameters in ``__init__`` and
    implement the abstract methods.
    """

    name: ClassVar[str]
    dtypes: ClassVar[frozenset[str]]
    param_defaults: ClassVar[dict[str, ParamValue]] = {}
    example_params: ClassVar[tuple[dict[str, ParamValue], ...]] = ({},)
    """Parameter sets that between them take every path of the codec's encoders, its typical
    setting first. The parity check (``tests/codec_parity.py``) runs each through every
    implementation of every registered codec; the default runs the codec with its defaults."""
    round_trips: int = 1
    """The most round trips a push of one chunk takes per step (see
    :attr:`Encoder.round_trips`); more than 1 needs ``dist_sync``. A codec whose parameters
    decide it sets it per instance."""
    applies_step_size: bool = False
    """True when the aggregator's result is the update itself, the server optimizer's step
    size already applied (the sketch codec scales its error accumulation by it, as FetchSGD
    does): the server then sets :attr:`Aggregator.step_size` before every finish, and its
    ``sgd`` moves the weights by ``w = (1 - lr * wd) * w - result``."""
    encodes_whole_key: ClassVar[bool] = False
    """True when the codec's key encoder selects over the whole key (its
    :attr:`KeyEncoder.whole_key`): a chunk's payload then depends on the other chunks' values,
    so one worker must encode every chunk of a key (hierarchical pushes give such a key's
    chunks to one worker of the host, :mod:`kvstore.worker.host_group`)."""
    relays_round_result: ClassVar[bool] = False
    """True when a round's value is itself compact (:meth:`Aggregator.relay_frames`): a relayed
    pull then sends it instead of the round's pushes."""

    def __init__(self, **params: Any) -> None:
        unknown = set(params) - set(self.param_defaults)
        if unknown:
            accepted = ", ".join(sorted(self.param_defaults)) or "none"
            raise CodecError(
                f"unknown parameter(s) {sorted(unknown)} for codec {self.name!r}"
                f"{did_you_mean(sorted(unknown), self.param_defaults)}; accepted: {accepted}"
            )
        self._params: dict[str, ParamValue] = {**self.param_defaults, **params}

    def params(self) -> dict[str, ParamValue]:
        """The validated hyperparameters (as sent on the wire)."""
        return dict(self._params)

    def spec(self) -> dict[str, ParamValue]:
        """``{"type": name, **params}``; codecs with equal specs are interchangeable."""
        return {"type": self.name, **self.params()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.spec().items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def check_dtype(self, dtype: str, what: str = "the value") -> None:
        """Raise CodecError if this codec cannot encode values of ``dtype``."""
        if dtype not in self.dtypes:
            raise CodecError(
                f"codec {self.name!r} supports {sorted(self.dtypes)} values, but {what} is {dtype}"
            )

    @abstractmethod
    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...] | None:
        """Byte length of each payload frame for a chunk of ``numel`` elements.

        ``None`` means the sizes depend on the data; the aggregator then validates them.
        """

    def pushed_fraction(self, numel: int, dtype: str) -> float:
        """Bytes a push of ``numel`` elements carries per byte of the uncompressed value (1.0
        where the sizes depend on the data)."""
        sizes = self.payload_nbytes(numel, dtype)
        raw = numel * np.dtype(dtype).itemsize
        if sizes is None or raw == 0:
            return 1.0
        return sum(sizes) / raw

    @abstractmethod
    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        """A worker-side encoder; ``device`` is None for host memory or a CuPy device."""

    def make_key_encoder(
        self,
        key: Any,
        numel: int,
        dtype: str,
        bounds: Sequence[tuple[int, int]],
        device: Any = None,
        *,
        worker: int = 0,
        shape: tuple[int, ...] | None = None,
    ) -> KeyEncoder:
        """The worker-side encoder of a whole key of ``numel`` elements, split into chunks at
        ``bounds`` (each chunk's ``(start, stop)``, in order, covering ``[0, numel)``).

        ``worker`` is the pushing worker's rank: codecs that round stochastically key their
        generator with it, so that the workers' rounding noise is independent. ``shape`` is
        the key's shape (None: treat it as 1-D); codecs that view a key as a matrix read it.

        By default every chunk gets its own :meth:`make_encoder` and nothing is done per key;
        codecs whose selection spans the key override this.
        """
        return KeyEncoder(
            [self.make_encoder(stop - start, dtype, device) for start, stop in bounds]
        )

    @abstractmethod
    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        """A server-side aggregator for a chunk of ``numel`` elements."""

    def make_chunk_aggregator(
        self, numel: int, dtype: str, *, shape: tuple[int, ...], start: int, key: Any = None
    ) -> Aggregator:
        """The aggregator of the chunk of elements ``[start, start + numel)`` of the key
        ``key`` of ``shape`` (what the server makes). By default :meth:`make_aggregator`;
        codecs that view a key as a matrix, or hash by the key, override it."""
        return self.make_aggregator(numel, dtype)

    def chunk_alignment(self, shape: tuple[int, ...]) -> int:
        """Elements that a key of ``shape`` is cut into chunks on multiples of (the key's
        end aside): 16, a 2-bit word, by default. A codec that needs whole rows in every chunk
        asks for a multiple of the row length; where the alignment exceeds a partition the
        client cuts the key at 16 and the codec must cope (PowerSGD sends such chunks dense).
        """
        return 16

    def check_optimizer(self, name: str, params: Mapping[str, Any]) -> None:
        """Raise CodecError if a server optimizer ``name`` with the validated hyperparameters
        ``params`` must not update keys of this codec (DGC applies momentum on the workers, so
        a server optimizer with momentum would apply it twice). Accepts anything by default."""
        return None

    relayable: ClassVar[bool] = False
    """True when :meth:`sum_relay` reproduces the aggregator's sum of a round bit for bit."""

    def relay_limit(self, numel: int, dtype: str) -> int:
        """The most pushes a relayed pull of a ``numel``-element chunk may carry (0: never).

        A relay is worth it while its bytes are at most half the dense value's; the worker
        sends this number with its pull and the server relays only rounds of at most that many
        pushes, whose bytes it also checks (:func:`relay_fits`). Where the payload sizes depend
        on the data, the number of pushes says nothing and the byte check alone decides
        (:data:`ANY_RELAY_PUSHES`).
        """
        if not self.relayable or numel == 0:
            return 0
        sizes = self.payload_nbytes(numel, dtype)
        if sizes is None:
            return ANY_RELAY_PUSHES
        dense = numel * np.dtype(dtype).itemsize
        return (dense // 2) // max(1, sum(sizes))

    def sum_relay(self, pushes: Sequence[Payloads], numel: int, dtype: str, out: Any) -> None:
        """Write the sum of the decoded ``pushes`` into ``out``, exactly as the server did.

        ``pushes`` are the payloads of one round in the order the server's aggregator added
        them: the first is written, the others added, with the aggregator's arithmetic, so
        ``out`` (``numel`` elements of ``dtype``, numpy or CuPy) ends up bit-identical to the
        server's sum. Each push is validated first.

        Raises:
            CodecError: the codec cannot relay, or a push has the wrong sizes.
        """
        raise CodecError(f"codec {self.name!r} does not relay pulls")

    def validate_payloads(self, payloads: Payloads, numel: int, dtype: str) -> None:
        """Raise CodecError unless ``payloads`` have the sizes this codec produces."""
        expected = self.payload_nbytes(numel, dtype)
        if expected is None:
            return
        sizes = tuple(frame_nbytes(p) for p in payloads)
        if sizes != expected:
            raise CodecError(
                f"codec {self.name!r}: a chunk of {numel} {dtype} elements needs payload frames "
                f"of {list(expected)} bytes, got {list(sizes)}"
            )


SERVER_MOMENTUM = {"sgd": "momentum", "dcasgd": "momentum", "adam": "beta1"}
"""The hyperparameter that gives each server optimizer momentum."""


def server_momentum(name: str, params: Mapping[str, Any]) -> str | None:
    """The momentum hyperparameter of server optimizer ``name`` when ``params`` turn it on
    (``momentum=0.9``), else None: what a codec that applies momentum itself refuses."""
    momentum = SERVER_MOMENTUM.get(name)
    if momentum is not None and float(params.get(momentum, 0.0) or 0.0) > 0:
        return momentum
    return None


ANY_RELAY_PUSHES = 1 << 20
"""The relay limit of codecs whose payload sizes depend on the data (sparse ones): any number
of pushes, as long as the round's bytes are at most half the dense value's."""


def relay_fits(pushes: Sequence[Payloads], numel: int, dtype: str) -> bool:
    """Whether relaying ``pushes`` (one round's payloads) moves at most half the bytes of the
    dense ``numel``-element value: the server relays a round only then."""
    nbytes = sum(frame_nbytes(f) for push in pushes for f in push)
    return 2 * nbytes <= numel * np.dtype(dtype).itemsize


# Validation helpers for codec parameters -------------------------------------------------------


def positive_float32(codec: str, name: str, value: Any) -> float:
    """``value`` as the float32 it will be used as, required finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise CodecError(
            f"codec {codec!r}: {name} must be a number, got {type(value).__name__} {value!r}"
        )
    as32 = float(np.float32(value))
    if not math.isfinite(float(value)) or not as32 > 0 or not math.isfinite(as32):
        raise CodecError(f"codec {codec!r}: {name} must be a finite number > 0, got {value!r}")
    return as32


def seed_param(codec: str, value: Any) -> int:
    """A non-negative integer below 2**63."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CodecError(f"codec {codec!r}: seed must be an integer, got {value!r}")
    value = int(value)
    if not 0 <= value < 2**63:
        raise CodecError(f"codec {codec!r}: seed must be in [0, 2**63), got {value!r}")
    return value
