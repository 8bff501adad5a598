"""CuPy (CUDA) kernels of the 16-bit casts ``fp16`` and ``bf16``: the same bytes and residuals,
bit for bit, as the numpy references of :mod:`kvstore.codecs.cast16` and the numba kernels of
``_cast_numba``, whose bit-pattern arithmetic they repeat (see that module's docstring).

One thread per element: a warp reads 128 contiguous bytes of values and writes 64 of codes.
CuPy compiles with ``-ftz=true``, under which ``__float2half_rn`` and the float operators would
flush subnormal float32 inputs and results to zero, so the conversions are integer operations
on the bit patterns, and the few float32 operations (the error-feedback add and subtract, the
``|p| + 0.5`` that rounds a subnormal half, the ``m * 2**-24`` of a subnormal half's value) go
through the PTX helpers of :mod:`kvstore.codecs._cuda_ieee`. Without error feedback, an element
that rounds past the format's range writes infinity (as the references do) and raises the
kernel's overflow report (an ``atomicMax`` of its magnitude bits, taken only by such elements),
which the encoder reads back before the payload is copied to the host.

Imported only when a CuPy array is encoded; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs._quant_cuda import QUANT_OPS

_SOURCE = (
    QUANT_OPS
    + r"""
extern "C" {

/* fp16 magnitude bits of the float32 magnitude bits a, rounded to nearest even; >= 0x7c00 when
   the value rounds past 65504. */
__device__ __forceinline__ unsigned int cast_fp16_magnitude(unsigned int a) {
    if (a < 0x38800000u) {
        /* below 2**-14: |p| + 0.5 rounds |p| to a multiple of 2**-24 (the subnormal halves'
           step); the sum's low bits are the half's bits */
        return __float_as_uint(ieee_add(__uint_as_float(a), 0.5f)) - 0x3f000000u;
    }
    return (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
}

/* bf16 magnitude bits of the finite float32 bits x, rounded to nearest even (0x7f80 when it
   rounds past 0x7f7f). */
__device__ __forceinline__ unsigned int cast_bf16_magnitude(unsigned int x) {
    return ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16) & 0x7fffu;
}

__device__ __forceinline__ unsigned int cast_magnitude(unsigned int x, int bf16) {
    return bf16 ? cast_bf16_magnitude(x) : cast_fp16_magnitude(x & 0x7fffffffu);
}

/* The float32 of 16-bit pattern h, exactly. */
__device__ __forceinline__ float cast_widen(unsigned int h, int bf16) {
    if (bf16) return __uint_as_float(h << 16);
    unsigned int magnitude = h & 0x7fffu;
    unsigned int bits;
    if (magnitude < 0x400u) {  /* zero or subnormal: m * 2**-24, exact */
        bits = __float_as_uint(ieee_mul((float)magnitude, 5.9604644775390625e-08f));
    } else {  /* rebias the exponent; infinities and NaN keep theirs all ones */
        bits = (magnitude << 13) + (magnitude >= 0x7c00u ? 0x70000000u : 0x38000000u);
    }
    return __uint_as_float(bits | ((h & 0x8000u) << 16));
}

__global__ void cast_encode(const float* __restrict__ values, unsigned short* __restrict__ out,
                            const long long n, const int bf16,
                            unsigned int* __restrict__ overflow) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    unsigned int x = __float_as_uint(values[j]);
    unsigned int magnitude = cast_magnitude(x, bf16);
    unsigned int infinity = bf16 ? 0x7f80u : 0x7c00u;
    if (magnitude >= infinity) {
        magnitude = infinity;
        atomicMax(overflow, x & 0x7fffffffu);
    }
    out[j] = (unsigned short)(((x >> 16) & 0x8000u) | magnitude);
}

__global__ void cast_encode_feedback(const float* __restrict__ values,
                                     float* __restrict__ residual,
                                     unsigned short* __restrict__ out, const long long n,
                                     const int bf16) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    unsigned int x = __float_as_uint(ieee_add(residual[j], values[j]));
    if ((x & 0x7fffffffu) > 0x7f7fffffu) {  /* the sum overflowed: the largest finite float */
        x = (x & 0x80000000u) | 0x7f7fffffu;
    }
    unsigned int largest = bf16 ? 0x7f7fu : 0x7bffu;
    unsigned int h = ((x >> 16) & 0x8000u) | min(cast_magnitude(x, bf16), largest);
    out[j] = (unsigned short)h;
    residual[j] = ieee_sub(__uint_as_float(x), cast_widen(h, bf16));
}

__global__ void cast_decode(const unsigned short* __restrict__ codes, float* __restrict__ out,
                            const long long n, const int bf16, const int accumulate) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    float v = cast_widen(codes[j], bf16);
    out[j] = accumulate ? ieee_add(out[j], v) : v;
}

}
"""
)

_BLOCK = 256


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))


@functools.cache
def _largest_magnitude_kernel() -> Any:
    return cupy.ReductionKernel(
        "uint32 bits",
        "uint32 largest",
        "bits & 0x7fffffffu",
        "max(a, b)",
        "largest = a",
        "0",
        "kvstore_cast_largest_magnitude",
    )


def _grid(n: int) -> tuple[int]:
    return ((n + _BLOCK - 1) // _BLOCK,)


def encode(values: Any, residual: Any, out: Any, bf16: bool, overflow: Any) -> int:
    """Encode float32 ``values`` [n] into the uint16 patterns ``out`` [n]; with error feedback
    when ``residual`` (float32 [n], updated) is given.

    Returns:
        Without error feedback, the largest magnitude (float32 bits) among the elements that
        rounded past the format's range, 0 if none (``overflow``: a uint32 [1] device scratch;
        reading it waits for the kernel); with error feedback, 0.
    """
    n = int(values.size)
    if n == 0:
        return 0
    fmt = cupy.int32(1 if bf16 else 0)
    if residual is None:
        overflow.fill(0)
        _module().get_function("cast_encode")(
            _grid(n), (_BLOCK,), (values, out, cupy.int64(n), fmt, overflow)
        )
        return int(overflow.get()[0])
    _module().get_function("cast_encode_feedback")(
        _grid(n), (_BLOCK,), (values, residual, out, cupy.int64(n), fmt)
    )
    return 0


def decode(codes: Any, out: Any, bf16: bool, accumulate: bool) -> None:
    """``out`` (float32 [n]) = the float32 of the uint16 patterns ``codes`` [n], or ``+=`` it
    (a float32 add) with ``accumulate``."""
    n = int(out.size)
    if n == 0:
        return
    _module().get_function("cast_decode")(
        _grid(n),
        (_BLOCK,),
        (codes, out, cupy.int64(n), cupy.int32(1 if bf16 else 0), cupy.int32(int(accumulate))),
    )


def largest_magnitude(values: Any) -> int:
    """The largest ``|v|`` of float32 ``values`` as float32 bits (0 when empty); one scalar
    back, which waits for the reduction."""
    if values.size == 0:
        return 0
    return int(_largest_magnitude_kernel()(values.view(cupy.uint32)))
