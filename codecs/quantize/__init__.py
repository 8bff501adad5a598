"""What the quantizing codecs (``1bit``, ``efsign``, ``terngrad``, ``qsgd``, ``fp16``, ``bf16``)
share: payload layout, per-chunk scales, bit packing, exact reductions, encoders, aggregation.

Every element of a chunk becomes a fixed-width code; a chunk's codes travel with a few float32
*scales* computed from that chunk alone (the unit one server receives, so a key smaller than one
partition is one chunk). The server decodes each push with its scales and adds it to the round's
float32 sum.

**Payload** of one chunk of ``n`` elements: two frames, the scales (float32, a count that
depends only on ``n``: :meth:`QuantizerCodec.scale_count`) and the packed codes
(:func:`packed_nbytes` bytes). Codes are ``w`` bits wide (``1 <= w <= 8``) and packed as one
little-endian bit stream: element ``j``'s code occupies bits ``j*w .. j*w + w - 1`` of the stream
(bit ``b`` of the stream is bit ``b % 8`` of byte ``b // 8``); the bits after the last code are
zero. Eight codes are always exactly ``w`` bytes, which is how the kernels write them (one group
of eight per step). The sizes are fixed, so the server checks them before anything is touched.
The 16-bit casts have no scales: their one frame holds the 16-bit values.

**Exact reductions.** Scales are means and norms of a chunk. So that the numpy reference, the
numba kernel and the CuPy kernel agree bit for bit, every sum has one order, the *blocked lane
sum* (:func:`blocked_sum_reference`), computed in float64 from the float32 terms:

* the chunk is cut into blocks of :data:`SUM_BLOCK` elements (the last may be shorter);
* within a block, element ``j`` (block-local) goes to lane ``j % 32``; each lane is summed in
  index order, starting from ``+0.0``; the block's sum is lane 0 + lane 1 + ... + lane 31, in
  that order, starting from ``+0.0`` (:func:`lane_sum_reference`);
* the block sums are themselves lane-summed the same way.

32 lanes are a warp on a GPU (each thread one lane, loads coalesced) and eight 4-wide float64
vectors on a CPU (independent chains, so the loop is not bound by the latency of one add).
Maxima (``max(abs(x))``) need no order.

**Randomness** (``terngrad``, ``qsgd``): :mod:`kvstore.codecs.counter_rng`, keyed by the codec's
seed, the worker's rank, the key, the push count and the element's index in the whole key.

**Encoders**: one per chunk (:class:`QuantizerEncoder`), made by :class:`QuantizerKeyEncoder`,
which checks a push's values once (size, dtype, device, NaN and infinities: a
:class:`~kvstore.errors.CodecError` and no state touched) before any chunk is encoded. Each
encoder runs one of three implementations with one contract (identical payload bytes and
state): the codec's numpy reference (``KVSTORE_CPU_KERNELS=numpy``), its numba kernels (the
default on the host) or its CuPy kernels (GPU values). GPU encoders write the payload on the
device and copy it into pinned host buffers.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from kvstore.codecs.base import (
    Aggregator,
    Codec,
    Encoder,
    KeyEncoder,
    Payloads,
    PushQuality,
    frame_array,
    squared_norm,
)
from kvstore.codecs.counter_rng import stable_key_hash, stream_key
from kvstore.codecs.finite import count_nonfinite
from kvstore.codecs.xp import is_cupy_array, pinned_empty
from kvstore.config import cpu_kernels_from_env
from kvstore.errors import CodecError

LANES = 32
"""Lanes of a blocked lane sum (a warp)."""

SUM_BLOCK = 4096
"""Elements per block of a blocked lane sum."""

MAX_CHUNK = 1 << 32
"""Elements a key may have: element indices key the generator as 32-bit words."""


# exact reductions (numpy references) ---------------------------------------------------------


def lane_sum_reference(values: np.ndarray) -> float:
    """The lane sum of float64 ``values``: lane ``l`` sums ``values[l::32]`` in order from
    ``+0.0``; the result is lane 0 + ... + lane 31 in order from ``+0.0``."""
    values = np.asarray(values, dtype=np.float64)
    rows = -(-values.size // LANES)
    table = np.zeros((rows + 1, LANES), dtype=np.float64)  # row 0: the +0.0 every lane starts at
    table.reshape(-1)[LANES : LANES + values.size] = values
    lanes = np.cumsum(table, axis=0)[-1]  # cumsum: strictly in order, unlike np.sum
    return float(np.cumsum(np.concatenate(([0.0], lanes)))[-1])


def block_sums_reference(values: np.ndarray, block: int = SUM_BLOCK) -> np.ndarray:
    """The lane sums of each block of ``block`` elements of float64 ``values`` (float64)."""
    values = np.asarray(values, dtype=np.float64)
    nblocks = -(-values.size // block)
    if nblocks == 0:
        return np.zeros(0, dtype=np.float64)
    rows = block // LANES
    padded = np.zeros(nblocks * block, dtype=np.float64)
    padded[: values.size] = values
    table = np.zeros((nblocks, rows + 1, LANES), dtype=np.float64)  # row 0: +0.0 starts
    table[:, 1:, :] = padded.reshape(nblocks, rows, LANES)
    lanes = np.cumsum(table, axis=1)[:, -1, :]
    with_zero = np.concatenate((np.zeros((nblocks, 1)), lanes), axis=1)
    return np.cumsum(with_zero, axis=1)[:, -1]


def blocked_sum_reference(values: np.ndarray, block: int = SUM_BLOCK) -> float:
    """The blocked lane sum of float64 ``values`` (see the module docstring)."""
    if block % LANES:
        raise ValueError(f"block must be a multiple of {LANES}, got {block}")
    return lane_sum_reference(block_sums_reference(values, block))


# bit packing -------------------------------------------------------------------------------


def packed_nbytes(numel: int, width: int) -> int:
    """Bytes of ``numel`` codes of ``width`` bits."""
    return -(-numel * width // 8)


def pack_codes_reference(codes: np.ndarray, width: int) -> np.ndarray:
    """Pack codes (integers below ``2**width``) into the little-endian bit stream (uint8)."""
    codes = np.asarray(codes, dtype=np.uint8)
    bits = (codes[:, None] >> np.arange(width, dtype=np.uint8)) & np.uint8(1)
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_codes_reference(packed: np.ndarray, width: int, numel: int) -> np.ndarray:
    """The ``numel`` codes of a packed stream (uint8)."""
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), bitorder="little")
    rows = bits[: numel * width].reshape(numel, width)
    return (rows << np.arange(width, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)


# codec, encoders, aggregator ---------------------------------------------------------------


class ChunkPlace(NamedTuple):
    """Where a chunk sits: what its encoder's generator is keyed with.

    Attributes:
        start: the key-global index of the chunk's first element.
        numel: elements of the chunk.
        key_hash: :func:`~kvstore.codecs.counter_rng.stable_key_hash` of the key.
        worker: the pushing worker's rank.
    """

    start: int
    numel: int
    key_hash: int = 0
    worker: int = 0


def kernel_set() -> str:
    """``"numba"`` or ``"numpy"`` (``KVSTORE_CPU_KERNELS``), read when an encoder is made."""
    return cpu_kernels_from_env()


class QuantizerEncoder(Encoder):
    """The worker-side encoder of one chunk for a quantizing codec.

    Subclasses set :attr:`state_names` (``("residual",)`` for error feedback) and implement
    :meth:`encode_reference`, :meth:`encode_compiled` and :meth:`encode_cuda`, which write the
    payload into :attr:`scales` and :attr:`codes` (device arrays for the CUDA one, which this
    class then copies into the host buffers).

    Attributes:
        codec: the codec.
        place: the chunk's place in its key.
        on_gpu: the state lives on a GPU.
        implementation: ``"numpy"``, ``"numba"`` or ``"cupy"``.
        step: pushes encoded so far; a stochastic codec's state (it keys the generator).
        scales, codes: the host payload buffers of the last push (pinned for GPU encoders).
    """

    def __init__(self, codec: QuantizerCodec, place: ChunkPlace, device: Any = None) -> None:
        super().__init__(place.numel, "float32")
        self.codec = codec
        self.place = place
        self.on_gpu = device is not None
        self.implementation = "cupy" if self.on_gpu else kernel_set()
        self.step = 0
        self.checked = False
        sizes = codec.payload_nbytes(place.numel, "float32")
        empty = pinned_empty if self.on_gpu else np.empty
        self.frames = [empty(size, np.uint8) for size in sizes]
        if self.on_gpu:
            import cupy  # noqa: PLC0415

            self.device_frames = [cupy.empty(size, dtype=cupy.uint8) for size in sizes]

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return (*self.codec.state_arrays, *(("step",) if self.codec.stochastic else ()))

    def zeros(self) -> Any:
        """A float32 state array of the chunk's length, on the encoder's device."""
        if self.on_gpu:
            import cupy  # noqa: PLC0415

            return cupy.zeros(self.numel, dtype=cupy.float32)
        return np.zeros(self.numel, dtype=np.float32)

    def stream_key(self, purpose: int) -> int:
        """The generator's 64-bit stream key for this push (keyed with the codec's seed)."""
        return stream_key(
            int(getattr(self.codec, "seed", 0)),
            self.place.worker,
            self.place.key_hash,
            self.step,
            purpose,
        )

    def encode(self, values: Any) -> list[Any]:
        if not self.checked:
            check_values(self.codec.name, values, self.numel, self.on_gpu)
        self.checked = False
        if self.implementation == "cupy":
            from kvstore.codecs.xp import device_to_host  # noqa: PLC0415

            self.encode_cuda(values, self.device_frames)
            for device_frame, host_frame in zip(self.device_frames, self.frames, strict=True):
                device_to_host(device_frame, host_frame)
        elif self.implementation == "numba":
            self.encode_compiled(values, self.frames)
        else:
            self.encode_reference(values, self.frames)
        self.step += 1
        return list(self.frames)

    @abstractmethod
    def encode_reference(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        """The numpy reference: update the state from ``values``; fill the uint8 ``frames``."""

    @abstractmethod
    def encode_compiled(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        """The numba kernels: exactly what :meth:`encode_reference` does."""

    @abstractmethod
    def encode_cuda(self, values: Any, frames: list[Any]) -> None:
        """The CuPy kernels (CuPy ``values`` and ``frames``): exactly the same."""

    def quality(self, values: Any) -> PushQuality:
        residual = getattr(self, "residual", None)
        kept = 0.0 if residual is None else squared_norm(residual)
        return PushQuality(
            squared_norm(values), kept, self.codec.sent_nonzero(self.frames, self.numel)
        )

    def state(self) -> dict[str, np.ndarray]:
        result = {}
        for name in self.codec.state_arrays:
            array = getattr(self, name)
            result[name] = array.get() if is_cupy_array(array) else np.array(array, copy=True)
        if self.codec.stochastic:
            result["step"] = np.array(self.step, dtype=np.int64)
        return result

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        if set(state) != set(self.state_names):
            raise CodecError(
                f"codec {self.codec.name!r} keeps state {sorted(self.state_names)}, "
                f"got {sorted(state)}"
            )
        if self.codec.stochastic:
            step = np.asarray(state["step"])
            if step.shape != () or step.dtype.kind not in "iu" or int(step) < 0:
                raise CodecError(f"the saved step must be an integer >= 0, got {step!r}")
        for name in self.codec.state_arrays:
            saved = np.asarray(state[name])
            if saved.shape != (self.numel,) or saved.dtype != np.float32:
                raise CodecError(
                    f"{name} is float32[{self.numel}], the saved state is "
                    f"{saved.dtype}{list(saved.shape)}"
                )
        for name in self.codec.state_arrays:
            own = getattr(self, name)
            if is_cupy_array(own):
                own.set(np.ascontiguousarray(state[name]))
            else:
                np.copyto(own, state[name], casting="no")
        if self.codec.stochastic:
            self.step = int(state["step"])


def check_values(codec: str, values: Any, numel: int, on_gpu: bool) -> None:
    """Raise CodecError unless ``values`` are ``numel`` finite float32 on the encoder's side."""
    if values.size != numel or values.dtype != np.float32:
        raise CodecError(
            f"codec {codec!r}: expected {numel} float32 values, got {values.size} {values.dtype}"
        )
    if is_cupy_array(values) != on_gpu:
        raise CodecError(
            f"codec {codec!r}: values and encoder state must both be on the host or GPU"
        )
    bad = count_nonfinite(values)
    if bad:
        raise CodecError(
            f"codec {codec!r}: the values hold {bad} NaN or infinite element(s); nothing was "
            f"encoded and the state is unchanged"
        )


class QuantizerKeyEncoder(KeyEncoder):
    """The chunks' encoders of one key, and the once-per-push check of the whole value."""

    chunks: Sequence[QuantizerEncoder]

    def __init__(self, codec: QuantizerCodec, numel: int, chunks: Sequence[QuantizerEncoder]):
        super().__init__(chunks)
        self.codec = codec
        self.numel = numel
        self.on_gpu = bool(chunks) and chunks[0].on_gpu

    def begin(self, values: Any, *, finite: bool = False) -> None:
        """Check the push's values once (size, dtype, device; NaN and infinities unless the
        caller checked them), so each chunk's encode need not.

        Raises:
            CodecError: bad values; no chunk's state was touched.
        """
        if finite:
            if values.size != self.numel or values.dtype != np.float32:
                check_values(self.codec.name, values, self.numel, self.on_gpu)
        else:
            check_values(self.codec.name, values, self.numel, self.on_gpu)
        for chunk in self.chunks:
            chunk.checked = True


class DecodeSumAggregator(Aggregator):
    """Decodes each push with its own scales and adds it to the round's float32 sum, in the
    order the pushes arrive (the first one overwrites)."""

    def __init__(self, codec: QuantizerCodec, numel: int) -> None:
        super().__init__(numel, "float32")
        self.codec = codec
        self.implementation = kernel_set()

    def add(self, payloads: Payloads, first: bool) -> None:
        frames = [frame_array(frame, np.uint8) for frame in payloads]
        self.codec.check_scales(frames, self.numel)  # before the sum is touched
        self.codec.decode_into(frames, self.numel, self.result, not first, self.implementation)


class QuantizerCodec(Codec):
    """A codec of the quantizing family: fixed-size payload, decoded and summed by the server.

    Subclasses set :attr:`name`, :attr:`param_defaults`, :attr:`state_arrays`,
    :attr:`stochastic`, and implement :meth:`code_bits`, :meth:`scale_count`,
    :meth:`make_chunk_encoder` and :meth:`decode_into`.
    """

    dtypes = frozenset({"float32"})
    state_arrays: ClassVar[tuple[str, ...]] = ()
    """Names of the encoders' float32 per-element state arrays (``("residual",)``)."""
    stochastic: ClassVar[bool] = False
    """True when encoding draws random numbers (the encoder then keeps its push count)."""

    infinite_scales: ClassVar[bool] = False
    """True where a scale may be infinite in a valid push (``qsgd``: a bucket whose norm
    overflows float32 is sent as zeros); NaN is never valid."""

    def check_scales(self, frames: Sequence[np.ndarray], numel: int) -> None:
        """Raise CodecError if a push's scales (its first frame, where the codec has scales)
        are NaN, or infinite where the codec never sends that: a worker never does, and one
        such scale would turn the round's whole sum into NaN."""
        if self.scale_count(numel) == 0:
            return
        scales = np.frombuffer(frames[0], dtype=np.float32)
        bad = np.isnan(scales) if self.infinite_scales else ~np.isfinite(scales)
        if bad.any():
            raise CodecError(
                f"codec {self.name!r}: a push of a {numel}-element chunk has "
                f"{int(bad.sum())} {'NaN' if self.infinite_scales else 'non-finite'} scale(s) "
                f"(the first at {int(np.argmax(bad))}); nothing was added"
            )

    @abstractmethod
    def code_bits(self) -> int:
        """Bits per element code (1 to 8)."""

    @abstractmethod
    def scale_count(self, numel: int) -> int:
        """float32 scales per chunk of ``numel`` elements."""

    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...]:
        return (4 * self.scale_count(numel), packed_nbytes(numel, self.code_bits()))

    def sent_nonzero(self, frames: Sequence[np.ndarray], numel: int) -> int:
        """How many elements the push of ``frames`` sent as nonzero (for the metrics; every
        element unless the codec says otherwise)."""
        return numel

    @abstractmethod
    def make_chunk_encoder(self, place: ChunkPlace, device: Any = None) -> QuantizerEncoder:
        """The encoder of one chunk."""

    @abstractmethod
    def decode_into(
        self,
        frames: Sequence[np.ndarray],
        numel: int,
        out: np.ndarray,
        accumulate: bool,
        implementation: str,
    ) -> None:
        """Decode one push (its uint8 ``frames``, sizes already checked) of a chunk of
        ``numel`` elements into float32 ``out``: written, or added with ``accumulate``.
        ``implementation``: ``"numba"`` or ``"numpy"``, same bits."""

    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        self.check_dtype(dtype)
        return self.make_chunk_encoder(ChunkPlace(0, numel), device)

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
    ) -> KeyEncoder:
        self.check_dtype(dtype)
        if numel > MAX_CHUNK:
            raise CodecError(f"codec {self.name!r} handles keys of up to 2**32 elements")
        key_hash = stable_key_hash(key)
        chunks = [
            self.make_chunk_encoder(ChunkPlace(start, stop - start, key_hash, worker), device)
            for start, stop in bounds
        ]
        return QuantizerKeyEncoder(self, numel, chunks)

    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        self.check_dtype(dtype)
        return DecodeSumAggregator(self, numel)
