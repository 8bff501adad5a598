"""CuPy (CUDA) kernels of the count sketch: the same bits as the numpy reference in
:mod:`kvstore.codecs.sketch.hashing` and the numba kernels.

* :func:`peak_abs`: the largest magnitude, by the float bits of ``abs(x)`` (an integer
  ``atomicMax`` per warp; one scalar back to the host, which :func:`sketch` needs for ``q``).
* :func:`sketch`: each element's fixed-point value ``rint(float64(x) * 2**q)`` added to its
  bucket in every row with 64-bit integer atomics. Two's complement addition is exact and
  commutes, so the table does not depend on the order of the atomics (no float atomics
  anywhere). A table of at most :data:`SHARED_ENTRIES` entries is summed per block in shared
  memory first, so that a narrow sketch does not serialize every block on a few global words;
  then one pass converts ``float32(float64(T) * 2**-q)``.
* :func:`estimates`: one thread per element gathers its signed row estimates and sorts them by
  insertion on integer keys of their bits (a zero median is ``+0.0``, as in the reference).
* :func:`zero_buckets`: one thread per recovered element zeroes its bucket in every row.

Every float conversion is an explicit round-to-nearest instruction without ``.ftz`` (CuPy
compiles with ``-ftz=true``, which would flush subnormals), and the kernels are compiled with
``--fmad=false``. Imported only when a CuPy array is sketched; importing it needs CuPy.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import cupy
import numpy as np

from kvstore.codecs.cuda_source import assemble, defines, ieee_ops, read_cu
from kvstore.codecs.sketch.hashing import MAX_ROWS, fixed_point_exponent

_THREADS = 256
SHARED_ENTRIES = 4096
"""The largest table (``rows * columns``) summed per block in shared memory (32 KiB)."""


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, the row limit, then ``sketch.cu``."""
    return assemble(
        ieee_ops(), defines(MAX_ROWS=MAX_ROWS), read_cu("kvstore.codecs.sketch", "sketch.cu")
    )


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14", "--fmad=false"))


def _kernel(name: str) -> Any:
    return _module().get_function(name)


def _blocks(count: int) -> int:
    return max(1, -(-count // _THREADS))


@functools.cache
def _resident_blocks(device: int) -> int:
    return 4 * cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def _device_keys(keys: np.ndarray) -> Any:
    """The rows' stream key halves (``row_keys``) as a contiguous uint32 device array."""
    keys = np.ascontiguousarray(keys, dtype=np.uint32)
    if keys.ndim != 2 or keys.shape[1] != 2 or not 1 <= keys.shape[0] <= MAX_ROWS:
        raise ValueError(f"keys must be (rows, 2) with 1 <= rows <= {MAX_ROWS}, got {keys.shape}")
    return cupy.asarray(keys)


def _flat_float32(values: Any) -> Any:
    if values.dtype != cupy.float32:
        raise TypeError(f"the count sketch takes float32 values, got {values.dtype}")
    return cupy.ascontiguousarray(values.ravel())


def peak_abs(values: Any) -> float:
    """``max(abs(values))`` of a float32 CuPy array (exact; 0.0 when empty)."""
    x = _flat_float32(values)
    n = int(x.size)
    if n == 0:
        return 0.0
    peak = cupy.zeros(1, dtype=cupy.uint32)
    blocks = min(_blocks(n), _resident_blocks(x.device.id))
    _kernel("sketch_peak")((blocks,), (_THREADS,), (x, cupy.int64(n), peak))
    return float(np.uint32(peak.get()[0]).view(np.float32))


def sketch(values: Any, keys: np.ndarray, start: int, columns: int) -> Any:
    """The float32 ``(rows, columns)`` CuPy count sketch of ``values`` (float32, elements
    ``start ..`` of their key): :func:`~kvstore.codecs.sketch.hashing.sketch_reference`."""
    x = _flat_float32(values)
    rows, n = int(keys.shape[0]), int(x.size)
    out = cupy.zeros((rows, columns), dtype=cupy.float32)
    peak = peak_abs(x)
    if peak == 0:
        return out
    q = fixed_point_exponent(peak, n)
    table = cupy.zeros((rows, columns), dtype=cupy.int64)
    entries = rows * columns
    shared = entries <= SHARED_ENTRIES
    blocks = min(_blocks(n), _resident_blocks(x.device.id)) if shared else _blocks(n)
    _kernel("sketch_scatter")(
        (blocks,),
        (_THREADS,),
        (
            x,
            cupy.int64(n),
            _device_keys(keys),
            cupy.int32(rows),
            cupy.int64(columns),
            cupy.uint64(start),
            cupy.float64(math.ldexp(1.0, q)),
            cupy.int32(shared),
            table,
        ),
        shared_mem=entries * 8 if shared else 0,
    )
    _kernel("sketch_finish")(
        (_blocks(entries),),
        (_THREADS,),
        (table, cupy.int64(entries), cupy.float64(math.ldexp(1.0, -q)), out),
    )
    return out


def estimates(table: Any, keys: np.ndarray, start: int, count: int) -> Any:
    """float32 CuPy median estimates of elements ``start .. start+count-1`` from a float32
    ``(rows, columns)`` CuPy table: :func:`~kvstore.codecs.sketch.hashing.estimates_reference`."""
    rows, columns = (int(d) for d in table.shape)
    source = cupy.ascontiguousarray(table, dtype=cupy.float32)
    out = cupy.empty(count, dtype=cupy.float32)
    if count == 0:
        return out
    _kernel("sketch_estimates")(
        (_blocks(count),),
        (_THREADS,),
        (
            source,
            cupy.int32(rows),
            cupy.int64(columns),
            _device_keys(keys),
            cupy.uint64(start),
            cupy.int64(count),
            out,
        ),
    )
    return out


def zero_buckets(table: Any, keys: np.ndarray, start: int, local: Any) -> None:
    """Zero, in place in every row of the contiguous float32 CuPy ``table``, the bucket of each
    element at chunk-local index ``local[t]`` (a CuPy integer array):
    :func:`~kvstore.codecs.sketch.hashing.zero_buckets_reference`."""
    if table.dtype != cupy.float32 or not table.flags.c_contiguous:
        raise ValueError("zero_buckets changes a contiguous float32 table in place")
    indices = cupy.ascontiguousarray(local.ravel(), dtype=cupy.int64)
    count = int(indices.size)
    if count == 0:
        return
    rows, columns = (int(d) for d in table.shape)
    _kernel("sketch_zero")(
        (_blocks(count),),
        (_THREADS,),
        (
            table,
            cupy.int32(rows),
            cupy.int64(columns),
            _device_keys(keys),
            cupy.uint64(start),
            indices,
            cupy.int64(count),
        ),
    )
