"""Compiled CPU kernels of the 2-bit codec (numba, GIL released, cached on disk).

Same contract, bytes and residuals as the numpy reference in :mod:`kvstore.codecs.twobit`.
Each output word is assembled in a register from 16 elements and stored once, and the residual
update is a select rather than a branch, so LLVM keeps the loop tight. Words are written as
little-endian uint32, whose memory bytes are exactly the byte layout of the format (byte ``q`` of
word ``w`` holds elements ``16w+4q .. 16w+4q+3``, first element in the high bit pair); the module
that imports these kernels checks the machine is little-endian.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True, inline="always")
def _shift(k):
    # Bit position of element k (0..15) of a word: byte k//4, pair 3 - k%4 within it.
    return 8 * (k >> 2) + 6 - 2 * (k & 3)


@njit(nogil=True, cache=True)
def encode(grad, residual, threshold, out):
    """Quantize ``grad`` (+ ``residual``) into 2-bit codes; update ``residual`` in place.

    Args:
        grad: float32[n], contiguous.
        residual: float32[n], contiguous; updated in place.
        threshold: np.float32 > 0.
        out: uint32[ceil(n/16)]; every word is fully overwritten (padding codes are 00).
    """
    n = grad.shape[0]
    t = threshold
    nt = -t
    full = n // 16
    for w in range(full):
        base = 16 * w
        acc = np.uint32(0)
        for k in range(16):
            x = residual[base + k] + grad[base + k]
            pos = x >= t
            neg = x <= nt
            residual[base + k] = (x - t) if pos else ((x + t) if neg else x)
            code = np.uint32(3) if pos else (np.uint32(2) if neg else np.uint32(0))
            acc |= code << np.uint32(_shift(k))
        out[w] = acc
    rest = n - 16 * full
    if rest > 0:
        base = 16 * full
        acc = np.uint32(0)
        for k in range(rest):
            x = residual[base + k] + grad[base + k]
            pos = x >= t
            neg = x <= nt
            residual[base + k] = (x - t) if pos else ((x + t) if neg else x)
            code = np.uint32(3) if pos else (np.uint32(2) if neg else np.uint32(0))
            acc |= code << np.uint32(_shift(k))
        out[full] = acc


@njit(nogil=True, cache=True)
def decode(words, n, threshold, out, accumulate):
    """Dequantize ``n`` codes: ``11`` -> +t, ``10`` -> -t, else 0; write or add into ``out``.

    Args:
        words: uint32[ceil(n/16)].
        n: number of elements.
        threshold: np.float32 > 0.
        out: float32[n].
        accumulate: add into ``out`` when True, overwrite it when False.
    """
    lut = np.zeros(4, dtype=np.float32)
    lut[2] = -threshold
    lut[3] = threshold
    full = n // 16
    if accumulate:
        for w in range(full):
            word = words[w]
            base = 16 * w
            for k in range(16):
                out[base + k] += lut[(word >> np.uint32(_shift(k))) & np.uint32(3)]
    else:
        for w in range(full):
            word = words[w]
            base = 16 * w
            for k in range(16):
                out[base + k] = lut[(word >> np.uint32(_shift(k))) & np.uint32(3)]
    rest = n - 16 * full
    if rest > 0:
        word = words[full]
        base = 16 * full
        for k in range(rest):
            value = lut[(word >> np.uint32(_shift(k))) & np.uint32(3)]
            if accumulate:
                out[base + k] += value
            else:
                out[base + k] = value
