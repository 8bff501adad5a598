"""Compiled CPU kernels of the count sketch (numba, GIL released, cached on disk).

Same bits as the numpy reference in :mod:`kvstore.codecs.sketch.hashing`, which states the
arithmetic: the hashes in 64-bit unsigned integers exactly as
:func:`~kvstore.codecs.counter_rng.hash32`, the sketch accumulated in int64 fixed point (so the
order of the additions cannot change a bit), the conversions ``rint`` (round half to even),
int64 to float64 and float64 to float32, each rounding to nearest. Compiled without fast-math,
so no conversion or comparison is rewritten and subnormals are kept.

One pass over the values computes each element's fixed-point value once and adds it to its
bucket in every row; the estimates gather each element's ``rows`` signed buckets, sort them by
insertion (``rows <= 15``) and take the middle. Everything runs on the calling thread. The
estimates have no reduction, so a ``prange`` over blocks of elements gives the same bits and
nearly halves their time on an idle two-core machine; but the servers call these kernels from
several threads at once (one key each), which numba's default threading layer (workqueue) does
not allow, and those threads already keep the cores busy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)
from kvstore.codecs.sketch.hashing import MAX_ROWS, fixed_point_exponent

_M32 = np.uint64(0xFFFFFFFF)
_MUL1 = np.uint64(0x7FEB352D)
_MUL2 = np.uint64(0x846CA68B)
_S1 = np.uint64(1)
_S15 = np.uint64(15)
_S16 = np.uint64(16)
_S31 = np.uint64(31)


@njit(nogil=True, cache=True, inline="always")
def _hash32(x):
    """:func:`kvstore.codecs.counter_rng.hash32` of one uint64 holding a 32-bit value."""
    x = x ^ (x >> _S16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> _S15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> _S16)


@njit(nogil=True, cache=True, inline="always")
def _element_hash(keys, j, index):
    """The 32-bit hash of element ``index`` (uint64, its index in the whole key) in row ``j``."""
    lo = np.uint64(keys[j, 0])
    hi = np.uint64(keys[j, 1])
    return _hash32((_hash32(index ^ lo) + hi) & _M32)


@njit(nogil=True, cache=True, inline="always")
def _bucket(h, columns):
    """The bucket of hash ``h`` among ``columns`` (uint64): multiply-shift of bits 1-31."""
    return np.int64(((h >> _S1) * columns) >> _S31)


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
    that are all zero (or none) give a zero table whatever ``q``."""
    rows = keys.shape[0]
    fixed_table[:, :] = 0
    scale = math.ldexp(1.0, q)
    wide_columns = np.uint64(columns)
    first = np.uint64(start)
    for i in range(values.size):
        x = values[i]
        if x == 0:
            continue  # adds nothing
        fixed = np.int64(np.rint(np.float64(x) * scale))
        index = first + np.uint64(i)
        for j in range(rows):
            h = _element_hash(keys, j, index)
            if h & _S1:
                fixed_table[j, _bucket(h, wide_columns)] -= fixed
            else:
                fixed_table[j, _bucket(h, wide_columns)] += fixed
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


@njit(nogil=True, cache=True)
def estimates_into(table, keys, start, out):
    """Write into ``out`` (float32, one per element ``start ..``) the median estimates from
    ``table`` (float32 ``(rows, columns)``, ``rows`` odd and at most 15):
    :func:`~kvstore.codecs.sketch.hashing.estimates_reference`."""
    rows, columns = table.shape
    wide_columns = np.uint64(columns)
    first = np.uint64(start)
    middle = rows // 2
    row_estimates = np.empty(MAX_ROWS, dtype=np.float32)
    for i in range(out.size):
        index = first + np.uint64(i)
        for j in range(rows):
            h = _element_hash(keys, j, index)
            value = table[j, _bucket(h, wide_columns)]
            if h & _S1:
                value = -value
            k = j  # insertion sort: the rows so far stay in order
            while k > 0 and row_estimates[k - 1] > value:
                row_estimates[k] = row_estimates[k - 1]
                k -= 1
            row_estimates[k] = value
        median = row_estimates[middle]
        out[i] = np.float32(0) if median == 0 else median  # a zero estimate is +0.0


@njit(nogil=True, cache=True)
def zero_buckets(table, keys, start, local):
    """Zero, in every row of ``table``, the bucket of each element at chunk-local index
    ``local[t]`` (int64 or uint32):
    :func:`~kvstore.codecs.sketch.hashing.zero_buckets_reference`."""
    rows, columns = table.shape
    wide_columns = np.uint64(columns)
    first = np.uint64(start)
    for t in range(local.size):
        index = first + np.uint64(local[t])
        for j in range(rows):
            table[j, _bucket(_element_hash(keys, j, index), wide_columns)] = 0
