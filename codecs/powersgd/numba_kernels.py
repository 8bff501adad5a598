"""Compiled CPU kernels of the ``powersgd`` codec (numba, GIL released, cached on disk).

Bit for bit the numpy references of :mod:`kvstore.codecs.powersgd`: every entry of a product is
a float64 sum from +0.0 over increasing index of float64 products of float32 terms, rounded once
to float32. Such a product is exact (24 + 24 significant bits fit in float64's 53), so a fused
multiply-add rounds exactly like the add alone: the kernels let LLVM contract (``fastmath``
``contract`` only; no reassociation, so every sum keeps its order). Speed comes from running
many independent sums side by side:

* ``M @ Q`` (:func:`accumulate_project`): four rows by four factor columns at a time, sixteen
  float64 sums in registers, each row read once per four columns (the factor's columns are
  padded to a multiple of four with zeros, whose sums are dropped).
* ``M^T @ P_hat`` (:func:`back_project`): four rows' terms are added, in row order, to a row
  of float64 sums (one per column): the column loop vectorizes.
* ``P_hat @ Q^T`` (:func:`residual`): one row of float64 sums per row of ``M``, a factor column
  at a time (the column loop vectorizes), then ``M - float32(sum)``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)

_EXACT = {"contract"}  # fused multiply-adds only: the products are exact (see above)


@njit(nogil=True, cache=True, fastmath=_EXACT)
def accumulate_project(grad, error, factor, rows, cols, rank, out):
    """``error += grad`` (float32, ``rows * cols``), then ``out = error @ factor`` (factor
    ``cols x rank``, out ``rows x rank``, row-major float32), four rows at a time."""
    groups = (rank + 3) // 4
    right = np.zeros((groups, cols, 4))  # column k of the factor at [k // 4, :, k % 4]
    for j in range(cols):
        for k in range(rank):
            right[k // 4, j, k % 4] = np.float64(factor[j * rank + k])
    sums = np.empty((4, 4))
    for first in range(0, rows, 4):
        count = min(4, rows - first)
        for i in range(first * cols, (first + count) * cols):
            error[i] = error[i] + grad[i]
        # (past the last row, the last row again: those sums are not written)
        b0 = first * cols
        b1 = min(first + 1, rows - 1) * cols
        b2 = min(first + 2, rows - 1) * cols
        b3 = min(first + 3, rows - 1) * cols
        for g in range(groups):
            w = right[g]
            a00 = a01 = a02 = a03 = 0.0
            a10 = a11 = a12 = a13 = 0.0
            a20 = a21 = a22 = a23 = 0.0
            a30 = a31 = a32 = a33 = 0.0
            for j in range(cols):
                w0, w1, w2, w3 = w[j, 0], w[j, 1], w[j, 2], w[j, 3]
                x = np.float64(error[b0 + j])
                a00 += x * w0
                a01 += x * w1
                a02 += x * w2
                a03 += x * w3
                x = np.float64(error[b1 + j])
                a10 += x * w0
                a11 += x * w1
                a12 += x * w2
                a13 += x * w3
                x = np.float64(error[b2 + j])
                a20 += x * w0
                a21 += x * w1
                a22 += x * w2
                a23 += x * w3
                x = np.float64(error[b3 + j])
                a30 += x * w0
                a31 += x * w1
                a32 += x * w2
                a33 += x * w3
            sums[0, 0], sums[0, 1], sums[0, 2], sums[0, 3] = a00, a01, a02, a03
            sums[1, 0], sums[1, 1], sums[1, 2], sums[1, 3] = a10, a11, a12, a13
            sums[2, 0], sums[2, 1], sums[2, 2], sums[2, 3] = a20, a21, a22, a23
            sums[3, 0], sums[3, 1], sums[3, 2], sums[3, 3] = a30, a31, a32, a33
            for b in range(count):
                for c in range(min(4, rank - 4 * g)):
                    out[(first + b) * rank + 4 * g + c] = np.float32(sums[b, c])


@njit(nogil=True, cache=True, fastmath=_EXACT)
def back_project(matrix, p_hat, rows, cols, rank, out):
    """``out = matrix^T @ p_hat`` (matrix ``rows x cols``, p_hat ``rows x rank``, out
    ``cols x rank``; row-major float32): the sums run over the rows in order."""
    sums = np.zeros((rank, cols))
    full = rows - rows % 4
    for i in range(0, full, 4):
        r0 = matrix[i * cols : (i + 1) * cols]
        r1 = matrix[(i + 1) * cols : (i + 2) * cols]
        r2 = matrix[(i + 2) * cols : (i + 3) * cols]
        r3 = matrix[(i + 3) * cols : (i + 4) * cols]
        for k in range(rank):
            p0 = np.float64(p_hat[i * rank + k])
            p1 = np.float64(p_hat[(i + 1) * rank + k])
            p2 = np.float64(p_hat[(i + 2) * rank + k])
            p3 = np.float64(p_hat[(i + 3) * rank + k])
            column_sums = sums[k]
            for j in range(cols):
                s = column_sums[j]
                s += np.float64(r0[j]) * p0
                s += np.float64(r1[j]) * p1
                s += np.float64(r2[j]) * p2
                s += np.float64(r3[j]) * p3
                column_sums[j] = s
    for i in range(full, rows):
        r0 = matrix[i * cols : (i + 1) * cols]
        for k in range(rank):
            p0 = np.float64(p_hat[i * rank + k])
            column_sums = sums[k]
            for j in range(cols):
                column_sums[j] += np.float64(r0[j]) * p0
    for j in range(cols):
        for k in range(rank):
            out[j * rank + k] = np.float32(sums[k, j])


@njit(nogil=True, cache=True, fastmath=_EXACT)
def residual(matrix, p_hat, q, rows, cols, rank):
    """``matrix -= p_hat @ q^T`` in float32, the product rounded to float32 first (matrix
    ``rows x cols``, p_hat ``rows x rank``, q ``cols x rank``; row-major float32)."""
    right = np.empty((rank, cols))
    for j in range(cols):
        for k in range(rank):
            right[k, j] = np.float64(q[j * rank + k])
    sums = np.empty(cols)
    for i in range(rows):
        sums[:] = 0.0
        for k in range(rank):
            weight = np.float64(p_hat[i * rank + k])
            terms = right[k]
            for j in range(cols):
                sums[j] += weight * terms[j]
        row = matrix[i * cols : (i + 1) * cols]
        for j in range(cols):
            row[j] = row[j] - np.float32(sums[j])
