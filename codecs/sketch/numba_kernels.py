"""Compiled CPU kernels of the count sketch (numba, GIL released, cached on disk).

Same bits as the numpy reference in :mod:`kvstore.codecs.sketch.hashing`, which states the
arithmetic: the hashes exactly as :func:`~kvstore.codecs.counter_rng.hash32`, the sketch
accumulated in int64 fixed point (so the order of the additions cannot change a bit), the
conversions ``rint`` (round half to even), int64 to float64 and float64 to float32, each rounding
to nearest. Compiled without fast-math, so no conversion or comparison is rewritten and
subnormals are kept.

**Loop shape.** The kernels walk the elements in blocks of :data:`BLOCK` and, within a block,
row by row: first a tight loop that hashes the block's indices into a small scratch (uint32
arithmetic, which LLVM vectorizes), then a loop that scatters into, or gathers from, that one
row of the table. An element-major loop (every row of one element, then the next element)
touches ``rows`` distant rows per element and keeps the hash serial; row by row, only one row's
slice of the table is in use at a time and the hashing runs several lanes wide. The estimates
gather into a ``(rows, BLOCK)`` scratch and take each column's median with a branch-free
min/max network (1, 3, 5 or 7 rows; an insertion sort beyond).

Everything runs on the calling thread. The estimates have no reduction, so a ``prange`` over
blocks would give the same bits; but the servers call these kernels from several threads at
once (one key each), which numba's default threading layer (workqueue) does not allow, and
those threads already keep the cores busy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)
from kvstore.codecs.sketch.hashing import fixed_point_exponent

BLOCK = 2048
"""Elements per block: the hash and gather scratch (a few rows of it) stays in L1."""

_MUL1 = np.uint32(0x7FEB352D)
_MUL2 = np.uint32(0x846CA68B)
_S16_64 = np.uint64(16)


@njit(nogil=True, cache=True, inline="always")
def _finish32(x):
    """The rest of :func:`kvstore.codecs.counter_rng.hash32` after its first xor-shift, in uint32
    arithmetic: a product masked to 32 bits is the wrapped uint32 product, so the bits are the
    same and the multiplies vectorize."""
    x = np.uint32(x * _MUL1)  # numba widens uint32 arithmetic: wrap it back
    x = x ^ (x >> np.uint32(15))
    x = np.uint32(x * _MUL2)
    return np.uint32(x ^ (x >> np.uint32(16)))


@njit(nogil=True, cache=True)
def _hash_block(first, count, lo, hi, hashes):
    """Write into ``hashes[:count]`` the 32-bit hashes of elements ``first .. first+count-1``
    (indices in the whole key, uint64) in the row whose key halves are ``lo, hi`` (uint64).

    The first xor-shift runs in uint64 so that an index of 2**32 or more hashes as the reference
    does (its high bits reach the low word); every later step needs only the low 32 bits."""
    hi32 = np.uint32(hi)
    for t in range(count):
        x = (first + np.uint64(t)) ^ lo
        inner = _finish32(np.uint32((x ^ (x >> _S16_64)) & np.uint64(0xFFFFFFFF)))
        outer = np.uint32(inner + hi32)  # the reference's sum mod 2**32
        hashes[t] = _finish32(outer ^ (outer >> np.uint32(16)))


@njit(nogil=True, cache=True, inline="always")
def _bucket(h, columns):
    """The bucket of hash ``h`` (uint32) among ``columns`` (uint64): multiply-shift of bits 1-31."""
    return np.int64(((np.uint64(h) >> np.uint64(1)) * columns) >> np.uint64(31))


@njit(nogil=True, cache=True)
def peak_abs(values):
    """``max(abs(values))`` of a float32 array as a float (exact; 0.0 when empty)."""
    peak = np.float32(0)
    for i in range(values.size):
        magnitude = abs(values[i])
        if magnitude > peak:
            peak = magnitude
    return float(peak)


@njit(nogil=True, cache=True)
def sketch_into(values, keys, start, columns, q, fixed_table, out):
    """Write into ``out`` (float32 ``(rows, columns)``) the count sketch of ``values`` (float32,
    elements ``start ..`` of their key) with fixed-point exponent ``q``, using ``fixed_table``
    (int64 ``(rows, columns)``, overwritten) to accumulate. Equals
    :func:`~kvstore.codecs.sketch.hashing.sketch_reference` when ``q`` is
    :func:`~kvstore.codecs.sketch.hashing.fixed_point_exponent` of the values' peak; values
    that are all zero (or none) give a zero table whatever ``q``.

    Each block's fixed-point values are computed once into a scratch and then added row by row;
    a zero adds nothing, so zeros need no test."""
    rows = keys.shape[0]
    fixed_table[:, :] = 0
    scale = math.ldexp(1.0, q)
    wide_columns = np.uint64(columns)
    fixed = np.empty(BLOCK, dtype=np.int64)
    hashes = np.empty(BLOCK, dtype=np.uint32)
    for block_start in range(0, values.size, BLOCK):
        count = min(BLOCK, values.size - block_start)
        for t in range(count):
            fixed[t] = np.int64(np.rint(np.float64(values[block_start + t]) * scale))
        first = np.uint64(start) + np.uint64(block_start)
        for j in range(rows):
            _hash_block(first, count, np.uint64(keys[j, 0]), np.uint64(keys[j, 1]), hashes)
            row = fixed_table[j]
            for t in range(count):
                h = hashes[t]
                negative = np.int64(h & np.uint32(1))
                # (f ^ -1) + 1 == -f: the sign without a branch
                row[_bucket(h, wide_columns)] += (fixed[t] ^ -negative) + negative
    inverse = math.ldexp(1.0, -q)
    for j in range(rows):
        for c in range(columns):
            out[j, c] = np.float32(np.float64(fixed_table[j, c]) * inverse)


def sketch(values: np.ndarray, keys: np.ndarray, start: int, columns: int) -> np.ndarray:
    """The float32 ``(rows, columns)`` count sketch of ``values`` (float32, elements ``start
    ..`` of their key): :func:`~kvstore.codecs.sketch.hashing.sketch_reference`, compiled."""
    rows = keys.shape[0]
    out = np.zeros((rows, columns), dtype=np.float32)
    peak = peak_abs(values)
    if peak == 0:
        return out
    q = fixed_point_exponent(peak, values.size)
    sketch_into(values, keys, start, columns, q, np.empty((rows, columns), np.int64), out)
    return out


@njit(nogil=True, cache=True, inline="always")
def _order(a, b):
    """``(min, max)`` of two finite floats, as selects that compile to min/max instructions."""
    return (a, b) if a < b else (b, a)


@njit(nogil=True, cache=True)
def _medians(gathered, count, out):
    """Write into ``out[:count]`` the median of each column of ``gathered`` (``(rows, BLOCK)``
    float32, ``rows`` odd), a zero median as ``+0.0``.

    The networks for 3, 5 and 7 rows are the known minimal median selections (the -0.0/+0.0
    order they leave does not matter: a zero median becomes +0.0); they vectorize across the
    columns. More rows take an insertion sort per column."""
    rows = gathered.shape[0]
    if rows == 1:
        for t in range(count):
            out[t] = gathered[0, t]
    elif rows == 3:
        for t in range(count):
            a, b = _order(gathered[0, t], gathered[1, t])
            b = _order(b, gathered[2, t])[0]
            out[t] = _order(a, b)[1]
    elif rows == 5:
        for t in range(count):
            p0, p1 = _order(gathered[0, t], gathered[1, t])
            p3, p4 = _order(gathered[3, t], gathered[4, t])
            p0, p3 = _order(p0, p3)
            p1, p4 = _order(p1, p4)
            p1, p2 = _order(p1, gathered[2, t])
            p2, p3 = _order(p2, p3)
            p1, p2 = _order(p1, p2)
            out[t] = p2
    elif rows == 7:
        for t in range(count):
            p0, p5 = _order(gathered[0, t], gathered[5, t])
            p0, p3 = _order(p0, gathered[3, t])
            p1, p6 = _order(gathered[1, t], gathered[6, t])
            p2, p4 = _order(gathered[2, t], gathered[4, t])
            p0, p1 = _order(p0, p1)
            p3, p5 = _order(p3, p5)
            p2, p6 = _order(p2, p6)
            p2, p3 = _order(p2, p3)
            p3, p6 = _order(p3, p6)
            p4, p5 = _order(p4, p5)
            p1, p4 = _order(p1, p4)
            p1, p3 = _order(p1, p3)
            p3, p4 = _order(p3, p4)
            out[t] = p3
    else:
        column = np.empty(rows, dtype=np.float32)
        for t in range(count):
            for j in range(rows):
                value = gathered[j, t]
                k = j  # insertion sort: the rows so far stay in order
                while k > 0 and column[k - 1] > value:
                    column[k] = column[k - 1]
                    k -= 1
                column[k] = value
            out[t] = column[rows // 2]
    for t in range(count):
        if out[t] == 0:
            out[t] = 0  # a zero estimate is +0.0


@njit(nogil=True, cache=True)
def estimates_into(table, keys, start, out):
    """Write into ``out`` (float32, one per element ``start ..``) the median estimates from
    ``table`` (finite float32 ``(rows, columns)``, ``rows`` odd and at most 15):
    :func:`~kvstore.codecs.sketch.hashing.estimates_reference`."""
    rows, columns = table.shape
    wide_columns = np.uint64(columns)
    gathered = np.empty((rows, BLOCK), dtype=np.float32)
    hashes = np.empty(BLOCK, dtype=np.uint32)
    for block_start in range(0, out.size, BLOCK):
        count = min(BLOCK, out.size - block_start)
        first = np.uint64(start) + np.uint64(block_start)
        for j in range(rows):
            _hash_block(first, count, np.uint64(keys[j, 0]), np.uint64(keys[j, 1]), hashes)
            row = table[j]
            for t in range(count):
                h = hashes[t]
                # times -1 or +1 (exact): a branch on a random sign would mispredict half the time
                sign = np.float32(1) - np.float32(2) * np.float32(h & np.uint32(1))
                gathered[j, t] = row[_bucket(h, wide_columns)] * sign
        _medians(gathered, count, out[block_start : block_start + count])


@njit(nogil=True, cache=True)
def zero_buckets(table, keys, start, local):
    """Zero, in every row of ``table``, the bucket of each element at chunk-local index
    ``local[t]`` (int64 or uint32):
    :func:`~kvstore.codecs.sketch.hashing.zero_buckets_reference`."""
    rows, columns = table.shape
    wide_columns = np.uint64(columns)
    hashes = np.empty(1, dtype=np.uint32)
    for t in range(local.size):
        index = np.uint64(start) + np.uint64(local[t])
        for j in range(rows):
            _hash_block(index, 1, np.uint64(keys[j, 0]), np.uint64(keys[j, 1]), hashes)
            table[j, _bucket(hashes[0], wide_columns)] = 0
