"""CuPy (CUDA) kernels of the ``powersgd`` codec: the same bits as its numpy reference.

Every entry of a product is summed by one thread, in float64 from +0.0 over increasing index,
so the order is the reference's: float64 adds and multiplies go through ``__dadd_rn`` and
``__dmul_rn`` (never contracted; a product of two float32 is exact in float64 anyway), float32
terms are widened with ``ieee_widen`` and the sum is narrowed with ``cvt.rn.f32.f64`` without
``.ftz`` (CuPy's ``-ftz=true`` would flush subnormals), and the float32 add and subtract are
``ieee_add`` / ``ieee_sub`` (:mod:`kvstore.codecs.cuda_source`).

* ``M @ Q`` (:func:`accumulate_project`): a block computes 32 rows times 8 factor columns;
  ``M`` goes through shared memory 32 x 32 at a time (loads coalesced along the rows), and each
  thread adds its tile's 32 terms in column order.
* ``M^T @ P_hat`` (:func:`back_project`): one thread per entry ``(j, k)``, walking the rows;
  the threads of a warp read 32 consecutive columns of a row (coalesced).
* ``M - P_hat @ Q^T`` (:func:`residual`): one thread per element.

Imported only when a CuPy array is encoded; importing it needs CuPy.
``tests/gpu/test_cupy_powersgd.py`` checks it against the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs.cuda_source import assemble, ieee_ops, read_cu

_BLOCK = 256
_TILE = 32
_COLUMNS = 8


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, then ``powersgd.cu``."""
    return assemble(ieee_ops(), read_cu("kvstore.codecs.powersgd", "powersgd.cu"))


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14",))


def _elementwise(name: str, n: int, *args: Any) -> None:
    if n:
        _module().get_function(name)(
            ((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,), (*args, cupy.int64(n))
        )


def take_dense(grad: Any, error: Any, out: Any) -> None:
    """``out = error + grad``; ``error = 0`` (float32, all on the device)."""
    _elementwise("psgd_take_dense", int(grad.size), grad, error, out)


def accumulate_project(grad: Any, error: Any, factor: Any, out: Any, matrix: Any) -> None:
    """``error += grad``, then ``out = error @ factor`` (``matrix``: the chunk's
    :class:`~kvstore.codecs.powersgd.ChunkMatrix`)."""
    rows, cols, rank = matrix.rows, matrix.cols, matrix.rank
    _elementwise("psgd_accumulate", rows * cols, grad, error)
    grid = ((rows + _TILE - 1) // _TILE, (rank + _COLUMNS - 1) // _COLUMNS)
    _module().get_function("psgd_project")(
        grid,
        (_TILE, _COLUMNS),
        (error, factor, out, cupy.int64(rows), cupy.int64(cols), cupy.int32(rank)),
    )


def back_project(error: Any, p_hat: Any, out: Any, matrix: Any) -> None:
    """``out = error^T @ p_hat``."""
    rows, cols, rank = matrix.rows, matrix.cols, matrix.rank
    _module().get_function("psgd_back_project")(
        ((cols + _BLOCK - 1) // _BLOCK, rank),
        (_BLOCK,),
        (error, p_hat, out, cupy.int64(rows), cupy.int64(cols), cupy.int32(rank)),
    )


def residual(error: Any, p_hat: Any, q: Any, matrix: Any) -> None:
    """``error -= float32(p_hat @ q^T)``."""
    rows, cols, rank = matrix.rows, matrix.cols, matrix.rank
    n = rows * cols
    if n:
        _module().get_function("psgd_residual")(
            ((n + _BLOCK - 1) // _BLOCK,),
            (_BLOCK,),
            (error, p_hat, q, cupy.int64(rows), cupy.int64(cols), cupy.int32(rank)),
        )
