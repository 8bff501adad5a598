"""QSGD (Alistarh et al., NeurIPS 2017): unbiased stochastic rounding to ``levels`` levels of
each bucket's 2-norm, fixed-width codes, no residual.

A chunk of ``n`` float32 elements is cut into buckets of ``bucket`` elements (counted from the
chunk's first element; the last bucket may be shorter). Per bucket ``v``, with ``L = levels``::

    norm = float32(sqrt(blocked lane sum of float64(v) * float64(v)))   (float64 sqrt, rounded)
    if norm == 0: every level 0
    else:
        inv  = float32(L) / norm                         (float32 division)
        x[j] = abs(v[j]) * inv                           (float32 multiply)
        t[j] = x[j] + u[j]                               (float32 add)
        level[j] = min(floor(t[j]), L)                   (0 when t[j] is NaN, see below)
    neg[j]  = 1 iff v[j] < 0 and level[j] > 0            (zero codes are 0; -0.0 is not < 0)
    code[j] = (level[j] << 1) | neg[j]

``u[j]`` is the float32 uniform (24 random bits, in ``[0, 1)``) of element ``place.start + j``,
its index in the whole key, of the counter generator's stream ``stream_key(seed, worker, key,
step, PURPOSE)`` (:mod:`kvstore.codecs.counter_rng`). Blocked lane sums are
:func:`kvstore.codecs.quantize.blocked_sum_reference` over the bucket (a bucket of at most
``SUM_BLOCK`` elements is one block). Since ``norm >= max(abs(v))`` exactly (every rounding is
monotonic), ``x <= L`` up to two roundings and ``E[level] = x``: the decoded bucket is unbiased.

Extremes, defined so every implementation agrees: a bucket whose norm overflows float32 (values
near float32's largest) gets ``norm = inf``, ``inv = 0`` and every level 0; a norm so small
that ``inv`` overflows to ``inf`` gives ``x = inf`` (level ``L``) for nonzero elements and
``x = 0 * inf = NaN`` for zeros, which get level 0 (``t >= 1`` is false for NaN).

**Payload** (the family's layout, :mod:`kvstore.codecs.quantize`): the scales frame holds one
float32 norm per bucket (``ceil(n / bucket)``), the codes frame the codes, ``w = 1 +
ceil(log2(L + 1))`` bits each (levels 15 -> 5 bits, 127 -> 8), element ``j`` at bits ``j*w ..
j*w + w - 1`` of the little-endian bit stream, padding bits zero. Bits per element: ``w + 32 /
bucket`` (5.0625 with the defaults, about 6.3x smaller than float32). Decoding, per bucket
``step = norm / float32(L)`` (float32 division)::

    decoded[j] = +0.0                                    if level[j] == 0
                 -(step * float32(level[j])) if neg[j], else step * float32(level[j])

(a level above ``L``, never produced, decodes the same way). No state but the push count
``step``.

Three implementations, identical bytes on any finite input: the numpy reference below,
:mod:`~kvstore.codecs.stochastic.numba_kernels` (the default on the host) and
:mod:`~kvstore.codecs.stochastic.cuda_kernels` (GPU values).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.codecs.base import seed_param
from kvstore.codecs.counter_rng import key_halves, uniforms_reference
from kvstore.codecs.quantize import (
    LANES,
    MAX_CHUNK,
    SUM_BLOCK,
    ChunkPlace,
    QuantizerCodec,
    QuantizerEncoder,
    blocked_sum_reference,
    pack_codes_reference,
    unpack_codes_reference,
)
from kvstore.codecs.stochastic.terngrad import compiled_kernels_usable
from kvstore.errors import CodecError

PURPOSE = 12
"""The purpose word of qsgd's generator streams."""

MAX_LEVELS = 127
"""The most levels: 7 level bits and a sign bit fill a byte."""


def code_width(levels: int) -> int:
    """Bits per code: a sign bit and ``ceil(log2(levels + 1))`` level bits."""
    return 1 + int(levels).bit_length()


# numpy reference -----------------------------------------------------------------------------


def bucket_sums_reference(terms: np.ndarray, bucket: int) -> np.ndarray:
    """The blocked lane sum of each bucket of float64 ``terms`` (non-negative: padding the
    last bucket with +0.0 changes no lane sum)."""
    n = terms.size
    nbuckets = -(-n // bucket)
    if bucket > SUM_BLOCK:
        return np.array(
            [blocked_sum_reference(terms[q * bucket : (q + 1) * bucket]) for q in range(nbuckets)],
            dtype=np.float64,
        )
    # A bucket is one block: the lane sum of its terms (the lane sum of one block sum is it).
    # Lanes past a bucket shorter than 32 stay +0.0, and a lane starting from its first term
    # instead of +0.0 is the same for terms >= +0.0: both are left out.
    width = min(bucket, LANES)
    rows = -(-bucket // width)
    padded = np.zeros((nbuckets, rows * width), dtype=np.float64)
    padded[:, :bucket] = np.pad(terms, (0, nbuckets * bucket - n)).reshape(nbuckets, bucket)
    lanes = np.cumsum(padded.reshape(nbuckets, rows, width), axis=1)[:, -1, :]  # in order
    return np.cumsum(lanes, axis=1)[:, -1] if nbuckets else np.zeros(0)


def norms_reference(values: np.ndarray, bucket: int) -> np.ndarray:
    """Each bucket's float32 2-norm (module docstring)."""
    wide = values.astype(np.float64)
    with np.errstate(over="ignore"):  # a norm beyond float32 is inf (module docstring)
        return np.sqrt(bucket_sums_reference(wide * wide, bucket)).astype(np.float32)


def levels_reference(
    values: np.ndarray, norms: np.ndarray, levels: int, bucket: int, u: np.ndarray
) -> np.ndarray:
    """Every element's level (uint8) for the buckets' ``norms`` and uniforms ``u``."""
    top = np.float32(levels)
    per_element = np.repeat(norms, bucket)[: values.size]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = top / per_element
        t = np.abs(values) * inv + u
    level = np.where(t >= top, top, np.where(t >= 1, np.floor(t), 0))  # NaN -> 0
    level[per_element == 0] = 0
    return level.astype(np.uint8)


def encode_reference(
    values: np.ndarray,
    levels: int,
    bucket: int,
    key: int,
    start: int,
    norms: np.ndarray,
    packed: np.ndarray,
) -> None:
    """Encode a chunk: ``norms`` (float32, one per bucket) and ``packed`` (uint8 codes).

    Args:
        values: float32[n], finite.
        key: the generator's stream key for this push.
        start: the key-global index of ``values[0]``.
    """
    norms[...] = norms_reference(values, bucket)
    level = levels_reference(
        values, norms, levels, bucket, uniforms_reference(key, start, values.size)
    )
    neg = (values < 0) & (level > 0)
    codes = (level << 1) | neg.astype(np.uint8)
    packed[...] = pack_codes_reference(codes, code_width(levels))


def decode_reference(
    norms: np.ndarray,
    levels: int,
    bucket: int,
    packed: np.ndarray,
    n: int,
    out: np.ndarray,
    accumulate: bool,
) -> None:
    """Decode ``n`` codes with the buckets' ``norms`` into float32 ``out`` (added with
    ``accumulate``)."""
    codes = unpack_codes_reference(packed, code_width(levels), n)
    level = codes >> 1
    with np.errstate(over="ignore", invalid="ignore"):  # inf norms: only level 0 is produced
        step = np.asarray(norms, dtype=np.float32) / np.float32(levels)
        magnitude = np.repeat(step, bucket)[:n] * level.astype(np.float32)
    values = np.where(codes & 1 == 1, -magnitude, magnitude)
    values = np.where(level == 0, np.float32(0.0), values).astype(np.float32)
    if accumulate:
        out += values
    else:
        out[...] = values


def count_sent_reference(packed: np.ndarray, levels: int, n: int) -> int:
    """How many of a packed stream's ``n`` codes have a nonzero level."""
    return int(np.count_nonzero(unpack_codes_reference(packed, code_width(levels), n) >> 1))


# codec parts ---------------------------------------------------------------------------------


def _integer_param(name: str, value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CodecError(f"codec 'qsgd': {name} must be an integer, got {value!r}")
    if not low <= int(value) <= high:
        raise CodecError(f"codec 'qsgd': {name} must be {what}, got {value!r}")
    return int(value)


class QsgdEncoder(QuantizerEncoder):
    """The worker-side encoder of one chunk: draws the push's uniforms, keeps only ``step``."""

    codec: QsgdCodec

    def __init__(self, codec: QsgdCodec, place: ChunkPlace, device: Any = None) -> None:
        super().__init__(codec, place, device)
        if self.implementation == "numba" and not compiled_kernels_usable():
            self.implementation = "numpy"

    def encode_reference(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        codec = self.codec
        encode_reference(
            values.reshape(-1),
            codec.levels,
            codec.bucket,
            self.stream_key(PURPOSE),
            self.place.start,
            frames[0].view(np.float32),
            frames[1],
        )

    def encode_compiled(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        from kvstore.codecs.stochastic import numba_kernels  # noqa: PLC0415  (compiles on first use)

        codec = self.codec
        lo, hi = key_halves(self.stream_key(PURPOSE))
        numba_kernels.qsgd_encode(
            np.ascontiguousarray(values.reshape(-1)),
            codec.levels,
            codec.bucket,
            np.uint64(lo),
            np.uint64(hi),
            self.place.start,
            frames[0].view(np.float32),
            frames[1],
            codec.width,
        )

    def encode_cuda(self, values: Any, frames: list[Any]) -> None:
        from kvstore.codecs.stochastic import cuda_kernels  # noqa: PLC0415

        codec = self.codec
        lo, hi = key_halves(self.stream_key(PURPOSE))
        cuda_kernels.qsgd_encode(
            values.reshape(-1),
            codec.levels,
            codec.bucket,
            lo,
            hi,
            self.place.start,
            frames[0],
            frames[1],
            codec.width,
        )


class QsgdCodec(QuantizerCodec):
    """QSGD with fixed-width codes: each element is rounded stochastically to one of
    ``levels + 1`` magnitudes of its bucket's 2-norm, unbiased; ``1 + ceil(log2(levels + 1))``
    bits per element plus one float32 per bucket (5.06 bits with the defaults).

    Args:
        levels: quantization levels ``L`` (integer 1..127, default 15): more levels, less
            variance, wider codes.
        bucket: elements per bucket (integer >= 1, default 512), each with its own norm;
            smaller buckets, less variance, more norms. Buckets never span two chunks.
        seed: the generator's seed (integer in ``[0, 2**63)``, default 0); the worker's rank is
            part of every stream, so workers never share rounding noise.
    """

    infinite_scales = True  # a bucket whose norm overflows float32 goes as zeros
    name = "qsgd"
    param_defaults = {"levels": 15, "bucket": 512, "seed": 0}
    example_params = (
        {"seed": 7},
        {"levels": 1, "bucket": 100},
        {"levels": 127, "bucket": 5000, "seed": 2},
    )
    stochastic = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.levels = _integer_param(
            "levels", self._params["levels"], 1, MAX_LEVELS, f"in 1..{MAX_LEVELS}"
        )
        self.bucket = _integer_param(
            "bucket", self._params["bucket"], 1, MAX_CHUNK, "in 1..2**32 (elements)"
        )
        self.seed = seed_param(self.name, self._params["seed"])
        self.width = code_width(self.levels)
        self._params.update(levels=self.levels, bucket=self.bucket, seed=self.seed)

    def code_bits(self) -> int:
        return self.width

    def scale_count(self, numel: int) -> int:
        return -(-numel // self.bucket)

    def sent_nonzero(self, frames: Sequence[np.ndarray], numel: int) -> int:
        packed = np.asarray(frames[1])
        if compiled_kernels_usable():
            from kvstore.codecs.stochastic import numba_kernels  # noqa: PLC0415

            return int(numba_kernels.count_codes_at_least(packed, numel, self.width, 2))
        return count_sent_reference(packed, self.levels, numel)

    def make_chunk_encoder(self, place: ChunkPlace, device: Any = None) -> QsgdEncoder:
        return QsgdEncoder(self, place, device)

    def decode_into(
        self,
        frames: Sequence[np.ndarray],
        numel: int,
        out: np.ndarray,
        accumulate: bool,
        implementation: str,
    ) -> None:
        norms = np.frombuffer(frames[0], dtype=np.float32)
        packed = np.asarray(frames[1])
        if implementation == "numba" and compiled_kernels_usable():
            from kvstore.codecs.stochastic import numba_kernels  # noqa: PLC0415

            numba_kernels.qsgd_decode(
                norms, self.levels, self.bucket, packed, numel, self.width, out, accumulate
            )
        elif implementation in ("numba", "numpy"):
            decode_reference(norms, self.levels, self.bucket, packed, numel, out, accumulate)
        else:
            raise CodecError(
                f"unknown CPU kernel set {implementation!r}; expected 'numba' or 'numpy'"
            )
