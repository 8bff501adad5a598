/* IEEE float32 add, subtract and multiply, rounded to nearest, subnormals kept. */
__device__ __forceinline__ float ieee_add(float a, float b) {
    float d;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ float ieee_sub(float a, float b) {
    float d;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ float ieee_mul(float a, float b) {
    float d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

/* float32 to float64, exactly (a subnormal too). */
__device__ __forceinline__ double ieee_widen(float a) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(a));
    return d;
}

/* |x| by its bits (fabsf would flush a subnormal under -ftz=true). */
__device__ __forceinline__ unsigned int magnitude_key(float x) {
    return __float_as_uint(x) & 0x7fffffffu;
}
