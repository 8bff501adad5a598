#define TILE_THREADS 256
#define TILE_ITEMS 8
#define TILE (TILE_THREADS * TILE_ITEMS)
#define WARPS (TILE_THREADS / 32)
#define WORDS_PER_TILE (TILE / 32)
#define BOUNDS_GIVEN 0
#define BOUNDS_SAMPLED 1
#define BOUNDS_EXACT 2

extern "C" {

/* The state update of one element held in registers (ai, bi: its state, gi: its gradient);
   returns the value selection reads (r, or DGC's v).
   kind 0: a = r, r += g.  kind 1: a = u, b = v, DGC's momentum correction. */
__device__ __forceinline__ float sparse_update_value(const int kind, float* ai, float* bi,
                                                     float gi, const float m, const float s,
                                                     const int nesterov) {
    if (kind == 0) {
        float x = ieee_add(*ai, gi);
        *ai = x;
        return x;
    }
    gi = ieee_mul(gi, s);
    float u, x;
    if (nesterov) {
        u = ieee_mul(m, ieee_add(*ai, gi));
        x = ieee_add(ieee_add(*bi, u), gi);
    } else {
        u = ieee_add(ieee_mul(m, *ai), gi);
        x = ieee_add(*bi, u);
    }
    *ai = u;
    *bi = x;
    return x;
}

/* The state update of element i in memory (sparse_update_value). */
__device__ __forceinline__ float sparse_update(const int kind, float* a, float* b,
                                               const float* g, const long long i,
                                               const float m, const float s, const int nesterov) {
    float ai = a[i];
    float bi = kind ? b[i] : 0.0f;
    float x = sparse_update_value(kind, &ai, &bi, g[i], m, s, nesterov);
    a[i] = ai;
    if (kind) b[i] = bi;
    return x;
}

__device__ __forceinline__ float sparse_peek(const int kind, const float* a, const float* b,
                                             const float* g, const long long i,
                                             const float m, const float s, const int nesterov) {
    if (kind == 0) {
        return ieee_add(a[i], g[i]);
    }
    float gi = ieee_mul(g[i], s);
    if (nesterov) {
        float u = ieee_mul(m, ieee_add(a[i], gi));
        return ieee_add(ieee_add(b[i], u), gi);
    }
    float u = ieee_add(ieee_mul(m, a[i]), gi);
    return ieee_add(b[i], u);
}

__global__ void sparse_sample(const int kind, const float* a, const float* b, const float* g,
                              const float m, const float s, const int nesterov,
                              const long long start, const long long stride,
                              const long long count, float* out) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    out[j] = __uint_as_float(magnitude_key(sparse_peek(kind, a, b, g, start + j * stride, m, s,
                                                       nesterov)));
}

__global__ void sparse_update_all(const int kind, float* a, float* b, const float* g,
                                  const float m, const float s, const int nesterov,
                                  const long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    sparse_update(kind, a, b, g, i, m, s, nesterov);
}

/* One tile per block: optionally update, then flag key >= lo ("above") and key == eq
   ("equal") into two bitmasks (bit i % 32 of word i / 32) and count both per tile. With
   `bounds` BOUNDS_SAMPLED or BOUNDS_EXACT, lo and eq come from the selected key T that
   sparse_pick left on the device (see those names). */
__global__ void sparse_flag(const int kind, float* a, float* b, const float* g,
                            const float m, const float s, const int nesterov,
                            const int update, const float* x, const long long n,
                            unsigned int lo, unsigned int eq, const int bounds,
                            const long long* selected_key,
                            unsigned int* above_mask, unsigned int* equal_mask,
                            long long* above_counts, long long* equal_counts) {
    __shared__ int warp_above[WARPS];
    __shared__ int warp_equal[WARPS];
    if (bounds == BOUNDS_SAMPLED) {  /* key >= T */
        lo = (unsigned int)selected_key[0];
    } else if (bounds == BOUNDS_EXACT) {  /* key > T and key == T */
        eq = (unsigned int)selected_key[0];
        lo = eq + 1u;
    }
    const long long tile = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    int mine_above = 0;
    int mine_equal = 0;
    /* Every load of the tile first (TILE_ITEMS elements per thread in flight; the stores
       below could alias them, so the compiler would not move a later load above them). */
    float va[TILE_ITEMS], vb[TILE_ITEMS], vg[TILE_ITEMS];
#pragma unroll
    for (int j = 0; j < TILE_ITEMS; ++j) {
        const long long i = tile * TILE + (long long)j * TILE_THREADS + threadIdx.x;
        va[j] = 0.0f;
        vb[j] = 0.0f;
        vg[j] = 0.0f;
        if (i < n) {
            if (update) {
                va[j] = a[i];
                vg[j] = g[i];
                if (kind) vb[j] = b[i];
            } else {
                va[j] = x[i];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < TILE_ITEMS; ++j) {
        const long long i = tile * TILE + (long long)j * TILE_THREADS + threadIdx.x;
        bool above = false;
        bool equal = false;
        if (i < n) {
            float v = va[j];
            if (update) {
                v = sparse_update_value(kind, &va[j], &vb[j], vg[j], m, s, nesterov);
                a[i] = va[j];
                if (kind) b[i] = vb[j];
            }
            unsigned int key = magnitude_key(v);
            above = key >= lo;
            equal = key == eq;
        }
        unsigned int word_above = __ballot_sync(0xffffffffu, above);
        unsigned int word_equal = __ballot_sync(0xffffffffu, equal);
        if (lane == 0) {
            const long long word = (tile * TILE + (long long)j * TILE_THREADS) / 32 + warp;
            above_mask[word] = word_above;
            equal_mask[word] = word_equal;
            mine_above += __popc(word_above);
            mine_equal += __popc(word_equal);
        }
    }
    if (lane == 0) {
        warp_above[warp] = mine_above;
        warp_equal[warp] = mine_equal;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        long long total_above = 0;
        long long total_equal = 0;
        for (int w = 0; w < WARPS; ++w) {
            total_above += warp_above[w];
            total_equal += warp_equal[w];
        }
        above_counts[tile] = total_above;
        equal_counts[tile] = total_equal;
    }
}

/* Take element i as the pos-th of the selection: values[pos] = x[i], then zero it (and
   other's); local[pos] = i - the start of its chunk (starts: the nchunks chunk starts,
   ascending, starts[0] == 0); with several chunks, cuts[c] = the least position taken in
   chunk c (an atomic minimum: the host fills in the chunks that took none). */
__device__ __forceinline__ void sparse_take_one(float* x, float* other, const int clear_other,
                                                const long long i, const long long pos,
                                                float* values, const long long* starts,
                                                const int nchunks, unsigned int* local,
                                                long long* cuts) {
    values[pos] = x[i];
    x[i] = 0.0f;
    if (clear_other) other[i] = 0.0f;
    int lo = 0, hi = nchunks;  /* the last chunk starting at or before i */
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (starts[mid] <= i) lo = mid; else hi = mid;
    }
    local[pos] = (unsigned int)(i - starts[lo]);
    if (nchunks > 1) atomicMin(&cuts[lo], pos);
}

/* One tile per block of WORDS_PER_TILE threads, one mask word each: take (sparse_take_one)
   every "above" element and the first `quota` "equal" ones, at its rank among the selected.
   counts and ends: the tiles' counts and their inclusive running sums, "above" then "equal"
   (two rows of `tiles`). */
__global__ void sparse_write(const unsigned int* above_mask, const unsigned int* equal_mask,
                             const long long* counts, const long long* ends,
                             const long long tiles, const long long quota, float* x,
                             float* other, const int clear_other, float* values,
                             const long long* starts, const int nchunks, unsigned int* local,
                             long long* cuts) {
    __shared__ int above_in_word[WORDS_PER_TILE];
    __shared__ int equal_in_word[WORDS_PER_TILE];
    const long long tile = blockIdx.x;
    const int w = threadIdx.x;
    const long long word = tile * WORDS_PER_TILE + w;
    const unsigned int word_above = above_mask[word];
    const unsigned int word_equal = equal_mask[word];
    above_in_word[w] = __popc(word_above);
    equal_in_word[w] = __popc(word_equal);
    __syncthreads();
    long long above_before = ends[tile] - counts[tile];  /* tiles before this one */
    long long equal_before = ends[tiles + tile] - counts[tiles + tile];
    for (int v = 0; v < w; ++v) {
        above_before += above_in_word[v];
        equal_before += equal_in_word[v];
    }
    unsigned int rest = word_above | word_equal;
    while (rest) {
        const int bit = __ffs(rest) - 1;
        const unsigned int below = (1u << bit) - 1u;
        const long long equals = equal_before + __popc(word_equal & below);
        const long long taken = equals < quota ? equals : quota;
        if (((word_above >> bit) & 1u) || equals < quota) {
            sparse_take_one(x, other, clear_other, word * 32 + bit,
                            above_before + __popc(word_above & below) + taken, values, starts,
                            nchunks, local, cuts);
        }
        rest &= rest - 1u;
    }
}

/* Histogram of one radix level over the keys of x whose bits above `above` equal the prefix
   found so far (selected_key[0]; none at the first level). Magnitudes crowd into few bins, so
   the lanes of a warp that share a bin add once. */
__global__ void sparse_histogram(const float* x, const long long n, const unsigned int above,
                                 const long long* selected_key, const int first,
                                 const unsigned int shift, const unsigned int mask,
                                 unsigned long long* hist) {
    __shared__ unsigned int counts[2048];
    const unsigned int prefix = first ? 0u : (unsigned int)selected_key[0];
    for (int b = threadIdx.x; b < 2048; b += blockDim.x) counts[b] = 0u;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long base = (long long)blockIdx.x * blockDim.x; base < n; base += step) {
        const long long i = base + threadIdx.x;  /* every lane runs every iteration */
        unsigned int bin = 0xffffffffu;
        if (i < n) {
            unsigned int key = magnitude_key(x[i]);
            if ((key >> above) == prefix) bin = (key >> shift) & mask;
        }
        const unsigned int peers = __match_any_sync(0xffffffffu, bin);
        if (bin != 0xffffffffu && __ffs(peers) - 1 == lane) {
            atomicAdd(&counts[bin], (unsigned int)__popc(peers));
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 2048; b += blockDim.x) {
        if (counts[b]) atomicAdd(&hist[b], (unsigned long long)counts[b]);
    }
}

/* One block of PICK_THREADS threads after each histogram level: the bin (counted from the top)
   that holds the need-th largest key, found by a scan of the bins from the top, is appended to
   the prefix, and need becomes its rank within that bin: selected_key = [prefix, need] (at the
   first level, need starts at k). The same choice as the host's cumulative-sum search. */
#define PICK_THREADS 256
#define PICK_RUN 8  /* bins per thread: PICK_THREADS * PICK_RUN >= 2048 */
__global__ void sparse_pick(const unsigned long long* hist, const int nbins, const int bits,
                            long long* selected_key, const int first, const long long k) {
    __shared__ unsigned long long sums[PICK_THREADS];
    const int t = threadIdx.x;
    const unsigned long long need = first ? (unsigned long long)k
                                          : (unsigned long long)selected_key[1];
    const unsigned long long prefix = first ? 0ull : (unsigned long long)selected_key[0];
    unsigned long long run[PICK_RUN];
    unsigned long long mine = 0ull;
#pragma unroll
    for (int u = 0; u < PICK_RUN; ++u) {
        const int from_top = PICK_RUN * t + u;
        run[u] = from_top < nbins ? hist[nbins - 1 - from_top] : 0ull;
        mine += run[u];
    }
    sums[t] = mine;
    __syncthreads();
    for (int offset = 1; offset < PICK_THREADS; offset <<= 1) {  /* inclusive scan */
        const unsigned long long add = t >= offset ? sums[t - offset] : 0ull;
        __syncthreads();
        sums[t] += add;
        __syncthreads();
    }
    unsigned long long below = t ? sums[t - 1] : 0ull;
    if (below < need && need <= sums[t]) {  /* the crossing is in this thread's run */
        for (int u = 0; u < PICK_RUN; ++u) {
            if (below + run[u] >= need) {
                const unsigned long long bin = (unsigned long long)(nbins - 1 - (PICK_RUN * t + u));
                selected_key[0] = (long long)((prefix << bits) | bin);
                selected_key[1] = (long long)(need - below);
                break;
            }
            below += run[u];
        }
    }
}

/* sparse_take_one of idx[j] as the j-th (idx: ascending global indices). */
__global__ void sparse_take(float* x, float* other, const int clear_other,
                            const long long* idx, const long long count, float* values,
                            const long long* starts, const int nchunks, unsigned int* local,
                            long long* cuts) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    sparse_take_one(x, other, clear_other, idx[j], j, values, starts, nchunks, local, cuts);
}

__device__ __forceinline__ unsigned int sparse_hash32(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* out[j] = the image of j under the keyed permutation of [0, n) (Feistel, 4 rounds on
   2 * half bits, cycle walking). */
__global__ void sparse_permute(const unsigned long long n, const long long k,
                               const unsigned int half, const unsigned int k0,
                               const unsigned int k1, const unsigned int k2,
                               const unsigned int k3, long long* out) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= k) return;
    const unsigned int keys[4] = {k0, k1, k2, k3};
    const unsigned long long mask = (1ull << half) - 1ull;
    unsigned long long y = (unsigned long long)j;
    do {
        unsigned long long left = y >> half;
        unsigned long long right = y & mask;
        for (int r = 0; r < 4; ++r) {
            unsigned int mixed = sparse_hash32((unsigned int)(right ^ keys[r]));
            unsigned long long next = left ^ (mixed & mask);
            left = right;
            right = next;
        }
        y = (left << half) | right;
    } while (y >= n);
    out[j] = (long long)y;
}

/* Per block of `block` elements, the float64 sum of squares in element order. */
__global__ void sparse_block_sumsq(const float* g, const long long n, const long long block,
                                   const long long nblocks, double* out) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    long long stop = (b + 1) * block < n ? (b + 1) * block : n;
    double partial = 0.0;
    for (long long i = b * block; i < stop; ++i) {
        double v = ieee_widen(g[i]);
        partial += v * v;
    }
    out[b] = partial;
}

/* x[idx[j]] = bits[j], copied as integers so that no float operation (and no flush of a
   subnormal) touches them: topk2bit's quantization errors written back into the residual. */
__global__ void sparse_assign(unsigned int* x, const long long* idx, const unsigned int* bits,
                              const long long count) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    x[idx[j]] = bits[j];
}

/* out[idx[j]] += values[j] (indices unique: a relayed push). */
__global__ void sparse_scatter_add(float* out, const unsigned int* idx, const float* values,
                                   const long long count) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    out[idx[j]] = ieee_add(out[idx[j]], values[j]);
}

}
