"""CuPy (CUDA) kernels of the 2-bit codec: same contract, bytes and residuals as the CPU ones.

One thread per element, so loads and stores of gradients and residuals are coalesced. Each
thread computes its 2-bit code in place in a 32-bit word, and the 16 threads of a word combine
their codes with an XOR-shuffle OR-reduction; the first of them stores the word. Threads past
``n`` contribute code 00, which is the format's padding. Compiled without fast-math, so the
float32 add, compares and subtracts round exactly like numpy's.

Imported only when a CuPy array is encoded; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

_SOURCE = r"""
extern "C" {

__device__ __forceinline__ unsigned int twobit_shift(unsigned int k) {
    return 8u * (k >> 2) + 6u - 2u * (k & 3u);
}

__global__ void twobit_encode(const float* __restrict__ grad, float* __restrict__ residual,
                              unsigned int* __restrict__ out, const float t,
                              const long long n, const long long nwords) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int code = 0u;
    if (i < n) {
        float x = residual[i] + grad[i];
        if (x >= t) {
            code = 3u;
            x = x - t;
        } else if (x <= -t) {
            code = 2u;
            x = x + t;
        }
        residual[i] = x;
    }
    unsigned int k = threadIdx.x & 15u;
    unsigned int v = code << twobit_shift(k);
    v |= __shfl_xor_sync(0xffffffffu, v, 1);
    v |= __shfl_xor_sync(0xffffffffu, v, 2);
    v |= __shfl_xor_sync(0xffffffffu, v, 4);
    v |= __shfl_xor_sync(0xffffffffu, v, 8);
    long long w = i >> 4;
    if (k == 0u && w < nwords) {
        out[w] = v;
    }
}

__global__ void twobit_decode(const unsigned int* __restrict__ words, float* __restrict__ out,
                              const float t, const long long n, const int accumulate) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int code = (words[i >> 4] >> twobit_shift((unsigned int)(i & 15))) & 3u;
    float v = code == 3u ? t : (code == 2u ? -t : 0.0f);
    out[i] = accumulate ? out[i] + v : v;
}

}
"""

_BLOCK = 256  # a multiple of 32, so every warp holds whole 16-element words


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))


def encode(grad: Any, residual: Any, threshold: float, out: Any) -> None:
    """GPU twin of the CPU ``encode``: float32 ``grad``/``residual`` [n], uint32 ``out`` words."""
    n = int(grad.size)
    nwords = int(out.size)
    if n == 0:
        return
    threads = nwords * 16
    grid = (threads + _BLOCK - 1) // _BLOCK
    kernel = _module().get_function("twobit_encode")
    kernel(
        (grid,),
        (_BLOCK,),
        (grad, residual, out, cupy.float32(threshold), cupy.int64(n), cupy.int64(nwords)),
    )


def decode(words: Any, n: int, threshold: float, out: Any, accumulate: bool) -> None:
    """GPU twin of the CPU ``decode``."""
    if n == 0:
        return
    grid = (n + _BLOCK - 1) // _BLOCK
    kernel = _module().get_function("twobit_decode")
    kernel(
        (grid,),
        (_BLOCK,),
        (words, out, cupy.float32(threshold), cupy.int64(n), cupy.int32(1 if accumulate else 0)),
    )
