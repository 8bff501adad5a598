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
