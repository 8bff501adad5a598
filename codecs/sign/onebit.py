"""``1bit``: 1-bit SGD with error feedback (Seide et al. 2014), one pair of levels per chunk;
and what the sign quantizers (``1bit``, ``efsign``) share.

A *sign quantizer* sends one bit per element and a chunk's two reconstruction levels ``hi``
(bit 1) and ``lo`` (bit 0). Per chunk of ``n`` elements, with a float32 residual ``r`` (one per
chunk per worker, zero at start; state ``("residual",)``; nothing random)::

    p = r + g                                   float32 add, saturated (below)
    bit[j] = 1 if p[j] >= 0 else 0              -0.0 >= 0: a zero of either sign sends 1
    decoded[j] = hi if bit[j] else lo
    r = p - decoded                             float32 subtract

The residual is in gradient units: the workers push raw gradients, the server's optimizer
applies the learning rate to the decoded sum (as CNTK's 1-bit SGD does), so what a push did
not send is simply carried into the next one.

``1bit``'s levels are the means of the two sides of ``p`` (CNTK's zero threshold)::

    S_pos = blocked lane sum of (p[j] if p[j] >= 0 else +0.0)      float64
    S_neg = blocked lane sum of (p[j] if p[j] <  0 else +0.0)      float64
    c_pos = count of p[j] >= 0;  c_neg = n - c_pos
    hi = a = float32(S_pos / c_pos) if c_pos else +0.0      float64 division, one rounding
    lo = b = float32(S_neg / c_neg) if c_neg else +0.0

(:func:`kvstore.codecs.quantize.blocked_sum_reference` defines the blocked lane sum: each
float32 term widened exactly to float64, added in one fixed order.) So ``a >= 0 >= b``, an
all-zero chunk sends ``a = b = 0`` and keeps a zero residual, and a chunk whose elements are
all equal sends them exactly.

**Saturation.** The values are finite (checked before any chunk is encoded), but ``r + g`` can
still exceed float32's range when both are near 3.4e38. Such a ``p`` is clamped to
``+-3.4028235e38`` (as ``fp16``/``bf16`` with error feedback do), so the levels and the residual
stay finite and the push is sent like any other.

**Payload** (:mod:`kvstore.codecs.quantize`'s layout): the scales frame ``[a, b]`` (two float32)
and the codes frame, ``ceil(n/8)`` bytes: element ``j``'s bit is bit ``j % 8`` of byte ``j // 8``,
padding bits zero. An empty chunk sends ``[0.0, 0.0]`` and no code bytes. The server decodes
``out[j] = a if bit else b`` (or ``out[j] += ...``, a float32 add, into the round's sum), and
refuses a push whose scales are not finite.

Worked example (zero residual)::

    g        = [1, 2, -3, 0, -0.0]
    a, b     = 0.75 (3 / 4: -0.0 and 0 count as non-negative), -3.0
    codes    = 1b                          (bits 1, 1, 0, 1, 1)
    residual = [0.25, 1.25, 0, -0.75, -0.75]

Three implementations give the same payload bytes and residual bits on any finite input: the
numpy references below (:func:`encode_reference`, :func:`decode_reference`), the numba kernels
of :mod:`kvstore.codecs.sign.numba_kernels` (the default; ``KVSTORE_CPU_KERNELS=numpy`` selects the
references) and the CuPy kernels of :mod:`kvstore.codecs.sign.cuda_kernels` for GPU values.
"""

from __future__ import annotations

import sys
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.codecs.quantize import (
    ChunkPlace,
    QuantizerCodec,
    QuantizerEncoder,
    blocked_sum_reference,
)
from kvstore.errors import CodecError

FLOAT32_MAX = np.float32(np.finfo(np.float32).max)

# numpy references ----------------------------------------------------------------------------


def saturated_sum_reference(residual: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """``p = residual + grad`` (float32), clamped to ``+-FLOAT32_MAX`` where it overflowed."""
    with np.errstate(over="ignore"):
        p = residual + grad
    return np.clip(p, -FLOAT32_MAX, FLOAT32_MAX, out=p)


def mean_or_zero(total: float, count: int) -> np.float32:
    """``float32(total / count)`` (a float64 division, one rounding to float32); ``+0.0`` when
    ``count`` is 0."""
    return np.float32(total / count) if count else np.float32(0.0)


def split_means_reference(p: np.ndarray) -> tuple[np.float32, np.float32]:
    """``1bit``'s levels ``(a, b)`` of ``p``: the means of ``p[p >= 0]`` and of ``p[p < 0]`` as
    the module docstring defines them."""
    up = p >= 0
    zero = np.float32(0.0)
    s_pos = blocked_sum_reference(np.where(up, p, zero))
    s_neg = blocked_sum_reference(np.where(up, zero, p))
    c_pos = int(np.count_nonzero(up))
    return mean_or_zero(s_pos, c_pos), mean_or_zero(s_neg, p.size - c_pos)


def apply_signs_reference(
    p: np.ndarray, hi: np.float32, lo: np.float32, residual: np.ndarray, codes: np.ndarray
) -> None:
    """Write the code bits of ``p`` (``p >= 0``) into ``codes`` (uint8[ceil(n/8)]) and
    ``residual = p - (hi if bit else lo)`` (float32)."""
    up = p >= 0
    np.subtract(p, np.where(up, hi, lo), out=residual)
    codes[...] = np.packbits(up, bitorder="little")


def encode_reference(
    grad: np.ndarray, residual: np.ndarray, scales: np.ndarray, codes: np.ndarray
) -> None:
    """One ``1bit`` push of a chunk: ``scales`` (float32[2]) gets ``[a, b]``, ``codes``
    (uint8[ceil(n/8)]) the bits, ``residual`` (updated in place) the error."""
    p = saturated_sum_reference(residual, grad)
    a, b = split_means_reference(p)
    scales[...] = (a, b)
    apply_signs_reference(p, a, b, residual, codes)


def decode_reference(
    codes: np.ndarray,
    numel: int,
    hi: np.float32,
    lo: np.float32,
    out: np.ndarray,
    accumulate: bool,
) -> None:
    """``out[j] = hi if bit j else lo`` for the ``numel`` codes; added (float32) into ``out``
    with ``accumulate``."""
    bits = np.unpackbits(np.asarray(codes, dtype=np.uint8), count=numel, bitorder="little")
    values = np.where(bits.view(bool), hi, lo)
    if accumulate:
        out += values
    else:
        out[...] = values


# the sign family -----------------------------------------------------------------------------


def cpu_implementation(implementation: str) -> str:
    """The CPU implementation that runs for ``implementation`` (``"numba"`` or ``"numpy"``): the
    numba kernels read bits through little-endian words, so a big-endian machine runs the
    reference."""
    if implementation not in ("numba", "numpy"):
        raise CodecError(f"unknown CPU kernel set {implementation!r}; expected numba or numpy")
    return "numba" if implementation == "numba" and sys.byteorder == "little" else "numpy"


class SignEncoder(QuantizerEncoder):
    """The encoder of one chunk for a sign quantizer: its residual and the codec's three
    implementations.

    Attributes:
        residual: float32[numel], on the encoder's device.
    """

    codec: SignCodec

    def __init__(self, codec: SignCodec, place: ChunkPlace, device: Any = None) -> None:
        super().__init__(codec, place, device)
        self.residual = self.zeros()
        if self.implementation != "cupy":
            self.implementation = cpu_implementation(self.implementation)
        self._partials: Any = None  # the CUDA kernels' per-block sums, made on first use

    def encode_reference(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        self.codec.encode_reference(values, self.residual, frames[0].view(np.float32), frames[1])

    def encode_compiled(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        frames[0].view(np.float32)[...] = self.codec.encode_compiled(
            values, self.residual, frames[1]
        )

    def encode_cuda(self, values: Any, frames: list[Any]) -> None:
        from kvstore.codecs.sign import cuda_kernels  # noqa: PLC0415  (needs CuPy)

        if self._partials is None:
            self._partials = cuda_kernels.partials_for(self.numel, self.codec.symmetric)
        cuda_kernels.encode(
            values, self.residual, frames[0], frames[1], self.codec.symmetric, self._partials
        )


class SignCodec(QuantizerCodec):
    """A sign quantizer: one bit per element and the chunk's scales, which give the levels of
    bit 1 and bit 0 (:meth:`levels`); error feedback in a float32 residual. No parameters."""

    state_arrays = ("residual",)
    param_defaults = {}
    symmetric: bool
    """True when the levels are ``s`` and ``-s`` of one scale (``efsign``), False for two
    scales ``[hi, lo]`` (``1bit``)."""

    def code_bits(self) -> int:
        return 1

    def scale_count(self, numel: int) -> int:
        return 1 if self.symmetric else 2

    def levels(self, scales: np.ndarray) -> tuple[np.float32, np.float32]:
        """The decoded values ``(hi, lo)`` of bit 1 and bit 0 for a chunk's float32 scales."""
        if self.symmetric:
            return np.float32(scales[0]), -np.float32(scales[0])
        return np.float32(scales[0]), np.float32(scales[1])

    @abstractmethod
    def encode_reference(
        self, grad: np.ndarray, residual: np.ndarray, scales: np.ndarray, codes: np.ndarray
    ) -> None:
        """The codec module's numpy ``encode_reference``: one push of a chunk."""

    @abstractmethod
    def encode_compiled(
        self, grad: np.ndarray, residual: np.ndarray, codes: np.ndarray
    ) -> tuple[float, ...]:
        """The same push by the numba kernels; returns the scales (floats holding float32
        values)."""

    def make_chunk_encoder(self, place: ChunkPlace, device: Any = None) -> SignEncoder:
        return SignEncoder(self, place, device)

    def decode_into(
        self,
        frames: Sequence[np.ndarray],
        numel: int,
        out: np.ndarray,
        accumulate: bool,
        implementation: str,
    ) -> None:
        scales = np.frombuffer(frames[0], dtype=np.float32)  # checked: check_scales
        hi, lo = self.levels(scales)
        codes = np.frombuffer(frames[1], dtype=np.uint8)
        if cpu_implementation(implementation) == "numba":
            from kvstore.codecs.sign import numba_kernels  # noqa: PLC0415  (compiles on first use)

            numba_kernels.decode(codes, numel, hi, lo, out, accumulate)
        else:
            decode_reference(codes, numel, hi, lo, out, accumulate)


class OneBitCodec(SignCodec):
    """1-bit SGD with error feedback: per chunk, the mean of the non-negative and the mean of
    the negative side of ``residual + gradient``, and one bit per element (about 32x smaller
    pushes). No parameters. See the module docstring for the exact arithmetic."""

    name = "1bit"
    symmetric = False

    def encode_reference(
        self, grad: np.ndarray, residual: np.ndarray, scales: np.ndarray, codes: np.ndarray
    ) -> None:
        encode_reference(grad, residual, scales, codes)

    def encode_compiled(
        self, grad: np.ndarray, residual: np.ndarray, codes: np.ndarray
    ) -> tuple[float, ...]:
        from kvstore.codecs.sign import numba_kernels  # noqa: PLC0415  (compiles on first use)

        return numba_kernels.encode_onebit(grad, residual, codes)
