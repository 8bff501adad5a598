/* float64 to float32, rounded to nearest, subnormal results kept. */
__device__ __forceinline__ float psgd_narrow(double x) {
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(x));
    return f;
}

/* a * b + sum, float32 terms, in float64, uncontracted. */
__device__ __forceinline__ double psgd_term(double sum, float a, float b) {
    return __dadd_rn(sum, __dmul_rn(ieee_widen(a), ieee_widen(b)));
}

#define PSGD_TILE 32
#define PSGD_COLUMNS 8

extern "C" {

__global__ void psgd_accumulate(const float* __restrict__ grad, float* __restrict__ error,
                                const long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) error[i] = ieee_add(error[i], grad[i]);
}

__global__ void psgd_take_dense(const float* __restrict__ grad, float* __restrict__ error,
                                float* __restrict__ out, const long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = ieee_add(error[i], grad[i]);
        error[i] = 0.0f;
    }
}

/* out (rows x rank) = matrix (rows x cols) @ factor (cols x rank). Block (32, 8): thread
   (x, y) sums row blockIdx.x * 32 + x, factor column blockIdx.y * 8 + y. */
__global__ void psgd_project(const float* __restrict__ matrix, const float* __restrict__ factor,
                             float* __restrict__ out, const long long rows,
                             const long long cols, const int rank) {
    __shared__ float tile[PSGD_TILE][PSGD_TILE + 1];  /* +1: no bank conflicts down a column */
    __shared__ float weights[PSGD_TILE][PSGD_COLUMNS];
    const int x = threadIdx.x, y = threadIdx.y;
    const long long first_row = (long long)blockIdx.x * PSGD_TILE;
    const int k = blockIdx.y * PSGD_COLUMNS + y;
    const int flat = y * PSGD_TILE + x;  /* 256 threads load the 32 x 8 weights */
    const int weight_row = flat / PSGD_COLUMNS;
    const int weight_k = blockIdx.y * PSGD_COLUMNS + flat % PSGD_COLUMNS;
    double sum = 0.0;
    for (long long first_col = 0; first_col < cols; first_col += PSGD_TILE) {
        const long long left = cols - first_col;
        const int width = left < PSGD_TILE ? (int)left : PSGD_TILE;
        for (int t = y; t < PSGD_TILE; t += PSGD_COLUMNS) {
            const long long row = first_row + t;
            tile[t][x] = (row < rows && x < width) ? matrix[row * cols + first_col + x] : 0.0f;
        }
        weights[weight_row][flat % PSGD_COLUMNS] =
            (weight_row < width && weight_k < rank)
                ? factor[(first_col + weight_row) * rank + weight_k] : 0.0f;
        __syncthreads();
        for (int c = 0; c < width; ++c) sum = psgd_term(sum, tile[x][c], weights[c][y]);
        __syncthreads();
    }
    const long long row = first_row + x;
    if (row < rows && k < rank) out[row * rank + k] = psgd_narrow(sum);
}

/* out (cols x rank) = matrix^T @ p_hat (rows x rank): thread (j, k = blockIdx.y). */
__global__ void psgd_back_project(const float* __restrict__ matrix,
                                  const float* __restrict__ p_hat, float* __restrict__ out,
                                  const long long rows, const long long cols, const int rank) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int k = blockIdx.y;
    if (j >= cols) return;
    double sum = 0.0;
    for (long long i = 0; i < rows; ++i) {
        sum = psgd_term(sum, matrix[i * cols + j], p_hat[i * rank + k]);
    }
    out[j * rank + k] = psgd_narrow(sum);
}

/* matrix -= float32(p_hat @ q^T), element by element. */
__global__ void psgd_residual(float* __restrict__ matrix, const float* __restrict__ p_hat,
                              const float* __restrict__ q, const long long rows,
                              const long long cols, const int rank) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= rows * cols) return;
    const long long i = e / cols, j = e - i * cols;
    double sum = 0.0;
    for (int k = 0; k < rank; ++k) sum = psgd_term(sum, p_hat[i * rank + k], q[j * rank + k]);
    matrix[e] = ieee_sub(matrix[e], psgd_narrow(sum));
}

}
