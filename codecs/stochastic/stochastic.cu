/* float32 division and float64 -> float32, rounded to nearest, subnormals kept. */
__device__ __forceinline__ float stochastic_div(float a, float b) {
    float d;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ float stochastic_narrow(double a) {
    float d;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(d) : "d"(a));
    return d;
}

/* The largest of the 32 lanes' values, in every lane. */
__device__ __forceinline__ unsigned int stochastic_warp_max(unsigned int v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

extern "C" {

/* One warp per SUM_BLOCK block of g: lane sums of x and x*x (float64), largest |x| (bits). */
__global__ void terngrad_stats(const float* __restrict__ g, const long long n,
                               const int moments, double* __restrict__ sums,
                               double* __restrict__ squares, unsigned int* __restrict__ tops,
                               const long long nblocks) {
    long long b = (long long)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32;
    if (b >= nblocks) return;  /* b is the same in the whole warp */
    unsigned int lane = threadIdx.x & 31u;
    long long stop = min(n, (b + 1) * SUM_BLOCK);
    double s1 = 0.0, s2 = 0.0;
    unsigned int top = 0u;
    long long i = b * SUM_BLOCK + lane;
    for (; i < stop; i += 32 * 8) {  /* eight loads in flight, then the terms in order */
        float xs[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) xs[u] = i + 32 * u < stop ? g[i + 32 * u] : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            if (i + 32 * u >= stop) break;
            top = max(top, magnitude_key(xs[u]));
            if (moments) {
                double w = ieee_widen(xs[u]);
                s1 = __dadd_rn(s1, w);
                s2 = __dadd_rn(s2, __dmul_rn(w, w));
            }
        }
    }
    top = stochastic_warp_max(top);
    s1 = quant_combine_lanes(s1);
    s2 = quant_combine_lanes(s2);
    if (lane == 0) {
        sums[b] = s1;
        squares[b] = s2;
        tops[b] = top;
    }
}

/* One block: the chunk's scale s into scale[0] (see kvstore.codecs.terngrad). */
__global__ void terngrad_finish(const double* __restrict__ sums,
                                const double* __restrict__ squares,
                                const unsigned int* __restrict__ tops, const long long nblocks,
                                const long long n, const double clip, float* __restrict__ scale) {
    __shared__ unsigned int warp_tops[32];
    unsigned int top = 0u;
    for (long long i = threadIdx.x; i < nblocks; i += blockDim.x) top = max(top, tops[i]);
    top = stochastic_warp_max(top);
    if ((threadIdx.x & 31u) == 0) warp_tops[threadIdx.x >> 5] = top;
    const double* rows[2] = {sums, squares};
    double totals[2];
    quant_lane_sums_block<2>(rows, nblocks, totals);  /* synchronizes the block */
    if (threadIdx.x != 0) return;
    for (unsigned int w = 1; w < blockDim.x / 32; ++w) top = max(top, warp_tops[w]);
    const double s1 = totals[0], s2 = totals[1];
    if (clip > 0.0) {
        double count = (double)n;
        double mean = __ddiv_rn(s1, count);
        double var = __dsub_rn(__ddiv_rn(s2, count), __dmul_rn(mean, mean));
        var = var > 0.0 ? var : 0.0;
        float limit = stochastic_narrow(__dmul_rn(clip, __dsqrt_rn(var)));
        top = min(top, magnitude_key(limit));  /* magnitudes: bits order like the floats */
    }
    scale[0] = __uint_as_float(top);  /* 0 bits: +0.0 */
}

/* The 2-bit code of element i (value bits x_bits) against the scale s (bits s_bits != 0). */
__device__ __forceinline__ unsigned int terngrad_code(unsigned int x_bits, float s,
                                                      unsigned int s_bits, unsigned int lo,
                                                      unsigned int hi, unsigned long long i) {
    unsigned int clipped = min(x_bits & 0x7fffffffu, s_bits);
    float u = quant_uniform(lo, hi, i);
    if (__float_as_uint(ieee_mul(u, s)) < clipped) {  /* u * s >= +0.0 */
        return (x_bits >> 31) ? 2u : 1u;
    }
    return 0u;
}

/* One thread per four code bytes (elements 16t .. 16t+15): four float4 loads and one 32-bit
   store when g and out are aligned for them (`aligned`), else element by element and byte by
   byte. */
__global__ void terngrad_codes(const float* __restrict__ g, const long long n,
                               const float* __restrict__ scale, const unsigned int lo,
                               const unsigned int hi, const unsigned long long start,
                               unsigned char* __restrict__ out, const long long nbytes,
                               const int aligned) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long first = 16 * t;
    if (first >= n) return;
    float s = scale[0];
    unsigned int s_bits = __float_as_uint(s);
    unsigned int word = 0u;
    if (s_bits != 0u) {
        unsigned int xs[16];
        if (aligned && first + 16 <= n) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                float4 q = reinterpret_cast<const float4*>(g)[4 * t + v];
                xs[4 * v] = __float_as_uint(q.x);
                xs[4 * v + 1] = __float_as_uint(q.y);
                xs[4 * v + 2] = __float_as_uint(q.z);
                xs[4 * v + 3] = __float_as_uint(q.w);
            }
        } else {
#pragma unroll
            for (int e = 0; e < 16; ++e) xs[e] = first + e < n ? __float_as_uint(g[first + e]) : 0u;
        }
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            if (first + e < n) {
                word |= terngrad_code(xs[e], s, s_bits, lo, hi,
                                      start + (unsigned long long)(first + e)) << (2 * e);
            }
        }
    }
    if (aligned && 4 * t + 4 <= nbytes) {
        reinterpret_cast<unsigned int*>(out)[t] = word;
    } else {
        for (int b = 0; b < 4 && 4 * t + b < nbytes; ++b) {
            out[4 * t + b] = (unsigned char)(word >> (8 * b));
        }
    }
}

/* One warp per (bucket, SUM_BLOCK block of it): the lane sum of x*x (float64). */
__global__ void qsgd_partials(const float* __restrict__ v, const long long n,
                              const long long bucket, const long long nsub,
                              const long long nwork, double* __restrict__ partials) {
    long long w = (long long)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32;
    if (w >= nwork) return;
    unsigned int lane = threadIdx.x & 31u;
    long long q = w / nsub;
    long long first = q * bucket + (w % nsub) * SUM_BLOCK;
    long long stop = min(min(n, (q + 1) * bucket), first + SUM_BLOCK);
    double acc = 0.0;
    for (long long i = first + lane; i < stop; i += 32 * 8) {  /* eight loads in flight */
        float xs[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) xs[u] = i + 32 * u < stop ? v[i + 32 * u] : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            if (i + 32 * u >= stop) break;
            double x = ieee_widen(xs[u]);
            acc = __dadd_rn(acc, __dmul_rn(x, x));
        }
    }
    acc = quant_combine_lanes(acc);
    if (lane == 0) partials[w] = acc;
}

/* One warp per bucket: norm = float32(sqrt(lane sum of its partial sums)), inv = L / norm. */
__global__ void qsgd_norms(const double* __restrict__ partials, const long long nsub,
                           const long long nbuckets, const float levels,
                           float* __restrict__ norms, float* __restrict__ inverses) {
    long long q = (long long)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32;
    if (q >= nbuckets) return;
    /* A shorter last bucket has +0.0 partial sums past its end, which change no lane sum. */
    double total = nsub == 1 ? partials[q] : quant_lane_sum_warp(partials + q * nsub, nsub);
    if ((threadIdx.x & 31u) == 0) {
        float norm = stochastic_narrow(__dsqrt_rn(total));
        norms[q] = norm;
        inverses[q] = stochastic_div(levels, norm);
    }
}

/* One thread per group of eight codes (`width` bytes): two float4 loads when v is aligned
   (`aligned`); the bucket (and its norm) is found once per group and stepped at its end. */
__global__ void qsgd_codes(const float* __restrict__ v, const long long n,
                           const long long bucket, const float* __restrict__ norms,
                           const float* __restrict__ inverses, const int levels,
                           const unsigned int lo, const unsigned int hi,
                           const unsigned long long start, const int width,
                           unsigned char* __restrict__ out, const long long nbytes,
                           const long long ngroups, const int aligned) {
    long long group = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (group >= ngroups) return;
    const float top = (float)levels;
    const long long first = 8 * group;
    unsigned int xs[8];
    if (aligned && first + 8 <= n) {
        float4 a = reinterpret_cast<const float4*>(v)[2 * group];
        float4 b = reinterpret_cast<const float4*>(v)[2 * group + 1];
        xs[0] = __float_as_uint(a.x); xs[1] = __float_as_uint(a.y);
        xs[2] = __float_as_uint(a.z); xs[3] = __float_as_uint(a.w);
        xs[4] = __float_as_uint(b.x); xs[5] = __float_as_uint(b.y);
        xs[6] = __float_as_uint(b.z); xs[7] = __float_as_uint(b.w);
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) xs[k] = first + k < n ? __float_as_uint(v[first + k]) : 0u;
    }
    long long q = first / bucket;
    long long bucket_end = (q + 1) * bucket;
    float norm = norms[q];
    float inverse = inverses[q];
    unsigned long long word = 0ull;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        long long i = first + k;
        if (i >= n) break;
        if (i >= bucket_end) {  /* the next bucket (at most one step per element) */
            ++q;
            bucket_end += bucket;
            norm = norms[q];
            inverse = inverses[q];
        }
        unsigned int code = 0u;
        if (__float_as_uint(norm) != 0u) {
            unsigned int x_bits = xs[k];
            float x = ieee_mul(__uint_as_float(x_bits & 0x7fffffffu), inverse);
            float t = ieee_add(x, quant_uniform(lo, hi, start + (unsigned long long)i));
            /* min(floor(t), L); NaN (0 * inf) -> 0. t >= 1 here, so no subnormal is compared. */
            int level = t >= top ? levels : (t >= 1.0f ? (int)t : 0);
            code = ((unsigned int)level << 1) | ((level > 0 && (x_bits >> 31)) ? 1u : 0u);
        }
        word |= (unsigned long long)code << (k * width);
    }
    quant_store_group(out, group, word, width, nbytes);
}

}
