/* The count sketch on the device: the same bits as kvstore.codecs.sketch.hashing.
   Hashes in 64-bit unsigned integers exactly as counter_rng.hash32; the sketch accumulated in
   int64 fixed point with integer atomics (two's complement addition is exact and commutes, so
   no order of the atomics can change a bit); every float conversion in explicit round-to-
   nearest instructions without .ftz (CuPy compiles with -ftz=true); float comparisons done on
   integer keys of the bits, so a subnormal never compares as zero.
   Needs MAX_ROWS defined, and the IEEE helpers before it. */

#define SKETCH_M32 0xFFFFFFFFull

extern "C" {

__device__ __forceinline__ unsigned long long sketch_hash32(unsigned long long x) {
    x ^= x >> 16;
    x = (x * 0x7FEB352Dull) & SKETCH_M32;
    x ^= x >> 15;
    x = (x * 0x846CA68Bull) & SKETCH_M32;
    return x ^ (x >> 16);
}

/* The 32-bit hash of element `index` (its index in the whole key) in row j. */
__device__ __forceinline__ unsigned long long sketch_element_hash(const unsigned int* keys,
                                                                  const int j,
                                                                  const unsigned long long index) {
    const unsigned long long lo = keys[2 * j];
    const unsigned long long hi = keys[2 * j + 1];
    return sketch_hash32((sketch_hash32(index ^ lo) + hi) & SKETCH_M32);
}

__device__ __forceinline__ long long sketch_bucket(const unsigned long long h,
                                                  const unsigned long long columns) {
    return (long long)(((h >> 1) * columns) >> 31);
}

/* float64 to float32, rounded to nearest even, subnormal results kept. */
__device__ __forceinline__ float sketch_narrow(double d) {
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(d));
    return f;
}

/* The bits of a float as an unsigned key that orders like the float (-0.0 just below +0.0). */
__device__ __forceinline__ unsigned int sketch_order_key(const unsigned int bits) {
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ unsigned int sketch_order_bits(const unsigned int key) {
    return (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
}

/* The largest magnitude key (float bits of |x|) into *peak. */
__global__ void sketch_peak(const float* __restrict__ x, const long long n,
                            unsigned int* __restrict__ peak) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned int mine = 0u;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        mine = max(mine, magnitude_key(x[i]));
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, offset));
    }
    if ((threadIdx.x & 31) == 0 && mine) atomicMax(peak, mine);
}

/* Adds element i's signed fixed-point value to its bucket in every row of `table`. */
__device__ __forceinline__ void sketch_add(unsigned long long* table, const float xi,
                                           const unsigned long long index,
                                           const unsigned int* keys, const int rows,
                                           const unsigned long long columns, const double scale) {
    if (magnitude_key(xi) == 0u) return;  // adds nothing
    const long long fixed = __double2ll_rn(__dmul_rn(ieee_widen(xi), scale));
    for (int j = 0; j < rows; ++j) {
        const unsigned long long h = sketch_element_hash(keys, j, index);
        const long long signed_fixed = (h & 1ull) ? -fixed : fixed;
        atomicAdd(table + (long long)j * columns + sketch_bucket(h, columns),
                  (unsigned long long)signed_fixed);
    }
}

/* The int64 sketch of x (elements start.. of their key) added into `table` (rows x columns).
   With `shared` set (a launch with rows * columns * 8 bytes of dynamic shared memory) each
   block sums into its own copy there and adds its nonzero entries to `table` at the end:
   a narrow table would otherwise serialize every block on the same global words. */
__global__ void sketch_scatter(const float* __restrict__ x, const long long n,
                               const unsigned int* __restrict__ keys, const int rows,
                               const long long columns, const unsigned long long start,
                               const double scale, const int shared,
                               unsigned long long* __restrict__ table) {
    extern __shared__ unsigned long long local[];  // rows * columns entries when shared
    const long long entries = (long long)rows * columns;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const unsigned long long wide_columns = (unsigned long long)columns;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (!shared) {
        for (long long i = first; i < n; i += stride) {
            sketch_add(table, x[i], start + (unsigned long long)i, keys, rows, wide_columns,
                       scale);
        }
        return;
    }
    for (long long e = threadIdx.x; e < entries; e += blockDim.x) local[e] = 0ull;
    __syncthreads();
    for (long long i = first; i < n; i += stride) {  // shared-memory atomics
        sketch_add(local, x[i], start + (unsigned long long)i, keys, rows, wide_columns, scale);
    }
    __syncthreads();
    for (long long e = threadIdx.x; e < entries; e += blockDim.x) {
        if (local[e]) atomicAdd(table + e, local[e]);
    }
}

/* out = float32(float64(table) * 2**-q), both conversions rounded to nearest even. */
__global__ void sketch_finish(const long long* __restrict__ table, const long long entries,
                              const double inverse, float* __restrict__ out) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= entries) return;
    out[e] = sketch_narrow(__dmul_rn(__ll2double_rn(table[e]), inverse));
}

/* The median of each element's signed row estimates; a zero median is +0.0. */
__global__ void sketch_estimates(const float* __restrict__ table, const int rows,
                                 const long long columns, const unsigned int* __restrict__ keys,
                                 const unsigned long long start, const long long count,
                                 float* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const unsigned long long index = start + (unsigned long long)i;
    const unsigned long long wide_columns = (unsigned long long)columns;
    unsigned int sorted[MAX_ROWS];
    for (int j = 0; j < rows; ++j) {
        const unsigned long long h = sketch_element_hash(keys, j, index);
        unsigned int bits = __float_as_uint(table[(long long)j * columns +
                                                  sketch_bucket(h, wide_columns)]);
        if (h & 1ull) bits ^= 0x80000000u;  // the sign flip, on the bits (exact, no .ftz)
        const unsigned int key = sketch_order_key(bits);
        int k = j;  // insertion sort: the rows so far stay in order
        while (k > 0 && sorted[k - 1] > key) {
            sorted[k] = sorted[k - 1];
            --k;
        }
        sorted[k] = key;
    }
    const unsigned int median = sketch_order_bits(sorted[rows / 2]);
    out[i] = __uint_as_float((median & 0x7fffffffu) ? median : 0u);
}

/* Zero, in every row, the bucket of each element at chunk-local index local[t]. */
__global__ void sketch_zero(float* __restrict__ table, const int rows, const long long columns,
                            const unsigned int* __restrict__ keys,
                            const unsigned long long start, const long long* __restrict__ local,
                            const long long count) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= count) return;
    const unsigned long long index = start + (unsigned long long)local[t];
    const unsigned long long wide_columns = (unsigned long long)columns;
    for (int j = 0; j < rows; ++j) {
        const unsigned long long h = sketch_element_hash(keys, j, index);
        table[(long long)j * columns + sketch_bucket(h, wide_columns)] = 0.0f;
    }
}

}  // extern "C"
