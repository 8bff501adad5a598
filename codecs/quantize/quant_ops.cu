/* kvstore.codecs.counter_rng.hash32 */
__device__ __forceinline__ unsigned int quant_hash32(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* The float32 uniform in [0, 1) of element i of the stream with key halves lo, hi. */
__device__ __forceinline__ float quant_uniform(unsigned int lo, unsigned int hi,
                                              unsigned long long i) {
    unsigned int h = quant_hash32(quant_hash32((unsigned int)i ^ lo) + hi);
    return ieee_mul((float)(h >> 8), 5.9604644775390625e-08f);  /* exact: 24 bits * 2**-24 */
}

/* Lane 0 + lane 1 + ... + lane 31 in order from +0.0; every thread of the (full) warp passes
   its lane's sum and gets the total. */
__device__ __forceinline__ double quant_combine_lanes(double lane_value) {
    double total = 0.0;
    for (int l = 0; l < 32; ++l) {
        total = __dadd_rn(total, __shfl_sync(0xffffffffu, lane_value, l));
    }
    return total;
}

/* The lane sum of v[0..n) computed by one full warp (every thread gets it). Each lane loads
   16 of its terms before adding them in order: one warp alone would otherwise wait for every
   load in turn (the sum of 100M elements' 24K block sums took 70 us). */
__device__ __forceinline__ double quant_lane_sum_warp(const double* v, long long n) {
    unsigned int lane = threadIdx.x & 31u;
    double acc = 0.0;
    long long i = lane;
    for (; i + 32 * 15 < n; i += 32 * 16) {
        double batch[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) batch[u] = v[i + 32 * u];
#pragma unroll
        for (int u = 0; u < 16; ++u) acc = __dadd_rn(acc, batch[u]);
    }
    for (; i < n; i += 32) {
        acc = __dadd_rn(acc, v[i]);
    }
    return quant_combine_lanes(acc);
}

/* The lane sums of K arrays of n terms each (out[k] = quant_lane_sum_warp(v[k], n), bit for
   bit), computed by a whole block (blockDim.x a multiple of 32,
   at most QUANT_STAGE): every thread stages QUANT_STAGE terms of each array into shared memory
   at a time (all their loads in flight together), then warp 0 adds them, lane l the terms
   l, l + 32, ... in order (QUANT_STAGE is a multiple of 32, so a term keeps its lane). One warp
   alone waited on memory for each batch it loaded: 0.2 ms for three arrays of 24K terms (100M
   elements) on an H200. The sums are returned in every thread of warp 0. */
#define QUANT_STAGE 1024
template <int K>
__device__ __forceinline__ void quant_lane_sums_block(const double* const (&v)[K], long long n,
                                                      double (&out)[K]) {
    __shared__ double stage[K][QUANT_STAGE];
    const unsigned int lane = threadIdx.x & 31u;
    double acc[K];
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = 0.0;
    for (long long base = 0; base < n; base += QUANT_STAGE) {
        const long long count = min((long long)QUANT_STAGE, n - base);
        for (long long t = threadIdx.x; t < count; t += blockDim.x) {
#pragma unroll
            for (int k = 0; k < K; ++k) stage[k][t] = v[k][base + t];
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            for (long long t = lane; t < count; t += 32) {
#pragma unroll
                for (int k = 0; k < K; ++k) acc[k] = __dadd_rn(acc[k], stage[k][t]);
            }
        }
        __syncthreads();
    }
    if (threadIdx.x < 32) {
#pragma unroll
        for (int k = 0; k < K; ++k) out[k] = quant_combine_lanes(acc[k]);
    }
}

/* Write group g (eight codes of `width` bits, code k at bit k*width of `word`) of a packed
   stream of nbytes bytes. */
__device__ __forceinline__ void quant_store_group(unsigned char* out, long long g,
                                                  unsigned long long word, int width,
                                                  long long nbytes) {
    long long base = g * width;
    for (int b = 0; b < width; ++b) {
        if (base + b < nbytes) out[base + b] = (unsigned char)(word >> (8 * b));
    }
}
