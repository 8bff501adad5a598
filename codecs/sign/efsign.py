"""``efsign``: EF-signSGD (Karimireddy et al. 2019), the sign of each element and one scale per
chunk, the mean magnitude, with error feedback.

Per chunk of ``n`` elements, with a float32 residual ``r`` (zero at start; state
``("residual",)``; nothing random)::

    p = r + g                                             float32 add, saturated as 1bit's
    s = float32(blocked lane sum of abs(p) / n)           float64 sum and division, one rounding;
                                                          +0.0 for n == 0
    bit[j] = 1 if p[j] >= 0 else 0                        -0.0 >= 0: zeros send +s
    decoded[j] = s if bit[j] else -s
    r = p - decoded                                       float32 subtract

(:func:`kvstore.codecs.quantize.blocked_sum_reference` defines the blocked lane sum: each
``abs(p[j])``, an exact float32, widened to float64 and added in one fixed order.) It is the
sign quantizer of :mod:`kvstore.codecs.sign.onebit` with the levels ``s`` and ``-s``, and shares its
encoder, kernels and server decode.

The residual is in gradient units: the workers push raw gradients and the server's optimizer
applies the learning rate to the decoded sum (the paper's algorithm keeps its memory in update
units, with the learning rate inside). The scale is per chunk (the unit one server receives), not
per tensor.

**Payload**: the scales frame ``[s]`` (one float32) and ``ceil(n/8)`` code bytes, element ``j``'s
bit at bit ``j % 8`` of byte ``j // 8``, padding bits zero. The server decodes
``out[j] = s if bit else -s`` (or adds it, float32, into the round's sum). An all-zero chunk
sends ``s = 0`` and keeps a zero residual; a chunk of equal magnitudes is sent exactly.

Worked example (zero residual)::

    g        = [1, 2, -3, 0, -0.0]
    s        = float32(6 / 5) = 1.2
    codes    = 1b                          (bits 1, 1, 0, 1, 1)
    residual = [1 - s, 2 - s, -3 + s, -s, -s] = [-0.20000005, 0.79999995, -1.8, -1.2, -1.2]
"""

from __future__ import annotations

import numpy as np

from kvstore.codecs.quantize import blocked_sum_reference
from kvstore.codecs.sign.onebit import (
    SignCodec,
    apply_signs_reference,
    mean_or_zero,
    saturated_sum_reference,
)


def mean_abs_reference(p: np.ndarray) -> np.float32:
    """``efsign``'s scale of ``p = r + g``: ``float32(blocked lane sum of abs(p) / n)``, +0.0
    for an empty chunk."""
    return mean_or_zero(blocked_sum_reference(np.abs(p)), p.size)


def encode_reference(
    grad: np.ndarray, residual: np.ndarray, scales: np.ndarray, codes: np.ndarray
) -> None:
    """One ``efsign`` push of a chunk: ``scales`` (float32[1]) gets ``[s]``, ``codes``
    (uint8[ceil(n/8)]) the bits, ``residual`` (updated in place) the error."""
    p = saturated_sum_reference(residual, grad)
    s = mean_abs_reference(p)
    scales[...] = s
    apply_signs_reference(p, s, -s, residual, codes)


class EFSignCodec(SignCodec):
    """EF-signSGD: per chunk, the sign of ``residual + gradient`` and its mean magnitude (about
    32x smaller pushes). No parameters. See the module docstring for the exact arithmetic."""

    name = "efsign"
    symmetric = True

    def encode_reference(
        self, grad: np.ndarray, residual: np.ndarray, scales: np.ndarray, codes: np.ndarray
    ) -> None:
        encode_reference(grad, residual, scales, codes)

    def encode_compiled(
        self, grad: np.ndarray, residual: np.ndarray, codes: np.ndarray
    ) -> tuple[float, ...]:
        from kvstore.codecs.sign import numba_kernels  # noqa: PLC0415  (compiles on first use)

        return (numba_kernels.encode_efsign(grad, residual, codes),)
