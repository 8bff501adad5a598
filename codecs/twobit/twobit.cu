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
