"""CuPy (CUDA) kernel of :mod:`kvstore.codecs.finite`: the count of NaN and infinities of a GPU
array, read once at memory bandwidth.

A grid of a few blocks per multiprocessor strides over the array; each thread counts its
elements (16-byte vector loads when the array is 16-byte aligned, one element at a time for the
tail or a misaligned view), the warp adds its lanes' counts with shuffles, and lane 0 adds the
warp's count to one device counter. Counts are integers, so the order of the atomic additions
changes nothing. (CuPy's ``ReductionKernel`` gives a reduction to one scalar a single block:
75 ms for 100M float32 on an H200, against 0.1 ms here.)

Imported only when a CuPy array is checked; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

_SOURCE = r"""
template <typename T>
__global__ void count_nonfinite(const T* __restrict__ bits, const long long n, const T mask,
                                const int aligned, unsigned long long* __restrict__ count) {
    constexpr int PER_VECTOR = 16 / sizeof(T);
    const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned long long mine = 0ull;
    long long tail = 0;
    if (aligned) {
        const long long vectors = n / PER_VECTOR;
        const uint4* v = reinterpret_cast<const uint4*>(bits);
        for (long long j = thread; j < vectors; j += stride) {
            uint4 word = v[j];
            const T* items = reinterpret_cast<const T*>(&word);
#pragma unroll
            for (int e = 0; e < PER_VECTOR; ++e) mine += (items[e] & mask) == mask ? 1ull : 0ull;
        }
        tail = vectors * PER_VECTOR;
    }
    for (long long i = tail + thread; i < n; i += stride) {
        mine += (bits[i] & mask) == mask ? 1ull : 0ull;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        mine += __shfl_xor_sync(0xffffffffu, mine, offset);
    }
    if ((threadIdx.x & 31) == 0 && mine) atomicAdd(count, mine);
}
"""

_TYPES = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_THREADS = 256


@functools.cache
def _module() -> Any:
    names = [f"count_nonfinite<{name}>" for name in _TYPES.values()]
    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",), name_expressions=names)


@functools.cache
def _blocks(device: int) -> int:
    return 8 * cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def count_nonfinite(bits: Any, mask: Any) -> int:
    """Elements of the flat, contiguous unsigned CuPy array ``bits`` (a float array's bits)
    with all of ``mask`` set; one scalar back, which waits for the kernel."""
    n = int(bits.size)
    if n == 0:
        return 0
    width = bits.dtype.itemsize
    count = cupy.zeros(1, dtype=cupy.uint64)
    kernel = _module().get_function(f"count_nonfinite<{_TYPES[width]}>")
    blocks = min(_blocks(bits.device.id), -(-n // (_THREADS * (16 // width))))
    kernel(
        (blocks,),
        (_THREADS,),
        (bits, cupy.int64(n), mask, cupy.int32(bits.data.ptr % 16 == 0), count),
    )
    return int(count.get()[0])
