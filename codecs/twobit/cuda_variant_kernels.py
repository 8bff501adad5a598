"""CuPy (CUDA) kernels of the 2-bit codec's ``residual_clip`` variant and of its residual watch.

Same contract, bytes and residuals as :func:`kvstore.codecs.twobit.encode_clipped_reference` and
the numba ``encode_clipped``: the MXNet quantization of ``residual + grad``, then the kept
residual clipped to ``[-limit, limit]`` with selects (a NaN stays NaN, +-inf becomes +-limit).
The MXNet-exact kernels stay in :mod:`kvstore.codecs.twobit.cuda_kernels`; this module only adds.

Layout of the work, as there: with 16-byte aligned arrays each thread owns one code byte (four
elements, loaded and stored as ``float4``) and writes it, padding bytes included (code 00);
otherwise one thread per element, and the 16 threads of a word OR their codes together with
XOR shuffles. Compiled without fast-math, so adds, compares and subtracts round like numpy's.

:func:`count_at_least`, behind the runaway warning, reads the residual once (a grid-stride loop,
warp shuffles, one atomic add per warp) and returns one integer; no temporary array.

Imported only for CuPy arrays; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs._cuda_ieee import IEEE_OPS

_SOURCE = (
    IEEE_OPS
    + r"""
extern "C" {


__device__ __forceinline__ unsigned int clip_quantize(float* x, const float t, const float limit) {
    unsigned int code = 0u;
    float kept = *x;
    if (kept >= t) {
        code = 3u;
        kept = ieee_sub(kept, t);
    } else if (kept <= -t) {
        code = 2u;
        kept = ieee_add(kept, t);
    }
    *x = kept > limit ? limit : (kept < -limit ? -limit : kept);
    return code;
}

__global__ void twobit_encode_clipped4(const float* __restrict__ grad,
                                       float* __restrict__ residual,
                                       unsigned char* __restrict__ out, const float t,
                                       const float limit, const long long n,
                                       const long long nbytes) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= nbytes) return;
    long long first = 4 * j;
    unsigned int byte = 0u;
    if (first + 4 <= n) {
        float4 g = reinterpret_cast<const float4*>(grad)[j];
        float4 r = reinterpret_cast<float4*>(residual)[j];
        r.x = ieee_add(r.x, g.x);
        r.y = ieee_add(r.y, g.y);
        r.z = ieee_add(r.z, g.z);
        r.w = ieee_add(r.w, g.w);
        byte = clip_quantize(&r.x, t, limit) << 6 | clip_quantize(&r.y, t, limit) << 4
             | clip_quantize(&r.z, t, limit) << 2 | clip_quantize(&r.w, t, limit);
        reinterpret_cast<float4*>(residual)[j] = r;
    } else {
        for (int e = 0; e < 4 && first + e < n; ++e) {
            float x = ieee_add(residual[first + e], grad[first + e]);
            byte |= clip_quantize(&x, t, limit) << (6 - 2 * e);
            residual[first + e] = x;
        }
    }
    out[j] = (unsigned char)byte;
}

__global__ void twobit_encode_clipped(const float* __restrict__ grad,
                                      float* __restrict__ residual,
                                      unsigned int* __restrict__ out, const float t,
                                      const float limit, const long long n,
                                      const long long nwords) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int code = 0u;
    if (i < n) {
        float x = ieee_add(residual[i], grad[i]);
        code = clip_quantize(&x, t, limit);
        residual[i] = x;
    }
    unsigned int k = threadIdx.x & 15u;
    unsigned int v = code << (8u * (k >> 2) + 6u - 2u * (k & 3u));
    v |= __shfl_xor_sync(0xffffffffu, v, 1);
    v |= __shfl_xor_sync(0xffffffffu, v, 2);
    v |= __shfl_xor_sync(0xffffffffu, v, 4);
    v |= __shfl_xor_sync(0xffffffffu, v, 8);
    long long w = i >> 4;
    if (k == 0u && w < nwords) {
        out[w] = v;
    }
}

__global__ void twobit_count_at_least(const float* __restrict__ values, const float bound,
                                      const long long n, unsigned long long* __restrict__ count) {
    unsigned long long mine = 0ull;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        mine += fabsf(values[i]) >= bound ? 1ull : 0ull;  // NaN compares false
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        mine += __shfl_down_sync(0xffffffffu, mine, offset);
    }
    if ((threadIdx.x & 31u) == 0u && mine != 0ull) {
        atomicAdd(count, mine);
    }
}

}
"""
)

_BLOCK = 256  # a multiple of 32: every warp holds whole 16-element words
_COUNT_BLOCKS = 2048  # the count's grid-stride loop: enough blocks to fill any current device


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))


def _aligned(*arrays: Any) -> bool:
    """Whether every array starts on a 16-byte boundary (what ``float4`` loads need)."""
    return all(a.data.ptr % 16 == 0 for a in arrays)


def encode_clipped(grad: Any, residual: Any, threshold: float, limit: float, out: Any) -> None:
    """GPU twin of the CPU ``encode_clipped``: float32 ``grad``/``residual`` [n], uint32 ``out``
    words (``ceil(n/16)``, fully overwritten), float32 ``limit`` >= ``threshold``."""
    n = int(grad.size)
    nwords = int(out.size)
    if n == 0:
        return
    t = cupy.float32(threshold)
    bound = cupy.float32(limit)
    if _aligned(grad, residual):
        nbytes = 4 * nwords
        _module().get_function("twobit_encode_clipped4")(
            ((nbytes + _BLOCK - 1) // _BLOCK,),
            (_BLOCK,),
            (grad, residual, out, t, bound, cupy.int64(n), cupy.int64(nbytes)),
        )
        return
    threads = nwords * 16
    _module().get_function("twobit_encode_clipped")(
        ((threads + _BLOCK - 1) // _BLOCK,),
        (_BLOCK,),
        (grad, residual, out, t, bound, cupy.int64(n), cupy.int64(nwords)),
    )


def count_at_least(values: Any, bound: float) -> int:
    """How many elements of float32 ``values`` have ``|v| >= bound`` (one scalar back)."""
    n = int(values.size)
    if n == 0:
        return 0
    count = cupy.zeros(1, dtype=cupy.uint64)
    blocks = min((n + _BLOCK - 1) // _BLOCK, _COUNT_BLOCKS)
    _module().get_function("twobit_count_at_least")(
        (blocks,), (_BLOCK,), (values, cupy.float32(bound), cupy.int64(n), count)
    )
    return int(count.get()[0])
