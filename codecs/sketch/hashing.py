"""The count sketch's arithmetic, as the numpy reference: hashes, sketching, estimates.

Everything the three implementations (this module, :mod:`.numba_kernels`,
:mod:`.cuda_kernels`) must agree on bit for bit lives here, readable as the specification.

**Hashes.** Row ``j`` of the sketch of a key has a 64-bit stream key
``counter_hash(seed, key_hash, PURPOSE, j)`` (:mod:`kvstore.codecs.counter_rng`; ``key_hash`` is
:func:`~kvstore.codecs.counter_rng.stable_key_hash` of the key), split into 32-bit halves
``lo, hi``. Element ``i`` (its index in the whole key, so every worker and server computes the
same) hashes to::

    h        = hash32((hash32(i ^ lo) + hi) mod 2**32)
    bucket   = ((h >> 1) * columns) >> 31              (in [0, columns), multiply-shift)
    negative = h & 1                                   (the sign s = -1 when set, else +1)

Bit 0 gives the sign and bits 1-31 the bucket, so the two are independent bits of one hash.

**Sketch** of ``x`` (a chunk's float32 values) in ``rows x columns`` buckets, exact in integer
arithmetic so that no order of additions can change a bit (the GPU adds with integer atomics)::

    m = max(abs(x));  if m == 0: the table is zero
    e = frexp(m)[1]                                    (m = f * 2**e, 0.5 <= f < 1)
    q = 62 - e - bit_length(n)                         (so that n * m * 2**q < 2**62)
    X_i = rint(float64(x_i) * 2**q)                    (int64; round half to even)
    T[j, bucket_j(i)] += s_j(i) * X_i                  (int64, every j and i; never overflows)
    table = float32(float64(T) * 2**-q)                (two round-to-nearest-even conversions)

**Estimates** of a table ``S`` (any table with these hashes: a sum of sketches, a momentum):
``est_i = median_j(s_j(i) * S[j, bucket_j(i)])`` over the odd number of rows, the middle of
the sorted row estimates (one of them: no arithmetic), except that a zero median is ``+0.0``:
a sort does not order ``-0.0`` against ``+0.0`` (numpy's SIMD sorts and an insertion sort
place them differently), so the sign of a zero would depend on the sort.
"""

from __future__ import annotations

import math

import numpy as np

from kvstore.codecs.counter_rng import M32, counter_hash, hash32

PURPOSE = 21
"""The purpose word of :func:`~kvstore.codecs.counter_rng.counter_hash` for the rows' keys."""

MAX_ROWS = 15
"""The most rows a sketch may have (odd counts only: the median is one of the estimates)."""


def row_keys(seed: int, key_hash: int, rows: int) -> np.ndarray:
    """``(rows, 2)`` uint32: each row's stream key halves ``lo, hi``."""
    keys = [counter_hash(seed, key_hash, PURPOSE, j) for j in range(rows)]
    return np.array([[k & M32, (k >> 32) & M32] for k in keys], dtype=np.uint32).reshape(rows, 2)


def hashes_reference(keys: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``(rows, len(indices))`` uint64 holding the 32-bit hashes of the elements at ``indices``
    (their indices in the whole key)."""
    i = np.asarray(indices, dtype=np.uint64)[None, :]
    lo = keys[:, 0].astype(np.uint64)[:, None]
    hi = keys[:, 1].astype(np.uint64)[:, None]
    return hash32((hash32(i ^ lo) + hi) & np.uint64(M32))


def buckets_and_signs_reference(
    keys: np.ndarray, indices: np.ndarray, columns: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(buckets int64, negative bool)`` of the elements at ``indices``, each ``(rows,
    len(indices))``."""
    h = hashes_reference(keys, indices)
    buckets = (((h >> np.uint64(1)) * np.uint64(columns)) >> np.uint64(31)).astype(np.int64)
    return buckets, (h & np.uint64(1)).astype(bool)


def _span(start: int, count: int) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.uint64)


def fixed_point_exponent(peak: float, count: int) -> int:
    """``q`` for values whose largest magnitude is ``peak > 0`` (a finite float32)."""
    return 62 - math.frexp(peak)[1] - int(count).bit_length()


def to_fixed_point(values: np.ndarray, q: int) -> np.ndarray:
    """``rint(float64(values) * 2**q)`` as int64."""
    return np.rint(values.astype(np.float64) * math.ldexp(1.0, q)).astype(np.int64)


def from_fixed_point(table: np.ndarray, q: int) -> np.ndarray:
    """``float32(float64(table) * 2**-q)``."""
    return (table.astype(np.float64) * math.ldexp(1.0, -q)).astype(np.float32)


def sketch_reference(values: np.ndarray, keys: np.ndarray, start: int, columns: int) -> np.ndarray:
    """The float32 ``(rows, columns)`` count sketch of ``values`` (elements ``start ..`` of
    their key)."""
    rows, count = keys.shape[0], values.size
    table = np.zeros((rows, columns), dtype=np.int64)
    if count == 0:
        return table.astype(np.float32)
    peak = float(np.max(np.abs(values)))
    if peak == 0:
        return table.astype(np.float32)
    q = fixed_point_exponent(peak, count)
    fixed = to_fixed_point(values, q)
    buckets, negative = buckets_and_signs_reference(keys, _span(start, count), columns)
    for j in range(rows):
        np.add.at(table[j], buckets[j], np.where(negative[j], -fixed, fixed))
    return from_fixed_point(table, q)


def estimates_reference(table: np.ndarray, keys: np.ndarray, start: int, count: int) -> np.ndarray:
    """float32 median estimates of elements ``start .. start+count-1`` from a ``(rows,
    columns)`` table."""
    rows, columns = table.shape
    buckets, negative = buckets_and_signs_reference(keys, _span(start, count), columns)
    per_row = np.take_along_axis(table, buckets, axis=1)
    per_row = np.where(negative, -per_row, per_row)
    median = np.sort(per_row, axis=0)[rows // 2].astype(np.float32)
    median[median == 0] = 0  # +0.0 whichever zero the sort put in the middle
    return median


def zero_buckets_reference(
    table: np.ndarray, keys: np.ndarray, start: int, local: np.ndarray
) -> None:
    """Zero, in every row, the bucket of each element at chunk-local index ``local`` (in
    place): what FetchSGD does to its tables once those elements were recovered."""
    buckets, _ = buckets_and_signs_reference(
        keys, np.asarray(local, dtype=np.uint64) + np.uint64(start), table.shape[1]
    )
    for j in range(table.shape[0]):
        table[j, buckets[j]] = 0
