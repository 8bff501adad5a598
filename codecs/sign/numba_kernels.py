"""Compiled CPU kernels of the sign quantizers ``1bit`` and ``efsign`` (numba, GIL released,
cached on disk, no fast-math).

Bit for bit the numpy references of :mod:`kvstore.codecs.sign.onebit` and
:mod:`kvstore.codecs.sign.efsign`; :func:`encode_onebit` and :func:`encode_efsign` are the entry
points. An encode is two passes over the chunk, because its scales depend on every element:

* pass 1 (:func:`split_sums` for ``1bit``, :func:`abs_sum` for ``efsign``) reads the residual
  and the gradient, forms ``p = r + g`` and accumulates the blocked lane sums (see
  :mod:`kvstore.codecs.quantize.numba_kernels`) through ``(rows, 32)`` row views, which LLVM
  vectorizes, into lanes on the stack, which it keeps in vector registers (in L2 cache,
  ``1bit``: 250 -> 190 ps per element, ``efsign``: 155 -> 118, against heap lanes stored and
  reloaded every row). It writes nothing;
* pass 2 (:func:`apply_signs`) forms ``p`` again (the same float32 operations, the same bits),
  writes the residual ``p - decoded`` and one code bit per element.

That is five streams of ``n`` floats (read 2, read 2, write 1) plus ``n/8`` code bytes, the same
traffic as storing ``p`` in pass 1 and reading it back in pass 2 (read 2, write 1, read 1,
write 1); on the development machine a streaming read costs about as much as ``a += b``'s
read-modify-write of one line, which makes reading ``r`` and ``g`` twice the faster of the two.

**Saturation.** ``p`` is clamped to ``+-FLOAT32_MAX`` where ``r + g`` overflows. The clamp costs
two compares and selects per element in each pass, so the passes first run without it: an
overflowed ``p`` is infinite and makes a pass-1 sum infinite (no sum can overflow float64
otherwise), and only then do both passes run again with it (``limit=FLOAT32_MAX``; ``None``
compiles a version without the compares).

Pass 2 and :func:`decode` work in blocks of :data:`BLOCK` elements through a scratch array of
one byte per element (0 or 1) that stays in L1 cache, so that the float loop is a plain
elementwise loop LLVM vectorizes. Eight bit bytes, read as one little-endian uint64 ``v``, are
packed with one multiply: the top byte of ``v * 0x0102040810204080`` is
``b0 | b1 << 1 | ... | b7 << 7`` (bit ``k`` of byte ``k`` moves to bit ``56 + k``; the other
partial products land on distinct bits, so nothing carries). Decoding spreads a code byte back
into eight bit bytes with a 256-entry table. Loops index slices of the arrays (views), not
offsets into the whole arrays: LLVM vectorizes the former only. The uint64 views need a
little-endian machine; :func:`kvstore.codecs.sign.onebit.cpu_implementation` falls back to the
reference elsewhere.
"""

from __future__ import annotations

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)
from kvstore.codecs.quantize.numba_kernels import combine_lanes, lane_sum, stack_lanes

LANES = 32
SUM_BLOCK = 4096  # kvstore.codecs.quantize.SUM_BLOCK (not imported: that module needs no numba)

BLOCK = 2048
"""Elements per block of pass 2 and of the decode: 2 KiB of bit bytes, 8 KiB per float
stream."""

FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
_PACK = np.uint64(0x0102040810204080)
_SHIFT_TOP = np.uint64(56)

SPREAD = np.array(
    [sum(((byte >> k) & 1) << (8 * k) for k in range(8)) for byte in range(256)], dtype=np.uint64
)
"""``SPREAD[b]``: eight bytes, byte ``k`` holding bit ``k`` of ``b`` (as a little-endian
uint64)."""


@njit(nogil=True, cache=True, inline="always")
def element_sum(r, g, limit):
    """``p = r + g`` (float32); clamped to ``[-limit, limit]`` unless ``limit`` is None (settled
    when numba compiles). The compares leave -0.0 and subnormals as they are."""
    p = r + g
    if limit is None:
        return p
    if p > limit:
        return limit
    if p < -limit:
        return -limit
    return p


@njit(nogil=True, cache=True, inline="always")
def mean_or_zero(total, count):
    """``float32(total / count)`` (float64 division, one rounding); +0.0 for a count of 0."""
    return np.float32(total / count) if count > 0 else np.float32(0.0)


# pass 1: the sums --------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def split_sums(grad, residual, limit=None):
    """The blocked lane sums of ``p`` over ``p >= 0`` and over ``p < 0`` (float64; the other
    elements add ``+0.0``), and the count of ``p >= 0``, where ``p`` is
    ``element_sum(residual, grad, limit)``. Reads only."""
    n = grad.shape[0]
    nblocks = (n + SUM_BLOCK - 1) // SUM_BLOCK
    pos_sums = np.empty(nblocks)
    neg_sums = np.empty(nblocks)
    # On the stack: the 32 lanes of each stay in registers (see quantize.numba_kernels.stack_lanes).
    pos_lanes = stack_lanes(32, np.float64)
    neg_lanes = stack_lanes(32, np.float64)
    # Counted per lane too: one scalar count would be a horizontal add per row, on one chain.
    counts = stack_lanes(32, np.int32)
    counts[:] = 0
    zero = np.float32(0)
    for b in range(nblocks):
        pos_lanes[:] = 0.0
        neg_lanes[:] = 0.0
        start = b * SUM_BLOCK
        stop = min(n, start + SUM_BLOCK)
        rows = (stop - start) // LANES
        full = start + rows * LANES
        g_table = grad[start:full].reshape(rows, LANES)
        r_table = residual[start:full].reshape(rows, LANES)
        for row in range(rows):
            g_row = g_table[row]  # row views: LLVM vectorizes the lane loop
            r_row = r_table[row]
            for lane in range(LANES):
                p = element_sum(r_row[lane], g_row[lane], limit)
                up = p >= zero
                wide = np.float64(p)
                pos_lanes[lane] += wide if up else 0.0
                neg_lanes[lane] += 0.0 if up else wide
                counts[lane] += up
        for i in range(full, stop):
            p = element_sum(residual[i], grad[i], limit)
            up = p >= zero
            wide = np.float64(p)
            pos_lanes[i - full] += wide if up else 0.0
            neg_lanes[i - full] += 0.0 if up else wide
            counts[i - full] += up
        pos_sums[b] = combine_lanes(pos_lanes)
        neg_sums[b] = combine_lanes(neg_lanes)
    return lane_sum(pos_sums), lane_sum(neg_sums), np.int64(counts.sum())


@njit(nogil=True, cache=True)
def abs_sum(grad, residual, limit=None):
    """The blocked lane sum of ``abs(p)`` in float64, ``p = element_sum(residual, grad,
    limit)``. Reads only."""
    n = grad.shape[0]
    nblocks = (n + SUM_BLOCK - 1) // SUM_BLOCK
    sums = np.empty(nblocks)
    lanes = stack_lanes(32, np.float64)
    for b in range(nblocks):
        lanes[:] = 0.0
        start = b * SUM_BLOCK
        stop = min(n, start + SUM_BLOCK)
        rows = (stop - start) // LANES
        full = start + rows * LANES
        g_table = grad[start:full].reshape(rows, LANES)
        r_table = residual[start:full].reshape(rows, LANES)
        for row in range(rows):
            g_row = g_table[row]
            r_row = r_table[row]
            for lane in range(LANES):
                lanes[lane] += np.float64(abs(element_sum(r_row[lane], g_row[lane], limit)))
        for i in range(full, stop):
            lanes[i - full] += np.float64(abs(element_sum(residual[i], grad[i], limit)))
        sums[b] = combine_lanes(lanes)
    return lane_sum(sums)


# pass 2: codes and residual ------------------------------------------------------------------


@njit(nogil=True, cache=True)
def apply_signs(grad, residual, hi, lo, codes, limit=None):
    """``p = element_sum(residual, grad, limit)``; code bit ``p >= 0``;
    ``residual = p - (hi if bit else lo)`` (float32). ``codes``: uint8[ceil(n/8)], every byte
    overwritten (padding bits zero)."""
    n = grad.shape[0]
    zero = np.float32(0)
    bits = np.zeros(BLOCK, dtype=np.uint8)
    words = bits.view(np.uint64)
    for start in range(0, n, BLOCK):
        m = min(BLOCK, n - start)
        g = grad[start : start + m]
        r = residual[start : start + m]
        for k in range(m):
            p = element_sum(r[k], g[k], limit)
            up = p >= zero
            r[k] = p - (hi if up else lo)
            bits[k] = up
        for k in range(m, BLOCK):  # only the last block: its padding bits are zero
            bits[k] = 0
        block_codes = codes[start // 8 : (start + m + 7) // 8]
        for j in range(block_codes.shape[0]):
            block_codes[j] = np.uint8((words[j] * _PACK) >> _SHIFT_TOP)


# the encoders ------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def encode_onebit(grad, residual, codes):
    """One ``1bit`` push of a chunk: update ``residual``, write ``codes``, return ``(a, b)``
    (float32)."""
    s_pos, s_neg, c_pos = split_sums(grad, residual)
    saturate = not (np.isfinite(s_pos) and np.isfinite(s_neg))
    if saturate:  # some r + g overflowed
        s_pos, s_neg, c_pos = split_sums(grad, residual, FLOAT32_MAX)
    a = mean_or_zero(s_pos, c_pos)
    b = mean_or_zero(s_neg, grad.shape[0] - c_pos)
    if saturate:
        apply_signs(grad, residual, a, b, codes, FLOAT32_MAX)
    else:
        apply_signs(grad, residual, a, b, codes)
    return a, b


@njit(nogil=True, cache=True)
def encode_efsign(grad, residual, codes):
    """One ``efsign`` push of a chunk: update ``residual``, write ``codes``, return ``s``
    (float32)."""
    total = abs_sum(grad, residual)
    saturate = not np.isfinite(total)
    if saturate:  # some r + g overflowed
        total = abs_sum(grad, residual, FLOAT32_MAX)
    s = mean_or_zero(total, grad.shape[0])
    if saturate:
        apply_signs(grad, residual, s, -s, codes, FLOAT32_MAX)
    else:
        apply_signs(grad, residual, s, -s, codes)
    return s


# decode ------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def decode(codes, n, hi, lo, out, accumulate):
    """``out[j] = hi if bit j else lo`` (or ``out[j] += ...``, float32, with ``accumulate``)
    for the ``n`` codes of the packed ``codes``."""
    bits = np.empty(BLOCK, dtype=np.uint8)
    words = bits.view(np.uint64)
    for start in range(0, n, BLOCK):
        m = min(BLOCK, n - start)
        block_codes = codes[start // 8 : (start + m + 7) // 8]
        for j in range(block_codes.shape[0]):
            words[j] = SPREAD[block_codes[j]]
        block = out[start : start + m]  # a view, as in apply_signs
        if accumulate:
            for k in range(m):
                block[k] += hi if bits[k] else lo
        else:
            for k in range(m):
                block[k] = hi if bits[k] else lo
