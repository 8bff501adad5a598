"""The ``topk2bit`` codec: top-k of an error-feedback residual, the kept values sent in 2 bits.

SparseLoCo's compression of pseudo-gradients (top-k, 2-bit quantization of what is kept, error
feedback of both the values not sent and the quantization error). Per push, with float32
residual ``r`` (one per key per worker, zero at start) and ``k = max(1, ceil(ratio * n))`` over
the whole key, selected exactly as :mod:`kvstore.codecs.sparse.topk` does (the same code,
``sample`` included)::

    r += g
    S  = select(abs(r), k)                          (ascending)
    v  = r[S]
    per server chunk, over the chunk's share of v (so that each chunk's message decodes alone):
        lo = min(abs(v)),  hi = max(abs(v))         (0, 0 for a chunk that sends nothing)
        span = hi - lo
        mid  = lo + span * 0.5
        low  = lo + span * 0.25,  high = lo + span * 0.75
        code: bit 0 (magnitude) = abs(v) >= mid,  bit 1 (sign) = v < 0
        decoded = +-(high if bit 0 else low)        (the centre of the half of [lo, hi] it is in)
    r[S] -= decoded                                 (the quantization error stays in r)

Every product and sum above is one float32 operation in that order, and ``mid``, ``low`` and
``high`` are computed once per chunk by the same numpy float32 scalar code whichever
implementation encodes; the reductions are min and max (order-independent). So the numpy
reference here, the numba kernels of :mod:`kvstore.codecs.sparse.numba_kernels` and the GPU path
give identical bytes and residuals. (``mid`` is written ``lo + span * 0.5`` rather than
``(lo + hi) / 2`` so that it cannot overflow; ``span * 0.25`` and ``span * 0.75`` round once.)

**Payload** of a chunk: three frames, the chunk-local indices (uint32, strictly ascending, as
in the rest of the sparse family), the codes packed four per byte (code ``j`` in bits
``2 * (j % 4)`` and up of byte ``j // 4``, the last byte's unused bits zero), and ``lo, hi``
(two float32). A chunk that sends ``c`` elements costs ``32 c + 8 ceil(c / 4) + 64`` bits.

**Validation** (the server, every push): three frames; whole uint32 indices; ``ceil(c / 4)``
code bytes; an 8-byte range; ``lo`` and ``hi`` finite with ``0 <= lo <= hi``; the unused code
bits zero; indices as the sparse family checks them (at most the chunk's length, strictly
ascending, in range). A bad payload raises :class:`~kvstore.errors.CodecError` naming what is
wrong, before anything is touched.

**Server**: each push is decoded to its values and scatter-added with the sparse family's
``scatter_add`` (a round's first push zeroes the sum first), as
:class:`~kvstore.codecs.sparse.SparseAggregator` does with plain values.

**Not relayed**: the family's relay sums (indices, values) frames, and this payload is not
that; without pull compression, pulls of its keys are dense. **A pull codec**
(:mod:`kvstore.codecs.pulled`): a delta ``w - w_pub`` is encoded with this codec (residual
cleared first; the quantization error stays in ``w - w_pub``) and both ends add its decoded
values with the aggregator above, so every worker holds the server's bits.

**GPU values**: the selection runs on the device (the family's CuPy code), which copies the
selected values to the host for the payload anyway; the ``k`` values are quantized there by the
same host code, and the ``k`` quantization errors are written back into the device residual
(:func:`kvstore.codecs.sparse.cuda_kernels.assign`, a bit copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.codecs.base import Aggregator, Payloads, frame_array, frame_nbytes
from kvstore.codecs.sparse import (
    INDEX_DTYPE,
    SparseKeyEncoder,
    check_indices,
    scatter_add,
    top_count,
    zero_fill,
)
from kvstore.codecs.sparse.topk import TopKCodec
from kvstore.codecs.sparse.topk import encode_reference as select_and_take_reference
from kvstore.config import cpu_kernels_from_env
from kvstore.errors import CodecError

RANGE_DTYPE = np.dtype(np.float32)
"""Wire dtype of a chunk's ``lo, hi``."""

_HALF, _QUARTER, _THREE_QUARTERS = np.float32(0.5), np.float32(0.25), np.float32(0.75)


def levels(lo: np.float32, hi: np.float32) -> tuple[np.float32, np.float32, np.float32]:
    """``(mid, low, high)`` of a chunk whose kept magnitudes span ``[lo, hi]``: the threshold of
    the magnitude bit and the two decoded magnitudes, in float32 (module docstring)."""
    lo, hi = np.float32(lo), np.float32(hi)
    span = hi - lo
    return lo + span * _HALF, lo + span * _QUARTER, lo + span * _THREE_QUARTERS


def code_bytes(count: int) -> int:
    """Bytes of the packed codes of ``count`` elements (four per byte)."""
    return (count + 3) // 4


def magnitude_range_reference(values: np.ndarray) -> tuple[np.float32, np.float32]:
    """``(min(abs(values)), max(abs(values)))`` in float32; ``(0, 0)`` when empty."""
    if values.size == 0:
        return np.float32(0), np.float32(0)
    magnitudes = np.abs(values)
    return np.float32(magnitudes.min()), np.float32(magnitudes.max())


def quantize_reference(
    values: np.ndarray,
) -> tuple[np.ndarray, np.float32, np.float32, np.ndarray]:
    """One chunk's share of the selected values: (packed codes, lo, hi, decoded values)."""
    lo, hi = magnitude_range_reference(values)
    mid, low, high = levels(lo, hi)
    big = np.abs(values) >= mid
    negative = values < 0
    codes = big.astype(np.uint8) | (negative.astype(np.uint8) << 1)
    padded = np.zeros(4 * code_bytes(values.size), dtype=np.uint8)
    padded[: values.size] = codes
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
    packed = np.bitwise_or.reduce(padded.reshape(-1, 4) << shifts, axis=1).astype(np.uint8)
    magnitude = np.where(big, high, low).astype(np.float32)
    decoded = np.where(negative, -magnitude, magnitude).astype(np.float32)
    return packed, lo, hi, decoded


def decode_reference(codes: np.ndarray, count: int, lo: np.float32, hi: np.float32) -> np.ndarray:
    """The ``count`` float32 values that ``codes`` (packed) and ``lo, hi`` decode to."""
    _, low, high = levels(lo, hi)
    positions = np.arange(count)
    code = (codes[positions // 4] >> (2 * (positions % 4)).astype(np.uint8)) & 3
    magnitude = np.where(code & 1, high, low).astype(np.float32)
    return np.where(code & 2, -magnitude, magnitude).astype(np.float32)


def encode_reference(
    residual: np.ndarray,
    grad: np.ndarray,
    k: int,
    plan: Any,
    bounds: Sequence[tuple[int, int]],
) -> list[tuple[np.ndarray, np.ndarray, np.float32, np.float32]]:
    """The numpy reference of one push of a key cut at ``bounds``: update ``residual`` in
    place, and return each chunk's (local uint32 indices, packed codes, lo, hi).
    ``plan``: top-k's sample plan (None: exact)."""
    indices, values = select_and_take_reference(residual, grad, k, plan)  # r[S] is now 0
    decoded = np.empty_like(values)
    chunks = []
    for start, stop in bounds:
        a, b = np.searchsorted(indices, [start, stop])
        codes, lo, hi, decoded[a:b] = quantize_reference(values[a:b])
        chunks.append(((indices[a:b] - start).astype(INDEX_DTYPE), codes, lo, hi))
    residual[indices] = values - decoded  # r[S] -= decoded, with r[S] == values before
    return chunks


# payloads and the server -------------------------------------------------------------------


def _numba() -> Any:
    from kvstore.codecs.sparse import numba_kernels  # noqa: PLC0415  (compiles on first use)

    return numba_kernels


def validate_payloads(
    payloads: Payloads, numel: int, compiled: bool | None = None
) -> tuple[np.ndarray, np.ndarray, np.float32, np.float32]:
    """Check one push of a ``numel``-element chunk; return (indices, packed codes, lo, hi),
    the arrays read-only views of the frames.

    Raises:
        CodecError: not three frames, wrong frame sizes, a range that is not finite or has
            ``lo > hi`` or ``lo < 0``, unused code bits set, or indices the sparse family
            refuses (the message says which).
    """
    where = f"codec 'topk2bit': a push of a {numel}-element chunk"
    if len(payloads) != 3:
        raise CodecError(
            f"{where} needs 3 payload frames (indices, codes, range), got {len(payloads)}"
        )
    index_bytes, code_nbytes, range_bytes = (frame_nbytes(p) for p in payloads)
    if index_bytes % INDEX_DTYPE.itemsize:
        raise CodecError(f"{where}: an index frame of {index_bytes} bytes is not whole uint32s")
    count = index_bytes // INDEX_DTYPE.itemsize
    if code_nbytes != code_bytes(count):
        raise CodecError(
            f"{where}: {count} indices need {code_bytes(count)} code bytes, got {code_nbytes}"
        )
    if range_bytes != 2 * RANGE_DTYPE.itemsize:
        raise CodecError(f"{where}: the range frame (lo, hi) must be 8 bytes, got {range_bytes}")
    indices = frame_array(payloads[0], INDEX_DTYPE)
    codes = frame_array(payloads[1], np.uint8)
    lo, hi = (np.float32(x) for x in frame_array(payloads[2], RANGE_DTYPE))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise CodecError(f"{where}: the range (lo, hi) = ({lo}, {hi}) is not finite")
    if not 0 <= lo <= hi:
        raise CodecError(f"{where}: the range (lo, hi) = ({lo}, {hi}) needs 0 <= lo <= hi")
    if count % 4 and int(codes[-1]) >> (2 * (count % 4)):
        raise CodecError(f"{where}: the unused bits of the last code byte must be 0")
    if compiled is None:
        compiled = cpu_kernels_from_env() == "numba"
    check_indices(indices, numel, where, compiled)
    return indices, codes, lo, hi


class TopK2BitAggregator(Aggregator):
    """A round's sum of ``topk2bit`` pushes: each push decoded, then scatter-added in arrival
    order (the first zeroes the sum)."""

    def __init__(self, numel: int, dtype: str) -> None:
        super().__init__(numel, dtype)
        self._compiled = cpu_kernels_from_env() == "numba"
        self._values = np.empty(0, np.float32)

    def add(self, payloads: Payloads, first: bool) -> None:
        indices, codes, lo, hi = validate_payloads(payloads, self.numel, self._compiled)
        if self._values.size < indices.size:
            self._values = np.empty(max(indices.size, 2 * self._values.size), np.float32)
        values = self._values[: indices.size]
        if self._compiled:
            _, low, high = levels(lo, hi)
            _numba().decode_2bit(codes, low, high, values)
        else:
            values[...] = decode_reference(codes, indices.size, lo, hi)
        if first:
            zero_fill(self.result)
        scatter_add(self.result, indices, values, self._compiled)


# the worker --------------------------------------------------------------------------------


def _quantize_compiled(
    values: np.ndarray, codes: np.ndarray, decoded: np.ndarray
) -> tuple[np.float32, np.float32]:
    nb = _numba()
    lo, hi = nb.magnitude_range(values)
    lo, hi = np.float32(lo), np.float32(hi)
    mid, low, high = levels(lo, hi)
    nb.quantize_2bit(values, mid, low, high, codes, decoded)
    return lo, hi


class TopK2BitKeyEncoder(SparseKeyEncoder):
    """The encoder of one key: top-k's selection (:class:`SparseKeyEncoder`), then each
    chunk's share quantized to 2 bits and the quantization errors put back into the residual.

    Attributes (besides the family's): ``codes`` (the packed codes of every chunk, one after
    the other), ``ranges`` (each chunk's ``lo, hi``), ``decoded`` and ``errors`` (per selected
    element, in selection order).
    """

    def __init__(
        self,
        codec: TopK2BitCodec,
        key: Any,
        numel: int,
        bounds: Sequence[tuple[int, int]],
        device: Any = None,
    ) -> None:
        super().__init__(codec, key, numel, bounds, device)
        self.ranges = np.zeros((len(self.bounds), 2), dtype=RANGE_DTYPE)
        self.codes = np.empty(0, np.uint8)
        self.decoded = np.empty(0, np.float32)
        self.errors = np.empty(0, np.float32)
        self._code_cuts = np.zeros(len(self.bounds) + 1, dtype=np.int64)

    def begin(self, values: Any, *, finite: bool = False) -> None:
        """Select as ``topk`` does (the family's ``begin``: same checks, same errors), then
        quantize each chunk's share and keep the quantization errors in the residual."""
        super().begin(values, finite=finite)
        count = int(self._cuts[-1])
        if self.decoded.size < count:
            self.decoded = np.empty(max(count, 2 * self.decoded.size), np.float32)
            self.errors = np.empty_like(self.decoded)
        room = code_bytes(count) + len(self.bounds)  # each chunk rounds up by at most one byte
        if self.codes.size < room:
            self.codes = np.empty(max(room, 2 * self.codes.size), np.uint8)
        selected = self.buffers.values
        for index in range(len(self.bounds)):
            a, b = int(self._cuts[index]), int(self._cuts[index + 1])
            first_code = int(self._code_cuts[index])
            end_code = first_code + code_bytes(b - a)
            self._code_cuts[index + 1] = end_code
            codes, decoded = self.codes[first_code:end_code], self.decoded[a:b]
            if self._compiled:
                lo, hi = _quantize_compiled(selected[a:b], codes, decoded)
            else:
                codes[...], lo, hi, decoded[...] = quantize_reference(selected[a:b])
            self.ranges[index] = lo, hi
        errors = np.subtract(selected[:count], self.decoded[:count], out=self.errors[:count])
        self._write_back(count, errors)

    def _write_back(self, count: int, errors: np.ndarray) -> None:
        """``r[S] = errors``: the selection left ``r[S]`` zero; ``errors`` is ``v - decoded``."""
        residual = self.selected_state
        if not self.on_gpu:
            residual[self.buffers.indices[:count]] = errors
            return
        from kvstore.codecs.sparse import cuda_kernels  # noqa: PLC0415

        indices = np.empty(count, dtype=np.int64)
        for index, (start, _) in enumerate(self.bounds):
            a, b = int(self._cuts[index]), int(self._cuts[index + 1])
            indices[a:b] = self.buffers.local[a:b].astype(np.int64) + start
        cuda_kernels.assign(residual, indices, errors)

    def payload(self, index: int) -> list[Any]:
        """Chunk ``index``'s frames of the last push: local indices, packed codes, ``lo, hi``."""
        a, b = self._cuts[index], self._cuts[index + 1]
        codes = self.codes[self._code_cuts[index] : self._code_cuts[index + 1]]
        return [self.buffers.local[a:b], codes, self.ranges[index]]

    def sent_values(self, index: int) -> np.ndarray:
        return self.decoded[self._cuts[index] : self._cuts[index + 1]]


class TopK2BitCodec(TopKCodec):
    """Top-k of the error-feedback residual, the kept values in 2 bits (module docstring).

    Args:
        ratio: density in (0, 1] (default 0.01).
        sample: fraction of the key sampled to estimate the top-k threshold, in [0, 1]
            (default 0.01); 0 selects exactly.
    """

    name = "topk2bit"
    relayable = False

    def pushed_fraction(self, numel: int, dtype: str) -> float:
        if numel == 0:
            return 1.0
        count = top_count(self.ratio, numel)
        nbytes = count * INDEX_DTYPE.itemsize + code_bytes(count) + 2 * RANGE_DTYPE.itemsize
        return min(1.0, nbytes / (numel * 4))

    def validate_payloads(self, payloads: Payloads, numel: int, dtype: str) -> None:
        self.check_dtype(dtype)
        validate_payloads(payloads, numel)

    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        self.check_dtype(dtype)
        return TopK2BitAggregator(numel, dtype)

    def sum_relay(self, pushes: Sequence[Payloads], numel: int, dtype: str, out: Any) -> None:
        raise CodecError(f"codec {self.name!r} does not relay pulls")

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
    ) -> TopK2BitKeyEncoder:
        self.check_dtype(dtype)
        return TopK2BitKeyEncoder(self, key, numel, bounds, device)
