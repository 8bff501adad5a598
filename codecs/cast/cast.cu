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

/* The 16-bit pattern of float32 bits x, without error feedback: an element that rounds past
   the range becomes infinity and raises *overflow to its magnitude bits. */
__device__ __forceinline__ unsigned short cast_encode_one(unsigned int x, int bf16,
                                                          unsigned int* overflow) {
    unsigned int magnitude = cast_magnitude(x, bf16);
    unsigned int infinity = bf16 ? 0x7f80u : 0x7c00u;
    if (magnitude >= infinity) {
        magnitude = infinity;
        atomicMax(overflow, x & 0x7fffffffu);
    }
    return (unsigned short)(((x >> 16) & 0x8000u) | magnitude);
}

/* The 16-bit pattern of residual + value (an overflowed sum saturated, the code clamped to
   the largest finite half); *residual becomes what the pattern does not carry. */
__device__ __forceinline__ unsigned short cast_feedback_one(float value, float* residual,
                                                            int bf16) {
    unsigned int x = __float_as_uint(ieee_add(*residual, value));
    if ((x & 0x7fffffffu) > 0x7f7fffffu) {  /* the sum overflowed: the largest finite float */
        x = (x & 0x80000000u) | 0x7f7fffffu;
    }
    unsigned int largest = bf16 ? 0x7f7fu : 0x7bffu;
    unsigned int h = ((x >> 16) & 0x8000u) | min(cast_magnitude(x, bf16), largest);
    *residual = ieee_sub(__uint_as_float(x), cast_widen(h, bf16));
    return (unsigned short)h;
}

/* Each kernel gives a thread four elements: one float4 (and one ushort4 of codes) when the
   arrays are aligned for it (`aligned`), else, and for the last partial group, one by one. */

/* overflow: the two report slots; this push raises overflow[slot] (zeroed by the push
   before) and zeroes the other one for the next push, so no launch clears it. */
__global__ void cast_encode(const float* __restrict__ values, unsigned short* __restrict__ out,
                            const long long n, const int bf16, unsigned int* __restrict__ reports,
                            const int slot, const int aligned) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t == 0) reports[1 - slot] = 0u;
    unsigned int* overflow = reports + slot;
    long long i = 4 * t;
    if (i >= n) return;
    if (aligned && i + 4 <= n) {
        float4 v = reinterpret_cast<const float4*>(values)[t];
        ushort4 h;
        h.x = cast_encode_one(__float_as_uint(v.x), bf16, overflow);
        h.y = cast_encode_one(__float_as_uint(v.y), bf16, overflow);
        h.z = cast_encode_one(__float_as_uint(v.z), bf16, overflow);
        h.w = cast_encode_one(__float_as_uint(v.w), bf16, overflow);
        reinterpret_cast<ushort4*>(out)[t] = h;
        return;
    }
    for (long long k = i; k < n && k < i + 4; ++k) {
        out[k] = cast_encode_one(__float_as_uint(values[k]), bf16, overflow);
    }
}

__global__ void cast_encode_feedback(const float* __restrict__ values,
                                     float* __restrict__ residual,
                                     unsigned short* __restrict__ out, const long long n,
                                     const int bf16, const int aligned) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = 4 * t;
    if (i >= n) return;
    if (aligned && i + 4 <= n) {
        float4 v = reinterpret_cast<const float4*>(values)[t];
        float4 r = reinterpret_cast<float4*>(residual)[t];
        ushort4 h;
        h.x = cast_feedback_one(v.x, &r.x, bf16);
        h.y = cast_feedback_one(v.y, &r.y, bf16);
        h.z = cast_feedback_one(v.z, &r.z, bf16);
        h.w = cast_feedback_one(v.w, &r.w, bf16);
        reinterpret_cast<float4*>(residual)[t] = r;
        reinterpret_cast<ushort4*>(out)[t] = h;
        return;
    }
    for (long long k = i; k < n && k < i + 4; ++k) {
        float r = residual[k];
        out[k] = cast_feedback_one(values[k], &r, bf16);
        residual[k] = r;
    }
}

__device__ __forceinline__ float cast_decode_one(unsigned int h, float old, int bf16,
                                                 int accumulate) {
    float v = cast_widen(h, bf16);
    return accumulate ? ieee_add(old, v) : v;
}

__global__ void cast_decode(const unsigned short* __restrict__ codes, float* __restrict__ out,
                            const long long n, const int bf16, const int accumulate,
                            const int aligned) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = 4 * t;
    if (i >= n) return;
    if (aligned && i + 4 <= n) {
        ushort4 h = reinterpret_cast<const ushort4*>(codes)[t];
        float4 o = accumulate ? reinterpret_cast<const float4*>(out)[t] : make_float4(0, 0, 0, 0);
        o.x = cast_decode_one(h.x, o.x, bf16, accumulate);
        o.y = cast_decode_one(h.y, o.y, bf16, accumulate);
        o.z = cast_decode_one(h.z, o.z, bf16, accumulate);
        o.w = cast_decode_one(h.w, o.w, bf16, accumulate);
        reinterpret_cast<float4*>(out)[t] = o;
        return;
    }
    for (long long k = i; k < n && k < i + 4; ++k) {
        out[k] = cast_decode_one(codes[k], accumulate ? out[k] : 0.0f, bf16, accumulate);
    }
}

/* The largest magnitude bits of x[0..n) into *largest (which starts at 0): a grid-stride
   maximum, warp by warp (the order of a maximum changes nothing). */
__global__ void cast_largest_magnitude(const unsigned int* __restrict__ x, const long long n,
                                       const int aligned, unsigned int* __restrict__ largest) {
    const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned int top = 0u;
    long long tail = 0;
    if (aligned) {
        const long long vectors = n / 4;
        for (long long j = thread; j < vectors; j += stride) {
            uint4 w = reinterpret_cast<const uint4*>(x)[j];
            top = max(top, max(max(w.x & 0x7fffffffu, w.y & 0x7fffffffu),
                               max(w.z & 0x7fffffffu, w.w & 0x7fffffffu)));
        }
        tail = vectors * 4;
    }
    for (long long i = tail + thread; i < n; i += stride) top = max(top, x[i] & 0x7fffffffu);
    for (int offset = 16; offset > 0; offset >>= 1) {
        top = max(top, __shfl_xor_sync(0xffffffffu, top, offset));
    }
    if ((threadIdx.x & 31) == 0 && top) atomicMax(largest, top);
}

}
