"""Which implementation computes a sketch, its estimates and its bucket zeroing.

CuPy values are sketched on their GPU (:mod:`.cuda_kernels`); host values by the numba kernels
(:mod:`.numba_kernels`) or, with ``KVSTORE_CPU_KERNELS=numpy``, by the reference
(:mod:`.hashing`). All three give the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.codecs.sketch import hashing
from kvstore.codecs.xp import device_to_host, is_cupy_array
from kvstore.config import cpu_kernels_from_env


def compiled() -> bool:
    """Whether host arrays go to the numba kernels (``KVSTORE_CPU_KERNELS``)."""
    return cpu_kernels_from_env() == "numba"


def _numba() -> Any:
    from kvstore.codecs.sketch import numba_kernels  # noqa: PLC0415  (compiles on first use)

    return numba_kernels


def sketch_into(
    values: Any, keys: np.ndarray, start: int, out: np.ndarray, scratch: np.ndarray | None = None
) -> None:
    """Write the count sketch of ``values`` (numpy or CuPy; elements ``start ..`` of their key)
    into the host float32 ``(rows, columns)`` array ``out``. ``scratch``: an int64 array of
    ``out``'s shape that the numba kernel accumulates in (the caller's, so that a push
    allocates nothing; None: one is made)."""
    columns = out.shape[1]
    if is_cupy_array(values):
        from kvstore.codecs.sketch import cuda_kernels  # noqa: PLC0415  (CuPy only)

        table = cuda_kernels.sketch(values, keys, start, columns)
        device_to_host(table.reshape(-1), out.reshape(-1))
        return
    if not compiled():
        out[...] = hashing.sketch_reference(values, keys, start, columns)
        return
    numba = _numba()
    peak = float(numba.peak_abs(values))
    if peak == 0.0:
        out.fill(0)
        return
    q = hashing.fixed_point_exponent(peak, values.size)
    fixed = np.empty(out.shape, dtype=np.int64) if scratch is None else scratch
    numba.sketch_into(values, keys, start, columns, q, fixed, out)


def estimates(
    table: np.ndarray, keys: np.ndarray, start: int, count: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The float32 median estimates of elements ``start .. start + count - 1`` (host), written
    into ``out`` (``count`` float32, reused across rounds) when given; returns them."""
    if out is None:
        out = np.empty(count, dtype=np.float32)
    if compiled():
        _numba().estimates_into(table, keys, start, out)
    else:
        out[...] = hashing.estimates_reference(table, keys, start, count)
    return out


def zero_buckets(table: np.ndarray, keys: np.ndarray, start: int, local: np.ndarray) -> None:
    """Zero every row's bucket of the elements at chunk-local ``local`` (host, in place)."""
    if local.size == 0:
        return
    if not compiled():
        hashing.zero_buckets_reference(table, keys, start, local)
        return
    _numba().zero_buckets(table, keys, start, local)
