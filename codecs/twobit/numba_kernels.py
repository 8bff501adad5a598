"""Compiled CPU kernels of the 2-bit codec (numba, GIL released, cached on disk).

Same contract, bytes and residuals as the numpy reference in :mod:`kvstore.codecs.twobit`.

Both kernels work in blocks of :data:`BLOCK` elements (a multiple of 16, so blocks start on word
boundaries) through a small scratch array that stays in L1 cache, so that every loop is a plain
elementwise loop LLVM can vectorize, and memory is streamed once:

* encode: pass 1 updates the residual and writes one code per element as a byte (0, 2 or 3);
  pass 2 reads the codes four at a time as a little-endian uint32 ``v = c0 | c1<<8 | c2<<16 |
  c3<<24`` and packs them with one multiply: the top byte of ``v * 0x40100401`` is
  ``c0<<6 | c1<<4 | c2<<2 | c3`` (the partial products below bit 24 add up to less than 2**23,
  so nothing carries into it);
* decode: pass 1 spreads each packed byte ``b`` back into four code bytes with shifts and masks;
  pass 2 turns codes into ``+t``, ``-t`` or ``+0.0`` with selects and adds (or writes) them.

:func:`encode_clipped` is :func:`encode` with the residual clipped to ``[-limit, limit]`` after
each element's quantization (the codec's ``residual_clip`` option); :func:`count_at_least` is the
one-pass count behind the encoder's runaway-residual warning.

The last partial block goes through a per-word loop. On the development machine both run at
their memory-bandwidth floor (see ``benchmarks/bench_codecs.py``). The kernels view uint32 words
as bytes, so they need a little-endian machine; :func:`kvstore.codecs.twobit.cpu_kernels` checks.
"""

from __future__ import annotations

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)

BLOCK = 2048
"""Elements per block: 2 KiB of codes, 8 KiB of floats per stream: well inside L1."""

_PACK = np.uint32(0x40100401)


@njit(nogil=True, cache=True, inline="always")
def _shift(k):
    # Bit position of element k (0..15) of a little-endian word: byte k//4, pair 3 - k%4 in it.
    return np.uint32(8 * (k >> 2) + 6 - 2 * (k & 3))


@njit(nogil=True, cache=True, inline="always")
def _kept(x, t, nt, limit, nlimit):
    """The residual kept of ``x = r + g``: MXNet's when ``limit`` is None (settled when numba
    compiles), else clipped to ``[-limit, limit]``. Only a quantized element can exceed the
    limit (otherwise ``|x| < t <= limit``), so each branch needs one bound, and a NaN (neither
    >= t nor <= -t) is kept as it is, as numpy.clip keeps it; inf - t is inf, clipped to the
    limit."""
    if x >= t:
        y = x - t
        if limit is None:
            return y
        return limit if y > limit else y
    if x <= nt:
        y = x + t
        if limit is None:
            return y
        return nlimit if y < nlimit else y
    return x


@njit(nogil=True, cache=True)
def _encode_tail(grad, residual, t, out, start, limit=None):
    """Per-word encode of elements ``[start, n)``; ``start`` is a multiple of 16."""
    n = grad.shape[0]
    nt = -t
    nlimit = nt if limit is None else -limit
    for w in range(start // 16, (n + 15) // 16):
        base = 16 * w
        acc = np.uint32(0)
        for k in range(min(16, n - base)):
            x = residual[base + k] + grad[base + k]
            pos = x >= t
            neg = x <= nt
            residual[base + k] = _kept(x, t, nt, limit, nlimit)
            code = np.uint32(3) if pos else (np.uint32(2) if neg else np.uint32(0))
            acc |= code << _shift(k)
        out[w] = acc


@njit(nogil=True, cache=True)
def encode(grad, residual, threshold, out, limit=None):
    """Quantize ``grad`` (+ ``residual``) into 2-bit codes; update ``residual`` in place.

    Args:
        grad: float32[n], contiguous.
        residual: float32[n], contiguous; updated in place.
        threshold: np.float32 > 0.
        out: uint32[ceil(n/16)]; every word is fully overwritten (padding codes are 00).
        limit: None (MXNet's arithmetic), or np.float32 >= threshold: the ``residual_clip``
            variant, each element's kept residual clipped to ``[-limit, limit]`` (the codes
            are the same). None compiles a version without the clip's compares.
    """
    n = grad.shape[0]
    t = threshold
    nt = -t
    nlimit = nt if limit is None else -limit
    codes = np.empty(BLOCK, dtype=np.uint8)
    quads = codes.view(np.uint32)
    packed = out.view(np.uint8)
    full = n - n % BLOCK
    for start in range(0, full, BLOCK):
        for k in range(BLOCK):
            i = start + k
            x = residual[i] + grad[i]
            pos = x >= t
            neg = x <= nt
            residual[i] = _kept(x, t, nt, limit, nlimit)
            codes[k] = (np.uint8(3) if pos else np.uint8(0)) | (np.uint8(2) if neg else np.uint8(0))
        first_byte = start // 4
        for j in range(BLOCK // 4):
            packed[first_byte + j] = np.uint8((quads[j] * _PACK) >> np.uint32(24))
    _encode_tail(grad, residual, t, out, full, limit)


@njit(nogil=True, cache=True)
def _decode_tail(words, n, t, out, accumulate, start):
    """Per-word decode of elements ``[start, n)``; ``start`` is a multiple of 16."""
    nt = -t
    zero = np.float32(0)
    for w in range(start // 16, (n + 15) // 16):
        word = words[w]
        base = 16 * w
        for k in range(min(16, n - base)):
            code = (word >> _shift(k)) & np.uint32(3)
            value = t if code == 3 else (nt if code == 2 else zero)
            if accumulate:
                out[base + k] += value
            else:
                out[base + k] = value


@njit(nogil=True, cache=True)
def decode(words, n, threshold, out, accumulate):
    """Dequantize ``n`` codes: ``11`` -> +t, ``10`` -> -t, else +0.0; write or add into ``out``.

    Args:
        words: uint32[ceil(n/16)].
        n: number of elements.
        threshold: np.float32 > 0.
        out: float32[n].
        accumulate: add into ``out`` when True, overwrite it when False.
    """
    t = threshold
    nt = -t
    zero = np.float32(0)
    packed = words.view(np.uint8)
    codes = np.empty(BLOCK, dtype=np.uint8)
    quads = codes.view(np.uint32)
    full = n - n % BLOCK
    for start in range(0, full, BLOCK):
        first_byte = start // 4
        for j in range(BLOCK // 4):
            b = np.uint32(packed[first_byte + j])
            quads[j] = (
                (b >> np.uint32(6))
                | ((b << np.uint32(4)) & np.uint32(0x300))
                | ((b << np.uint32(14)) & np.uint32(0x30000))
                | ((b << np.uint32(24)) & np.uint32(0x3000000))
            )
        if accumulate:
            for k in range(BLOCK):
                code = codes[k]
                out[start + k] += t if code == 3 else (nt if code == 2 else zero)
        else:
            for k in range(BLOCK):
                code = codes[k]
                out[start + k] = t if code == 3 else (nt if code == 2 else zero)
    _decode_tail(words, n, t, out, accumulate, full)


# residual_clip variant --------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def encode_clipped(grad, residual, threshold, limit, out):
    """:func:`encode` with ``limit``: the ``residual_clip`` variant's kernel."""
    encode(grad, residual, threshold, out, limit)


@njit(nogil=True, cache=True)
def count_at_least(values, bound):
    """How many elements of float32 ``values`` have ``|v| >= bound`` (NaNs never count).

    An integer sum of compares, which vectorizes without fast-math (a float max would not).
    """
    count = 0
    for i in range(values.shape[0]):
        count += 1 if abs(values[i]) >= bound else 0
    return count
