"""Compiled CPU building blocks of the quantizing codecs (numba, GIL released, cached on disk).

Bit for bit the numpy references of :mod:`kvstore.codecs.quantize` and
:mod:`kvstore.codecs.counter_rng`; the codecs' own kernels (``_sign_numba``, ``_stochastic_numba``,
``_cast_numba``) inline them. Compiled without fast-math: every float operation rounds like
numpy's, in the order written.

A blocked lane sum is written in a kernel as::

    lanes = np.zeros(LANES)                  # per block
    table = block_values[:rows * 32].reshape(rows, 32)
    for r in range(rows):                    # through a row view, which LLVM vectorizes
        row = table[r]
        for lane in range(32): lanes[lane] += term(row[lane])
    block_sums[b] = combine_lanes(lanes)
    ...
    total = lane_sum(block_sums)

(a partial last row only feeds its first lanes).
"""

from __future__ import annotations

import numpy as np
from numba import njit

LANES = 32
_M32 = np.uint64(0xFFFFFFFF)
_UNIFORM_SCALE = np.float32(2.0**-24)


@njit(nogil=True, cache=True, inline="always")
def combine_lanes(lanes):
    """Lane 0 + lane 1 + ... + lane 31, in order, from +0.0 (float64)."""
    total = 0.0
    for lane in range(LANES):
        total += lanes[lane]
    return total


@njit(nogil=True, cache=True)
def lane_sum(values):
    """:func:`kvstore.codecs.quantize.lane_sum_reference` of float64 ``values``."""
    lanes = np.zeros(LANES)
    n = values.shape[0]
    full = n - n % LANES
    for base in range(0, full, LANES):
        for lane in range(LANES):
            lanes[lane] += values[base + lane]
    for i in range(full, n):
        lanes[i - full] += values[i]
    return combine_lanes(lanes)


@njit(nogil=True, cache=True)
def blocked_sum(values, block):
    """:func:`kvstore.codecs.quantize.blocked_sum_reference` of float32 ``values`` (the
    plain sum; the codecs fuse their own terms into the same loop shape)."""
    n = values.shape[0]
    nblocks = (n + block - 1) // block
    sums = np.empty(nblocks)
    lanes = np.empty(LANES)
    for b in range(nblocks):
        lanes[:] = 0.0
        start = b * block
        stop = min(n, start + block)
        rows = (stop - start) // LANES
        table = values[start : start + rows * LANES].reshape(rows, LANES)
        for r in range(rows):
            row = table[r]  # a row view: LLVM vectorizes the lane loop (a flat index does not)
            for lane in range(LANES):
                lanes[lane] += np.float64(row[lane])
        for i in range(start + rows * LANES, stop):
            lanes[i - start - rows * LANES] += np.float64(values[i])
        sums[b] = combine_lanes(lanes)
    return lane_sum(sums)


@njit(nogil=True, cache=True, inline="always")
def hash32(x):
    """The 32-bit finalizer of :func:`kvstore.codecs.counter_rng.hash32` (uint64 holding 32
    bits)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _M32
    return x ^ (x >> np.uint64(16))


@njit(nogil=True, cache=True, inline="always")
def uniform(lo, hi, i):
    """The float32 uniform of element ``i`` of the stream with key halves ``lo``, ``hi``
    (all uint64): :func:`kvstore.codecs.counter_rng.uniforms_reference`."""
    h = hash32((hash32(np.uint64(i) ^ lo) + hi) & _M32)
    return np.float32(h >> np.uint64(8)) * _UNIFORM_SCALE


@njit(nogil=True, cache=True)
def uniforms(lo, hi, start, out):
    """``out[j]`` = the uniform of element ``start + j`` (for tests and references)."""
    for j in range(out.shape[0]):
        out[j] = uniform(lo, hi, start + j)


@njit(nogil=True, cache=True, inline="always")
def store_group(out, group, word, width):
    """Write the ``width`` bytes of eight packed codes (``word``: code ``k`` at bit
    ``k * width``) as group ``group`` of the stream, clipped to ``out``'s end."""
    base = group * width
    for b in range(width):
        if base + b < out.shape[0]:
            out[base + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(0xFF))


@njit(nogil=True, cache=True, inline="always")
def load_group(packed, group, width):
    """The word of group ``group`` (eight codes of ``width`` bits), zero past the end."""
    base = group * width
    word = np.uint64(0)
    for b in range(width):
        if base + b < packed.shape[0]:
            word |= np.uint64(packed[base + b]) << np.uint64(8 * b)
    return word
