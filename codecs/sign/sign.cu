extern "C" {

/* p >= 0 on the bits: sign clear, or -0.0 (NaN never reaches here). */
__device__ __forceinline__ bool sign_up(float p) {
    unsigned int u = __float_as_uint(p);
    return (u >> 31) == 0u || u == 0x80000000u;
}

/* residual + g in float32, an overflow clamped to +-FLOAT32_MAX (finite inputs: an infinite
   sum is an overflow). */
__device__ __forceinline__ float sign_sum(float r, float g) {
    float p = ieee_add(r, g);
    unsigned int u = __float_as_uint(p);
    if ((u & 0x7fffffffu) == 0x7f800000u) p = __uint_as_float((u & 0x80000000u) | 0x7f7fffffu);
    return p;
}

/* float64 to float32, rounded to nearest, a subnormal result kept. */
__device__ __forceinline__ float sign_narrow(double x) {
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(x));
    return f;
}

/* float32(total / count), +0.0 when count is 0 (count: an exact integer in float64). */
__device__ __forceinline__ float sign_mean(double total, double count) {
    return count > 0.0 ? sign_narrow(__ddiv_rn(total, count)) : 0.0f;
}

/* One warp per block: partials[b] = sum over p >= 0, partials[nblocks + b] = sum over p < 0,
   partials[2 nblocks + b] = count of p >= 0. */
__global__ void sign_split_partials(const float* __restrict__ grad,
                                    const float* __restrict__ residual,
                                    double* __restrict__ partials, const long long n,
                                    const long long nblocks) {
    long long block = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (block >= nblocks) return;  /* whole warps: blockDim is a multiple of 32 */
    unsigned int lane = threadIdx.x & 31u;
    long long start = block * SIGN_SUM_BLOCK;
    long long stop = min(n, start + SIGN_SUM_BLOCK);
    double pos = 0.0, neg = 0.0;
    unsigned int count = 0u;
#pragma unroll 8
    for (long long i = start + lane; i < stop; i += 32) {
        float p = sign_sum(residual[i], grad[i]);
        double wide = ieee_widen(p);
        bool up = sign_up(p);
        pos = __dadd_rn(pos, up ? wide : 0.0);
        neg = __dadd_rn(neg, up ? 0.0 : wide);
        count += up ? 1u : 0u;
    }
    pos = quant_combine_lanes(pos);
    neg = quant_combine_lanes(neg);
    for (int offset = 16; offset > 0; offset >>= 1) {
        count += __shfl_xor_sync(0xffffffffu, count, offset);
    }
    if (lane == 0u) {
        partials[block] = pos;
        partials[nblocks + block] = neg;
        partials[2 * nblocks + block] = (double)count;
    }
}

/* One warp per block: partials[b] = sum of abs(p). */
__global__ void sign_abs_partials(const float* __restrict__ grad,
                                  const float* __restrict__ residual,
                                  double* __restrict__ partials, const long long n,
                                  const long long nblocks) {
    long long block = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (block >= nblocks) return;
    unsigned int lane = threadIdx.x & 31u;
    long long start = block * SIGN_SUM_BLOCK;
    long long stop = min(n, start + SIGN_SUM_BLOCK);
    double acc = 0.0;
#pragma unroll 8
    for (long long i = start + lane; i < stop; i += 32) {
        float p = sign_sum(residual[i], grad[i]);
        acc = __dadd_rn(acc, fabs(ieee_widen(p)));  /* |.| in float64: exact, never flushed */
    }
    acc = quant_combine_lanes(acc);
    if (lane == 0u) partials[block] = acc;
}

/* One block: 1bit's scales [a, b]. */
__global__ void sign_split_scales(const double* __restrict__ partials, const long long nblocks,
                                  const long long n, float* __restrict__ scales) {
    const double* rows[3] = {partials, partials + nblocks, partials + 2 * nblocks};
    double sums[3];  /* over p >= 0, over p < 0, the count of p >= 0 */
    quant_lane_sums_block<3>(rows, nblocks, sums);
    if (threadIdx.x == 0) {
        scales[0] = sign_mean(sums[0], sums[2]);
        scales[1] = sign_mean(sums[1], (double)n - sums[2]);
    }
}

/* One block: efsign's scale [s]. */
__global__ void sign_abs_scales(const double* __restrict__ partials, const long long nblocks,
                                const long long n, float* __restrict__ scales) {
    const double* rows[1] = {partials};
    double total[1];
    quant_lane_sums_block<1>(rows, nblocks, total);
    if (threadIdx.x == 0) scales[0] = sign_mean(total[0], (double)n);
}

/* The residual of one element; returns its code bit. */
__device__ __forceinline__ unsigned int sign_apply_one(float r, float g, float hi, float lo,
                                                       float* kept) {
    float p = sign_sum(r, g);
    bool up = sign_up(p);
    *kept = ieee_sub(p, up ? hi : lo);
    return up ? 1u : 0u;
}

/* One thread per code byte: elements 8j .. 8j+7. */
__global__ void sign_apply(const float* __restrict__ grad, float* __restrict__ residual,
                           unsigned char* __restrict__ codes, const float* __restrict__ scales,
                           const int symmetric, const long long n, const long long nbytes,
                           const int aligned) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= nbytes) return;
    float hi = scales[0];
    float lo = symmetric ? __uint_as_float(__float_as_uint(hi) ^ 0x80000000u) : scales[1];
    long long i = 8 * j;
    unsigned int byte = 0u;
    if (aligned && i + 8 <= n) {
        const float4* g4 = reinterpret_cast<const float4*>(grad) + 2 * j;
        float4* r4 = reinterpret_cast<float4*>(residual) + 2 * j;
        float4 ga = g4[0], gb = g4[1];
        float4 ra = r4[0], rb = r4[1];
        byte |= sign_apply_one(ra.x, ga.x, hi, lo, &ra.x);
        byte |= sign_apply_one(ra.y, ga.y, hi, lo, &ra.y) << 1;
        byte |= sign_apply_one(ra.z, ga.z, hi, lo, &ra.z) << 2;
        byte |= sign_apply_one(ra.w, ga.w, hi, lo, &ra.w) << 3;
        byte |= sign_apply_one(rb.x, gb.x, hi, lo, &rb.x) << 4;
        byte |= sign_apply_one(rb.y, gb.y, hi, lo, &rb.y) << 5;
        byte |= sign_apply_one(rb.z, gb.z, hi, lo, &rb.z) << 6;
        byte |= sign_apply_one(rb.w, gb.w, hi, lo, &rb.w) << 7;
        r4[0] = ra;
        r4[1] = rb;
    } else {
        for (int e = 0; e < 8 && i + e < n; ++e) {
            float kept;
            byte |= sign_apply_one(residual[i + e], grad[i + e], hi, lo, &kept) << e;
            residual[i + e] = kept;
        }
    }
    codes[j] = (unsigned char)byte;
}

}
