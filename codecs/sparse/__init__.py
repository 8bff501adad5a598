"""What the sparse codecs (``threshold``, ``topk``, ``randomk``, ``dgc``) share.

They differ only in how a worker picks the elements it sends; everything else is here, once.

**Payload** of one key chunk: two frames, the chunk-local indices of the elements sent (uint32,
strictly ascending) and their values (the key's dtype: float32), one per index. The number of
pairs is the frames' length; it depends on the data (none at all is a valid push).

**Validation** (:func:`validate_payloads`), before anything is touched, by the server for every
push and by a worker for every relayed pull: two frames, whole elements, as many values as
indices, indices strictly ascending and below the chunk's length. A bad payload raises
:class:`~kvstore.errors.CodecError` naming what was wrong.

**Aggregation** (:class:`SparseAggregator`): a round's sum is a dense float32 chunk; the first
push of a round zeroes it and scatters into it, each further push scatters (adds) into it, in
the order the server received them. Within one push indices are unique, so every element gets
one float32 addition per push that sent it, in push order.

**Relay** (:func:`sum_relay`): the server's sum is that fixed sequence of float32 additions, so
a worker that adds the same pushes in the same order gets it bit for bit; a ``dist_sync`` round
without an optimizer is relayed while its pushes' bytes are at most half the dense chunk's
(:func:`kvstore.codecs.base.relay_fits`), which sparse pushes usually are.

**Encoding** (:class:`SparseKeyEncoder`): per key (a ``topk`` key's ``k`` is per key, however
many servers its chunks live on), per push: the new gradient goes into the key's state (the
residual ``r += g``, or DGC's momentum and velocity), the codec's selection picks the indices
(ascending) over the whole key, their values are taken and their state zeroed, and then the
selection is cut by chunk. What to select is decided on the host before any kernel runs
(:class:`Selection`: a threshold, a target ``k`` with or without a sample plan, or a keyed
permutation); the selection itself runs in one of three implementations with one contract
(identical indices, values and state on any input): the codec's numpy reference (readable as
the spec; ``KVSTORE_CPU_KERNELS=numpy``), the compiled CPU kernels of ``numba_kernels`` (the
default) and the CuPy code of ``cuda_kernels`` for GPU values.

**Deterministic choices** shared by the family, so that every implementation agrees: the key's
identity is hashed with :func:`~kvstore.codecs.counter_rng.stable_key_hash`, per-push randomness
comes from :func:`~kvstore.codecs.counter_rng.counter_hash` of ``(seed, key, step, purpose...)``
(no generator state), and ratios become counts with :func:`ceil_ratio`, which reads the ratio as
the decimal its ``repr`` shows
(``0.07 * 100`` is 7, not 8).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, ClassVar, NamedTuple

import numpy as np

from kvstore.codecs.base import (
    Aggregator,
    Codec,
    Encoder,
    KeyEncoder,
    Payloads,
    PushQuality,
    squared_norm,
)
from kvstore.codecs.counter_rng import stable_key_hash
from kvstore.codecs.finite import count_nonfinite
from kvstore.codecs.xp import is_cupy_array, pinned_empty
from kvstore.config import cpu_kernels_from_env
from kvstore.errors import CodecError

INDEX_DTYPE = np.dtype(np.uint32)
"""Wire dtype of the chunk-local indices."""

THRESHOLD, TOP_K, RANDOM = 0, 1, 2
"""Selection kinds (:attr:`Selection.kind`)."""


# deterministic helpers -------------------------------------------------------------------------


def ceil_ratio(ratio: float, count: int) -> int:
    """``ceil(ratio * count)``, with ``ratio`` read as the decimal number its ``repr`` shows,
    so that float rounding never adds one (``0.07 * 100`` is 7.000000000000001 in floats)."""
    return math.ceil(Fraction(repr(float(ratio))) * count)


def top_count(ratio: float, numel: int) -> int:
    """``k = max(1, ceil(ratio * n))`` elements of a key of ``n`` (0 for an empty key)."""
    return min(numel, max(1, ceil_ratio(ratio, numel)))


class SamplePlan(NamedTuple):
    """Where one push samples magnitudes to estimate the top-k threshold.

    Attributes:
        start: the first sampled element (``0 <= start < stride``), different at every push.
        stride: the (odd) distance between samples.
        count: how many samples (``start + (count - 1) * stride < n``).
        top: the threshold is the ``top``-th largest sample.
    """

    start: int
    stride: int
    count: int  # type: ignore[assignment]  # DGC's name for it; shadows tuple.count, unused here
    top: int


def sample_plan(numel: int, ratio: float, sample: float, start_hash: int) -> SamplePlan:
    """DGC's sampled threshold estimate (Lin et al., ICLR 2018), with a deterministic start.

    A key of at most ``ceil(2 / ratio)`` elements is sampled whole. Otherwise about
    ``max(ceil(n * sample), ceil(2 / ratio))`` samples are taken at an odd stride (odd against
    aliasing with the tensor's layout), starting at ``start_hash mod stride``; the threshold is
    the ``ceil(ratio * samples)``-th largest.
    """
    tiny = math.ceil(2 / Fraction(repr(float(ratio))))
    if numel <= tiny:
        stride, count = 1, numel
    else:
        need = max(ceil_ratio(sample, numel), tiny)
        stride = math.ceil(Fraction(numel, need * 32)) * 32 + 1
        count = numel // stride
        while count < need:
            stride -= 8  # stays odd, and reaches 1 before count could fall short
            count = numel // stride
    top = min(count, max(1, ceil_ratio(ratio, count)))
    return SamplePlan(start_hash % stride, stride, count, top)


def accepted_count(count: int, k: int) -> bool:
    """Whether a sampled threshold that selects ``count`` elements is kept for a target ``k``
    (``k/2 <= count <= 1.3 k``); otherwise exact top-k decides."""
    return 2 * count >= k and 10 * count <= 13 * k


class Selection(NamedTuple):
    """What one push of a key selects, decided on the host before any kernel runs.

    Attributes:
        kind: :data:`THRESHOLD` (every ``abs(x) >= threshold``), :data:`TOP_K` (the ``k``
            largest ``abs(x)``, exactly or through ``sample``) or :data:`RANDOM` (the first
            ``k`` outputs of a keyed permutation, ascending).
        k: elements to send (TOP_K, RANDOM).
        threshold: float32 (THRESHOLD).
        sample: the sample plan; None for exact top-k (TOP_K).
        half_bits: the permutation works on ``2 * half_bits`` bits (RANDOM).
        round_keys: its round keys, 32-bit (RANDOM).
    """

    kind: int
    k: int = 0
    threshold: float = 0.0
    sample: SamplePlan | None = None
    half_bits: int = 0
    round_keys: tuple[int, ...] = ()


class Accumulation(NamedTuple):
    """How a push's gradient goes into the key's state before selection.

    ``momentum`` None: error feedback, ``r += g`` (state ``residual``). Otherwise DGC's momentum
    correction with float32 ``momentum`` (state ``u``, ``v``; see :mod:`kvstore.codecs.sparse.dgc`),
    the gradient first scaled by :func:`kvstore.codecs.sparse.dgc.clip_scale` of ``clip_norm``.
    """

    momentum: np.float32 | None = None
    nesterov: bool = False
    clip_norm: float | None = None


# payload validation, aggregation and relay --------------------------------------------------


def _frame_bytes(frame: Any) -> memoryview:
    return memoryview(getattr(frame, "buffer", frame)).cast("B")


def validate_payloads(
    payloads: Payloads, numel: int, dtype: str, codec: str = "sparse", compiled: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Check one push of a ``numel``-element chunk and return its (indices, values) as
    read-only views of the frames. ``compiled``: use the numba kernel for the order check
    (None: as ``KVSTORE_CPU_KERNELS`` says).

    Raises:
        CodecError: not two frames, partial elements, counts that differ, indices not strictly
            ascending or not below ``numel`` (the message says which and where).
    """
    where = f"codec {codec!r}: a push of a {numel}-element chunk"
    if len(payloads) != 2:
        raise CodecError(f"{where} needs 2 payload frames (indices, values), got {len(payloads)}")
    raw_idx, raw_val = (_frame_bytes(p) for p in payloads)
    itemsize = np.dtype(dtype).itemsize
    if raw_idx.nbytes % INDEX_DTYPE.itemsize or raw_val.nbytes % itemsize:
        raise CodecError(
            f"{where}: frames of {raw_idx.nbytes} and {raw_val.nbytes} bytes are not whole "
            f"uint32 indices and {dtype} values"
        )
    indices = np.frombuffer(raw_idx, dtype=INDEX_DTYPE)
    values = np.frombuffer(raw_val, dtype=dtype)
    if indices.size != values.size:
        raise CodecError(f"{where} has {indices.size} indices but {values.size} values")
    check_indices(indices, numel, where, compiled)
    return indices, values


def check_indices(indices: np.ndarray, numel: int, where: str, compiled: bool | None) -> None:
    """Check a push's chunk-local ``indices`` (uint32): at most ``numel`` of them, strictly
    ascending, all below ``numel``. ``where`` starts the error message.

    Raises:
        CodecError: too many, not strictly ascending, or out of range (the message says where).
    """
    if indices.size > numel:
        raise CodecError(f"{where} has {indices.size} pairs, more than the chunk's elements")
    if indices.size:
        bad = _first_unordered(indices, compiled)
        if bad >= 0:
            raise CodecError(
                f"{where}: indices must be strictly ascending, but index {bad} is "
                f"{int(indices[bad])} after {int(indices[bad - 1])}"
            )
        if int(indices[-1]) >= numel:
            raise CodecError(f"{where}: index {int(indices[-1])} is out of range")


def _first_unordered(indices: np.ndarray, compiled: bool | None) -> int:
    if compiled is None:
        compiled = _kernel_set() == "numba"
    if indices.size < 64 or not compiled:
        bad = np.flatnonzero(indices[1:] <= indices[:-1])
        return int(bad[0]) + 1 if bad.size else -1
    return int(_numba().first_unordered(indices))


def _kernel_set() -> str:
    return cpu_kernels_from_env()


def _numba() -> Any:
    from kvstore.codecs.sparse import numba_kernels  # noqa: PLC0415  (compiles on first use)

    return numba_kernels


def _libc_memset() -> Any:
    try:
        memset = ctypes.CDLL(None).memset
    except (OSError, AttributeError):
        return None
    memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    memset.restype = ctypes.c_void_p
    return memset


_MEMSET = _libc_memset()
_MEMSET_FROM = 1 << 16


def zero_fill(array: np.ndarray) -> None:
    """Set a contiguous host array to +0.0 (all bits zero).

    Large arrays go through the C library's ``memset`` (called through ctypes, which releases
    the GIL): above glibc's non-temporal threshold it streams past the cache, and zeroes
    64 MiB in 0.15-0.2 of the time of one numpy ``a += b`` over it on the development machine,
    against 0.4-0.5 for ``fill(0)``. Below it (a 4 MiB chunk there) it is as fast as
    ``fill(0)``, and the chunk stays in cache for the scatter-adds that follow.
    """
    if _MEMSET is not None and array.nbytes >= _MEMSET_FROM and array.flags.c_contiguous:
        _MEMSET(array.ctypes.data, 0, array.nbytes)
    else:
        array.fill(0)


def scatter_add(
    out: np.ndarray, indices: np.ndarray, values: np.ndarray, compiled: bool | None = None
) -> None:
    """``out[indices] += values`` (indices unique and in range, already validated), with the
    numba kernel when ``compiled`` (None: as ``KVSTORE_CPU_KERNELS`` says)."""
    if indices.size == 0:
        return
    if compiled is None:
        compiled = _kernel_set() == "numba"
    if compiled:
        _numba().scatter_add(out, indices, values)
    else:
        out[indices] += values  # unique indices: one float32 addition per element, like the loop


class SparseAggregator(Aggregator):
    """A round's sum of sparse pushes: zero, then scatter-add each push in arrival order."""

    def __init__(self, numel: int, dtype: str, codec: str) -> None:
        super().__init__(numel, dtype)
        self._codec = codec
        self._compiled = _kernel_set() == "numba"

    def add(self, payloads: Payloads, first: bool) -> None:
        # sum_relay repeats exactly this on the worker: keep the two in step.
        indices, values = validate_payloads(
            payloads, self.numel, self.dtype, self._codec, self._compiled
        )
        if first:
            zero_fill(self.result)
        scatter_add(self.result, indices, values, self._compiled)


def sum_relay(
    pushes: Sequence[Payloads], numel: int, dtype: str, out: Any, codec: str = "sparse"
) -> None:
    """Write the server's sum of a round's ``pushes`` (in its order) into ``out`` (numpy or
    CuPy), bit for bit: every push is validated first, then ``out`` is zeroed and each push
    scatter-added, as :class:`SparseAggregator` does."""
    if not pushes:
        raise CodecError("a relayed pull needs at least one push")
    compiled = _kernel_set() == "numba"
    checked = [validate_payloads(p, numel, dtype, codec, compiled) for p in pushes]
    if is_cupy_array(out):
        from kvstore.codecs.sparse import cuda_kernels  # noqa: PLC0415

        out.fill(0)
        for indices, values in checked:
            cuda_kernels.scatter_add(out, indices, values)
        return
    zero_fill(out)
    for indices, values in checked:
        scatter_add(out, indices, values, compiled)


# the codec family ------------------------------------------------------------------------------


class SparseCodec(Codec):
    """Base of the sparse codecs: payload, validation, aggregation, relay and the encoder.

    Subclasses set :attr:`name`, :attr:`param_defaults` and :attr:`state_names`, validate their
    parameters, and implement :meth:`selection` (what a push selects) and :meth:`reference`
    (their numpy reference); DGC also overrides :meth:`accumulation`.
    """

    dtypes = frozenset({"float32"})
    relayable = True
    encodes_whole_key: ClassVar[bool] = True  # (selection over the key: SparseKeyEncoder)
    state_names: ClassVar[tuple[str, ...]] = ("residual",)
    """The encoder's per-element state arrays; the last one is what selection reads, sends
    and zeroes (``r``, or DGC's ``v``)."""

    def payload_nbytes(self, numel: int, dtype: str) -> None:
        return None  # as many pairs as the data selects

    def validate_payloads(self, payloads: Payloads, numel: int, dtype: str) -> None:
        self.check_dtype(dtype)
        validate_payloads(payloads, numel, dtype, self.name)

    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        self.check_dtype(dtype)
        return SparseAggregator(numel, dtype, self.name)

    def sum_relay(self, pushes: Sequence[Payloads], numel: int, dtype: str, out: Any) -> None:
        self.check_dtype(dtype)
        sum_relay(pushes, numel, dtype, out, self.name)

    def make_key_encoder(
        self,
        key: Any,
        numel: int,
        dtype: str,
        bounds: Sequence[tuple[int, int]],
        device: Any = None,
        *,
        worker: int = 0,
        shape: tuple[int, ...] | None = None,  # (ignored: every key is flat to this codec)
    ) -> SparseKeyEncoder:
        self.check_dtype(dtype)
        return SparseKeyEncoder(self, key, numel, bounds, device)

    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        """An encoder of a key that is one chunk (no key identity: its hash is 0)."""
        return _WholeKeyEncoder(self.make_key_encoder(None, numel, dtype, [(0, numel)], device))

    def accumulation(self) -> Accumulation:
        """How the gradient enters the state (error feedback unless overridden)."""
        return Accumulation()

    def selection(self, numel: int, step: int, key_hash: int) -> Selection:
        """What push number ``step`` (0, 1, ...) of a key of ``numel`` elements selects."""
        raise NotImplementedError

    def reference(
        self, state: Mapping[str, np.ndarray], grad: np.ndarray, selection: Selection
    ) -> tuple[np.ndarray, np.ndarray]:
        """The numpy reference of one push: update ``state`` in place (gradient in, selected
        entries zeroed) and return the selected (ascending int64 indices, values)."""
        raise NotImplementedError


def ratio_param(codec: str, value: Any, name: str = "ratio") -> float:
    """A ratio in (0, 1] (a number, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise CodecError(f"codec {codec!r}: {name} must be a number in (0, 1], got {value!r}")
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise CodecError(f"codec {codec!r}: {name} must be in (0, 1], got {value!r}")
    return value


def fraction_param(codec: str, value: Any, name: str) -> float:
    """A number in [0, 1] (not NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise CodecError(f"codec {codec!r}: {name} must be a number in [0, 1], got {value!r}")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise CodecError(f"codec {codec!r}: {name} must be in [0, 1], got {value!r}")
    return value


# encoders --------------------------------------------------------------------------------------


class _PayloadBuffers:
    """Host buffers of one push: the selected global indices (int64) and values, and the
    chunk-local uint32 indices sent. Grown as needed, never shrunk; pinned for GPU encoders."""

    def __init__(self, pinned: bool) -> None:
        self._pinned = pinned
        self.indices = np.empty(0, np.int64)
        self.values = np.empty(0, np.float32)
        self.local = np.empty(0, INDEX_DTYPE)

    def _empty(self, size: int, dtype: Any) -> np.ndarray:
        return pinned_empty(size, dtype) if self._pinned else np.empty(size, dtype)

    def ensure(self, size: int) -> None:
        """At least ``size`` entries (the contents are not kept)."""
        if self.indices.size < size:
            size = max(size, 2 * self.indices.size, 64)
            self.indices = self._empty(size, np.int64)
            self.values = self._empty(size, np.float32)
            self.local = self._empty(size, INDEX_DTYPE)

    def grow(self, used: int) -> None:
        """Double the room, keeping the first ``used`` entries."""
        old_indices, old_values = self.indices, self.values
        self.indices = np.empty(0, np.int64)
        self.ensure(2 * max(old_indices.size, 64))
        self.indices[:used] = old_indices[:used]
        self.values[:used] = old_values[:used]


class SparseKeyEncoder(KeyEncoder):
    """The encoder of one key for a sparse codec: key-level state, selection over the key.

    Attributes:
        state: the per-element state arrays by name (numpy, or CuPy on a GPU), ``numel`` each.
        step: pushes encoded so far (part of the state: it keys the per-push randomness).
        bounds: each chunk's ``(start, stop)``.
    """

    whole_key = True

    def __init__(
        self,
        codec: SparseCodec,
        key: Any,
        numel: int,
        bounds: Sequence[tuple[int, int]],
        device: Any = None,
    ) -> None:
        self.codec = codec
        self.numel = numel
        self.key_hash = stable_key_hash(key)
        self.bounds = [(int(a), int(b)) for a, b in bounds]
        if self.bounds and (self.bounds[0][0] != 0 or self.bounds[-1][1] != numel):
            raise CodecError(f"chunk bounds {self.bounds} do not cover [0, {numel})")
        self.step = 0
        self.on_gpu = device is not None
        if self.on_gpu:
            import cupy  # noqa: PLC0415

            self.state = {n: cupy.zeros(numel, dtype=cupy.float32) for n in codec.state_names}
            self._device_starts = cupy.asarray([a for a, _ in self.bounds], dtype=cupy.int64)
        else:
            self.state = {n: np.zeros(numel, dtype=np.float32) for n in codec.state_names}
        self.buffers = _PayloadBuffers(pinned=self.on_gpu)
        self._compiled = _kernel_set() == "numba"
        self._starts = np.array([a for a, _ in self.bounds], dtype=np.int64)
        self._cuts = np.zeros(len(self.bounds) + 1, dtype=np.int64)
        super().__init__(
            [_SparseChunkEncoder(self, i, a, b) for i, (a, b) in enumerate(self.bounds)]
        )

    @property
    def selected_state(self) -> Any:
        """The state array that selection reads and zeroes (``r`` or DGC's ``v``)."""
        return self.state[self.codec.state_names[-1]]

    def begin(self, values: Any, *, finite: bool = False) -> None:
        """Put the whole key's ``values`` into the state, select, and cut the selection by
        chunk (each chunk's :meth:`~_SparseChunkEncoder.encode` then returns its share).

        Unless ``finite`` says the caller checked them, ``values`` are checked for NaN and
        infinities first (one read-only pass): one would stay in the state for good.

        Raises:
            CodecError: ``values`` holds NaN or an infinity (nothing was changed), or has the
                wrong size or dtype.
        """
        if values.size != self.numel or values.dtype != np.float32:
            raise CodecError(
                f"codec {self.codec.name!r}: expected {self.numel} float32 values, got "
                f"{values.size} {values.dtype}"
            )
        if is_cupy_array(values) != self.on_gpu:
            raise CodecError("values and encoder state must both be on the host or the GPU")
        bad = 0 if finite else count_nonfinite(values)
        if bad:
            raise CodecError(
                f"codec {self.codec.name!r}: the values hold {bad} NaN or infinite element(s); "
                f"nothing was encoded and the state is unchanged"
            )
        selection = self.codec.selection(self.numel, self.step, self.key_hash)
        accumulation = self.codec.accumulation()
        if self.on_gpu:
            from kvstore.codecs.sparse import cuda_kernels  # noqa: PLC0415

            self._cuts[:] = cuda_kernels.encode(
                self.state,
                self.codec.state_names,
                values,
                selection,
                accumulation,
                self.buffers,
                self._device_starts,
            )
            self.step += 1
            return
        if self._compiled:
            count = _encode_compiled(self, values, selection, accumulation)
        else:
            indices, picked = self.codec.reference(self.state, values, selection)
            count = indices.size
            self.buffers.ensure(count)
            self.buffers.indices[:count] = indices
            self.buffers.values[:count] = picked
        self.step += 1
        self._cut(count)

    def _cut(self, count: int) -> None:
        """Split the ascending global indices by chunk into chunk-local uint32 indices."""
        buffers = self.buffers
        selected = buffers.indices[:count]
        self._cuts[:-1] = np.searchsorted(selected, self._starts)
        self._cuts[-1] = count
        for i, (start, _) in enumerate(self.bounds):
            lo, hi = self._cuts[i], self._cuts[i + 1]
            np.subtract(selected[lo:hi], start, out=buffers.local[lo:hi], casting="unsafe")

    def payload(self, index: int) -> list[Any]:
        """Chunk ``index``'s frames of the last push: (local indices, values) views."""
        lo, hi = self._cuts[index], self._cuts[index + 1]
        return [self.buffers.local[lo:hi], self.buffers.values[lo:hi]]

    def sent_values(self, index: int) -> np.ndarray:
        """The values chunk ``index``'s last push decodes to on the server (host memory)."""
        return self.buffers.values[self._cuts[index] : self._cuts[index + 1]]


class _SparseChunkEncoder(Encoder):
    """One chunk's view of a :class:`SparseKeyEncoder`: its payload share and its state."""

    def __init__(self, owner: SparseKeyEncoder, index: int, start: int, stop: int) -> None:
        super().__init__(stop - start, "float32")
        self.owner = owner
        self.index = index
        self.start = start
        self.stop = stop
        self.state_names = (*owner.codec.state_names, "step")

    def encode(self, values: Any) -> list[Any]:
        """This chunk's share of the selection made by the key encoder's ``begin`` (which must
        have run for this push; ``values`` were read there)."""
        return self.owner.payload(self.index)

    def quality(self, values: Any) -> PushQuality:
        sent = self.owner.sent_values(self.index)
        kept = self.owner.selected_state[self.start : self.stop]
        return PushQuality(squared_norm(values), squared_norm(kept), int(np.count_nonzero(sent)))

    def state(self) -> dict[str, np.ndarray]:
        """This chunk's slice of every state array (copied to the host), and the key's push
        count ``step`` (a 0-d int64 array, the same in every chunk)."""
        result: dict[str, np.ndarray] = {}
        for name in self.owner.codec.state_names:
            part = self.owner.state[name][self.start : self.stop]
            result[name] = part.get() if is_cupy_array(part) else np.array(part, copy=True)
        result["step"] = np.array(self.owner.step, dtype=np.int64)
        return result

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        names = set(self.state_names)
        if set(state) != names:
            raise CodecError(
                f"codec {self.owner.codec.name!r} keeps state {sorted(names)}, got {sorted(state)}"
            )
        step = np.asarray(state["step"])
        if step.shape != () or step.dtype.kind not in "iu" or int(step) < 0:
            raise CodecError(f"the saved step must be an integer >= 0, got {step!r}")
        for name in self.owner.codec.state_names:
            saved = np.asarray(state[name])
            if saved.shape != (self.numel,) or saved.dtype != np.float32:
                raise CodecError(
                    f"{name} of chunk {self.index} is float32[{self.numel}], the saved state "
                    f"is {saved.dtype}{list(saved.shape)}"
                )
        for name in self.owner.codec.state_names:
            own = self.owner.state[name][self.start : self.stop]
            if is_cupy_array(own):
                own.set(np.ascontiguousarray(state[name]))
            else:
                np.copyto(own, state[name], casting="no")
        self.owner.step = int(step)


class _WholeKeyEncoder(Encoder):
    """An :class:`Encoder` of a single-chunk key: ``encode`` runs the key encoder's ``begin``
    and returns the one chunk's payload (for callers that encode chunks on their own)."""

    def __init__(self, key_encoder: SparseKeyEncoder) -> None:
        super().__init__(key_encoder.numel, "float32")
        self.key_encoder = key_encoder
        self._chunk = key_encoder.chunks[0]
        self.state_names = self._chunk.state_names

    def encode(self, values: Any) -> list[Any]:
        self.key_encoder.begin(values)
        return self._chunk.encode(values)

    def quality(self, values: Any) -> PushQuality | None:
        return self._chunk.quality(values)

    def state(self) -> dict[str, np.ndarray]:
        return self._chunk.state()

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._chunk.load_state(state)


# the compiled CPU path ---------------------------------------------------------------------------


def _as_float32(key: int) -> np.float32:
    """The float32 whose bits are ``key``."""
    return np.array([key], dtype=np.uint32).view(np.float32)[0]


def candidate_capacity(k: int, numel: int) -> int:
    """Room for the candidates of a sampled threshold: when more pass than this (at most the
    key), exact top-k over the whole key decides instead of exact top-k among them."""
    return min(numel, 4 * k + 64)


def _encode_compiled(
    encoder: SparseKeyEncoder, grad: np.ndarray, selection: Selection, acc: Accumulation
) -> int:
    """One push through the numba kernels; returns how many pairs are in ``encoder.buffers``."""
    nb = _numba()
    names = encoder.codec.state_names
    a = encoder.state[names[0]]
    x = encoder.state[names[-1]]
    dgc = acc.momentum is not None
    kind = 1 if dgc else 0
    m = np.float32(acc.momentum if dgc else 0)
    scale = np.float32(1)
    if dgc and acc.clip_norm is not None:
        from kvstore.codecs.sparse.dgc import clip_scale  # noqa: PLC0415

        scale = clip_scale(float(nb.blocked_sum_of_squares(grad, 4096)), acc.clip_norm)
    buffers = encoder.buffers
    n = grad.shape[0]
    if n == 0:
        return 0
    if selection.kind == THRESHOLD:
        buffers.ensure(min(n, 1 << 16) + nb.BLOCK)
        count, position = 0, 0
        while True:
            count, position = nb.threshold_pass(
                a, grad, np.float32(selection.threshold), buffers.indices, buffers.values,
                count, position,
            )  # fmt: skip
            if position >= n:
                return count
            buffers.grow(count)
    k = selection.k
    if selection.kind == RANDOM:
        nb.accumulate(kind, a, x, grad, m, scale, acc.nesterov)
        buffers.ensure(k)
        drawn = np.empty(k, dtype=np.int64)
        keys = np.array(selection.round_keys, dtype=np.uint64)
        nb.permuted_prefix(n, selection.half_bits, keys, drawn)
        nb.sort_distinct(drawn, n, buffers.indices)
        nb.take_and_clear(x, a, dgc, buffers.indices, k, buffers.values)
        return k
    plan = selection.sample
    if plan is None:
        nb.accumulate(kind, a, x, grad, m, scale, acc.nesterov)
        buffers.ensure(k)
        key, quota = nb.kth_largest(x, k)
        count = nb.select_top(x, key, quota, buffers.indices)
        nb.take_and_clear(x, a, dgc, buffers.indices, count, buffers.values)
        return count
    samples = np.empty(plan.count, dtype=np.float32)
    nb.sample_magnitudes(kind, a, x, grad, m, scale, acc.nesterov, plan.start, plan.stride, samples)
    thr_key, _ = nb.kth_largest(samples, plan.top)
    capacity = candidate_capacity(k, n)
    buffers.ensure(max(capacity, k))
    candidates, values = buffers.indices, buffers.values
    count = nb.accumulate_take(
        kind, a, x, grad, m, scale, acc.nesterov, _as_float32(thr_key),
        candidates[:capacity], values[:capacity],
    )  # fmt: skip
    if accepted_count(count, k):  # (so count <= capacity: all were taken)
        if dgc:
            nb.clear(a, candidates, count)
        return count
    nb.untake(x, candidates, values, min(count, capacity))
    if k <= count <= capacity:  # the top k are among the candidates
        key, quota = nb.kth_largest(x, k, candidates, count)
        count = nb.select_top(x, key, quota, candidates, candidates, count)
    else:
        key, quota = nb.kth_largest(x, k)
        count = nb.select_top(x, key, quota, candidates)
    nb.take_and_clear(x, a, dgc, candidates, count, values)
    return count
