"""CuPy (CUDA) kernels of the 2-bit codec: same contract, bytes and residuals as the CPU ones.

The fast kernels give each thread one byte of codes, i.e. four consecutive elements: it loads
them as one 16-byte ``float4`` (gradient and residual), stores the residual the same way and
writes its code byte, so a warp moves whole 512-byte lines and memory runs near the device's copy
bandwidth. Byte ``j`` of the little-endian words is exactly the format's byte ``j`` (elements
``4j..4j+3``, first in the high bits). Threads of the last, partial group and of the padding
bytes of the last word fall back to element-wise loads and write code 00, the format's padding.
Those kernels need 16-byte aligned arrays; a misaligned view (a slice that starts mid-line) uses
the element-per-thread kernels below them, which combine 16 codes per word with an XOR-shuffle
OR-reduction. Compiled without fast-math, so the float32 add, compares and subtracts round
exactly like numpy's.

Imported only when a CuPy array is encoded; importing it needs CuPy.
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


__device__ __forceinline__ unsigned int twobit_shift(unsigned int k) {
    return 8u * (k >> 2) + 6u - 2u * (k & 3u);
}

__global__ void twobit_encode(const float* __restrict__ grad, float* __restrict__ residual,
                              unsigned int* __restrict__ out, const float t,
                              const long long n, const long long nwords) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int code = 0u;
    if (i < n) {
        float x = ieee_add(residual[i], grad[i]);
        if (x >= t) {
            code = 3u;
            x = ieee_sub(x, t);
        } else if (x <= -t) {
            code = 2u;
            x = ieee_add(x, t);
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

__device__ __forceinline__ unsigned int twobit_quantize(float* x, const float t) {
    if (*x >= t) {
        *x = ieee_sub(*x, t);
        return 3u;
    }
    if (*x <= -t) {
        *x = ieee_add(*x, t);
        return 2u;
    }
    return 0u;
}

__device__ __forceinline__ float twobit_value(unsigned int code, const float t) {
    return code == 3u ? t : (code == 2u ? -t : 0.0f);
}

__global__ void twobit_encode4(const float* __restrict__ grad, float* __restrict__ residual,
                               unsigned char* __restrict__ out, const float t,
                               const long long n, const long long nbytes) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= nbytes) return;
    long long i = 4 * j;
    unsigned int byte = 0u;
    if (i + 4 <= n) {
        float4 g = reinterpret_cast<const float4*>(grad)[j];
        float4 r = reinterpret_cast<float4*>(residual)[j];
        r.x = ieee_add(r.x, g.x);
        r.y = ieee_add(r.y, g.y);
        r.z = ieee_add(r.z, g.z);
        r.w = ieee_add(r.w, g.w);
        byte = twobit_quantize(&r.x, t) << 6 | twobit_quantize(&r.y, t) << 4
             | twobit_quantize(&r.z, t) << 2 | twobit_quantize(&r.w, t);
        reinterpret_cast<float4*>(residual)[j] = r;
    } else {
        for (int e = 0; e < 4; ++e) {
            if (i + e < n) {
                float x = ieee_add(residual[i + e], grad[i + e]);
                byte |= twobit_quantize(&x, t) << (6 - 2 * e);
                residual[i + e] = x;
            }
        }
    }
    out[j] = (unsigned char)byte;
}

__global__ void twobit_decode4(const unsigned char* __restrict__ codes, float* __restrict__ out,
                               const float t, const long long n, const int accumulate) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = 4 * j;
    if (i >= n) return;
    unsigned int byte = codes[j];
    if (i + 4 <= n) {
        float4 o = accumulate ? reinterpret_cast<float4*>(out)[j] : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 v = make_float4(twobit_value(byte >> 6, t), twobit_value((byte >> 4) & 3u, t),
                               twobit_value((byte >> 2) & 3u, t), twobit_value(byte & 3u, t));
        if (accumulate) {
            v.x = ieee_add(o.x, v.x);
            v.y = ieee_add(o.y, v.y);
            v.z = ieee_add(o.z, v.z);
            v.w = ieee_add(o.w, v.w);
        }
        reinterpret_cast<float4*>(out)[j] = v;
    } else {
        for (int e = 0; i + e < n; ++e) {
            float v = twobit_value((byte >> (6 - 2 * e)) & 3u, t);
            out[i + e] = accumulate ? ieee_add(out[i + e], v) : v;
        }
    }
}

__global__ void twobit_decode(const unsigned int* __restrict__ words, float* __restrict__ out,
                              const float t, const long long n, const int accumulate) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int code = (words[i >> 4] >> twobit_shift((unsigned int)(i & 15))) & 3u;
    float v = code == 3u ? t : (code == 2u ? -t : 0.0f);
    out[i] = accumulate ? ieee_add(out[i], v) : v;
}

}
"""
)

_BLOCK = 256  # a multiple of 32, so every warp holds whole 16-element words


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))


def _aligned(*arrays: Any) -> bool:
    """Whether every array starts on a 16-byte boundary (what ``float4`` loads need)."""
    return all(a.data.ptr % 16 == 0 for a in arrays)


def encode(grad: Any, residual: Any, threshold: float, out: Any) -> None:
    """GPU twin of the CPU ``encode``: float32 ``grad``/``residual`` [n], uint32 ``out`` words."""
    n = int(grad.size)
    nwords = int(out.size)
    if n == 0:
        return
    if _aligned(grad, residual):
        nbytes = 4 * nwords  # every byte of the words is written, the padding ones with 00
        _module().get_function("twobit_encode4")(
            ((nbytes + _BLOCK - 1) // _BLOCK,),
            (_BLOCK,),
            (grad, residual, out, cupy.float32(threshold), cupy.int64(n), cupy.int64(nbytes)),
        )
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
    if _aligned(out):
        groups = (n + 3) // 4
        _module().get_function("twobit_decode4")(
            ((groups + _BLOCK - 1) // _BLOCK,),
            (_BLOCK,),
            (
                words,
                out,
                cupy.float32(threshold),
                cupy.int64(n),
                cupy.int32(1 if accumulate else 0),
            ),
        )
        return
    grid = (n + _BLOCK - 1) // _BLOCK
    kernel = _module().get_function("twobit_decode")
    kernel(
        (grid,),
        (_BLOCK,),
        (words, out, cupy.float32(threshold), cupy.int64(n), cupy.int32(1 if accumulate else 0)),
    )
