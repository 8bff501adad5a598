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
