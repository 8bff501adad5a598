"""Compiled CPU kernel of :mod:`kvstore.codecs.finite` (numba, GIL released, cached on disk)."""

from __future__ import annotations

from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)


@njit(nogil=True, cache=True)
def count_nonfinite(bits, mask):
    """Elements of ``bits`` (a float array viewed as unsigned ints of its width) whose exponent
    bits, ``mask``, are all set: NaN and infinities. A plain counting loop, vectorized by LLVM."""
    n = 0
    for i in range(bits.shape[0]):
        n += (bits[i] & mask) == mask
    return n
