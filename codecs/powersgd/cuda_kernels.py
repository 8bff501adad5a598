"""CuPy (CUDA) kernels of the ``powersgd`` codec: the same bits as its numpy reference.

Every entry of a product is summed by one thread, in float64 from +0.0 over increasing index,
so the order is the reference's: float64 adds and multiplies go through ``__dadd_rn`` and
``__dmul_rn`` (never contracted; a product of two float32 is exact in float64 anyway), float32
terms are widened with ``ieee_widen`` and the sum is narrowed with ``cvt.rn.f32.f64`` without
``.ftz`` (CuPy's ``-ftz=true`` would flush subnormals), and the float32 add and subtract are
``ieee_add`` / ``ieee_sub`` (:mod:`kvstore.codecs._cuda_ieee`).

* ``M @ Q`` (:func:`accumulate_project`): a block computes 32 rows times 8 factor columns;
  ``M`` goes through shared memory 32 x 32 at a time (loads coalesced along the rows), and each
  thread adds its tile's 32 terms in column order.
* ``M^T @ P_hat`` (:func:`back_project`): one thread per entry ``(j, k)``, walking the rows;
  the threads of a warp read 32 consecutive columns of a row (coalesced).
* ``M - P_hat @ Q^T`` (:func:`residual`): one thread per element.

Imported only when a CuPy array is encoded; importing it needs CuPy. Untested here (no GPU on
the development machine); tests/gpu/test_cupy_powersgd.py checks it against the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs._cuda_ieee import IEEE_OPS

_SOURCE = (
    IEEE_OPS
    + r"""
/* float64 to float32, rounded to nearest, subnormal results kept. */
__device__ __forceinline__ float psgd_narrow(double x) {
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(x));
    return f;
}

/* a * b + sum, float32 terms, in float64, uncontracted. */
__device__ __forceinline__ double psgd_term(double sum, float a, float b) {
    return __dadd_rn(sum, __dmul_rn(ieee_widen(a), ieee_widen(b)));
}

#define PSGD_TILE 32
#define PSGD_COLUMNS 8

extern "C" {

__global__ void psgd_accumulate(const float* __restrict__ grad, float* __restrict__ error,
                                const long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) error[i] = ieee_add(error[i], grad[i]);
}

__global__ void psgd_take_dense(const float* __restrict__ grad, float* __restrict__ error,
                                float* __restrict__ out, const long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = ieee_add(error[i], grad[i]);
        error[i] = 0.0f;
    }
}

/* out (rows x rank) = matrix (rows x cols) @ factor (cols x rank). Block (32, 8): thread
   (x, y) sums row blockIdx.x * 32 + x, factor column blockIdx.y * 8 + y. */
__global__ void psgd_project(const float* __restrict__ matrix, const float* __restrict__ factor,
                             float* __restrict__ out, const long long rows,
                             const long long cols, const int rank) {
    __shared__ float tile[PSGD_TILE][PSGD_TILE + 1];  /* +1: no bank conflicts down a column */
    __shared__ float weights[PSGD_TILE][PSGD_COLUMNS];
    const int x = threadIdx.x, y = threadIdx.y;
    const long long first_row = (long long)blockIdx.x * PSGD_TILE;
    const int k = blockIdx.y * PSGD_COLUMNS + y;
    const int flat = y * PSGD_TILE + x;  /* 256 threads load the 32 x 8 weights */
    const int weight_row = flat / PSGD_COLUMNS;
    const int weight_k = blockIdx.y * PSGD_COLUMNS + flat % PSGD_COLUMNS;
    double sum = 0.0;
    for (long long first_col = 0; first_col < cols; first_col += PSGD_TILE) {
        const long long left = cols - first_col;
        const int width = left < PSGD_TILE ? (int)left : PSGD_TILE;
        for (int t = y; t < PSGD_TILE; t += PSGD_COLUMNS) {
            const long long row = first_row + t;
            tile[t][x] = (row < rows && x < width) ? matrix[row * cols + first_col + x] : 0.0f;
        }
        weights[weight_row][flat % PSGD_COLUMNS] =
            (weight_row < width && weight_k < rank)
                ? factor[(first_col + weight_row) * rank + weight_k] : 0.0f;
        __syncthreads();
        for (int c = 0; c < width; ++c) sum = psgd_term(sum, tile[x][c], weights[c][y]);
        __syncthreads();
    }
    const long long row = first_row + x;
    if (row < rows && k < rank) out[row * rank + k] = psgd_narrow(sum);
}

/* out (cols x rank) = matrix^T @ p_hat (rows x rank): thread (j, k = blockIdx.y). */
__global__ void psgd_back_project(const float* __restrict__ matrix,
                                  const float* __restrict__ p_hat, float* __restrict__ out,
                                  const long long rows, const long long cols, const int rank) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int k = blockIdx.y;
    if (j >= cols) return;
    double sum = 0.0;
    for (long long i = 0; i < rows; ++i) {
        sum = psgd_term(sum, matrix[i * cols + j], p_hat[i * rank + k]);
    }
    out[j * rank + k] = psgd_narrow(sum);
}

/* matrix -= float32(p_hat @ q^T), element by element. */
__global__ void psgd_residual(float* __restrict__ matrix, const float* __restrict__ p_hat,
                              const float* __restrict__ q, const long long rows,
                              const long long cols, const int rank) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= rows * cols) return;
    const long long i = e / cols, j = e - i * cols;
    double sum = 0.0;
    for (int k = 0; k < rank; ++k) sum = psgd_term(sum, p_hat[i * rank + k], q[j * rank + k]);
    matrix[e] = ieee_sub(matrix[e], psgd_narrow(sum));
}

}
"""
)

_BLOCK = 256
_TILE = 32
_COLUMNS = 8


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))


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
