// tandem's CUDA kernels, compiled at run time with NVRTC (no nvcc at build time).
//
// Conventions: the residual stream and every intermediate that kernels combine are f32;
// inputs of cuBLAS products are bf16; the paged KV cache is bf16, laid out
// [layer][block][K|V][kv_head][slot][head_dim] with 16 slots per block.

// bf16 is handled as raw 16-bit patterns, so the source needs no CUDA headers at all (NVRTC
// then works from any libnvrtc, whatever include folders the machine has).
typedef unsigned short bf16;

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((unsigned int)x) << 16); }

// Round to nearest even, as f2bf does; NaN stays NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#define BLOCK_SLOTS 16
#define NEG_INF (__int_as_float(0xff800000))

extern "C" __global__ void embed_rows(const bf16* __restrict__ table, const unsigned int* __restrict__ tokens,
                                      float* __restrict__ out, int rows, int hidden) {
    int t = blockIdx.x;
    if (t >= rows) return;
    const bf16* src = table + (size_t)tokens[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[(size_t)t * hidden + i] = bf2f(src[i]);
    }
}

// One block per row: out = bf16(x * rsqrt(mean(x^2) + eps) * w).
extern "C" __global__ void rms_norm_bf16(const float* __restrict__ x, const float* __restrict__ w,
                                         bf16* __restrict__ out, int rows, int hidden, float eps) {
    int t = blockIdx.x;
    if (t >= rows) return;
    const float* row = x + (size_t)t * hidden;
    __shared__ float partial[32];
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += row[i] * row[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float v = lane < (blockDim.x + 31) / 32 ? partial[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    float scale = rsqrtf(partial[0] / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[(size_t)t * hidden + i] = f2bf(row[i] * scale * w[i]);
    }
}

// Rotate-half RoPE on the Q and K parts of fused QKV rows, in place.
// One block per token; threads walk (head, pair).
extern "C" __global__ void rope_qk(float* __restrict__ qkv, const int* __restrict__ positions,
                                   const float* __restrict__ inv_freq, int rows, int row_width,
                                   int q_heads, int kv_heads, int head_dim) {
    int t = blockIdx.x;
    if (t >= rows) return;
    int half = head_dim / 2;
    float pos = (float)positions[t];
    int heads = q_heads + kv_heads;
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        int h = idx / half, i = idx % half;
        float* base = qkv + (size_t)t * row_width + h * head_dim;
        float angle = pos * inv_freq[i];
        float c = cosf(angle), s = sinf(angle);
        float x1 = base[i], x2 = base[i + half];
        base[i] = x1 * c - x2 * s;
        base[i + half] = x2 * c + x1 * s;
    }
}

// Writes each token's K and V (from fused QKV rows) into its slot of the paged cache.
extern "C" __global__ void kv_write(const float* __restrict__ qkv, const int* __restrict__ positions,
                                    const int* __restrict__ token_seq, const int* __restrict__ block_tables,
                                    int max_blocks, bf16* __restrict__ cache, long long layer_offset,
                                    int rows, int row_width, int q_width, int kv_heads, int head_dim) {
    int t = blockIdx.x;
    if (t >= rows) return;
    int pos = positions[t];
    int block = block_tables[token_seq[t] * max_blocks + pos / BLOCK_SLOTS];
    int slot = pos % BLOCK_SLOTS;
    size_t part = (size_t)kv_heads * BLOCK_SLOTS * head_dim;
    bf16* blk = cache + layer_offset + (size_t)block * 2 * part;
    const float* k = qkv + (size_t)t * row_width + q_width;
    const float* v = k + kv_heads * head_dim;
    for (int idx = threadIdx.x; idx < kv_heads * head_dim; idx += blockDim.x) {
        int h = idx / head_dim, d = idx % head_dim;
        size_t off = ((size_t)h * BLOCK_SLOTS + slot) * head_dim + d;
        blk[off] = f2bf(k[idx]);
        blk[part + off] = f2bf(v[idx]);
    }
}

// Paged attention, one warp per (token, query head), online softmax over the token's causal
// keys read block by block from the cache. Lanes split the head dimension (head_dim <= 256).
extern "C" __global__ void paged_attention(const float* __restrict__ qkv, const int* __restrict__ positions,
                                           const int* __restrict__ token_seq, const int* __restrict__ block_tables,
                                           int max_blocks, const bf16* __restrict__ cache,
                                           long long layer_offset, bf16* __restrict__ out,
                                           int rows, int row_width, int q_heads, int kv_heads, int head_dim,
                                           float scale) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= rows * q_heads) return;
    int t = warp / q_heads, h = warp % q_heads;
    int g = h / (q_heads / kv_heads);
    int pos = positions[t];
    const int* table = block_tables + token_seq[t] * max_blocks;
    const float* q = qkv + (size_t)t * row_width + h * head_dim;
    const int per_lane = (head_dim + 31) / 32;
    float qv[8], acc[8];
    for (int j = 0; j < per_lane; j++) {
        int d = lane + 32 * j;
        qv[j] = d < head_dim ? q[d] * scale : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    size_t part = (size_t)kv_heads * BLOCK_SLOTS * head_dim;
    for (int key = 0; key <= pos; key++) {
        int block = table[key / BLOCK_SLOTS];
        const bf16* kb = cache + layer_offset + (size_t)block * 2 * part +
                                  ((size_t)g * BLOCK_SLOTS + key % BLOCK_SLOTS) * head_dim;
        float s = 0.f;
        for (int j = 0; j < per_lane; j++) {
            int d = lane + 32 * j;
            if (d < head_dim) s += qv[j] * bf2f(kb[d]);
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        float m_new = fmaxf(m, s);
        float corr = __expf(m - m_new);
        float p = __expf(s - m_new);
        l = l * corr + p;
        const bf16* vb = kb + part;
        for (int j = 0; j < per_lane; j++) {
            int d = lane + 32 * j;
            float vv = d < head_dim ? bf2f(vb[d]) : 0.f;
            acc[j] = acc[j] * corr + p * vv;
        }
        m = m_new;
    }
    bf16* o = out + (size_t)t * q_heads * head_dim + h * head_dim;
    float inv = 1.f / l;
    for (int j = 0; j < per_lane; j++) {
        int d = lane + 32 * j;
        if (d < head_dim) o[d] = f2bf(acc[j] * inv);
    }
}

// out = bf16(silu(gate) * up) from fused [gate(f) | up(f)] rows.
extern "C" __global__ void silu_mul_bf16(const float* __restrict__ gate_up, bf16* __restrict__ out,
                                         int rows, int f) {
    size_t n = (size_t)rows * f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / f, c = i % f;
        float g = gate_up[r * 2 * f + c];
        float u = gate_up[r * 2 * f + f + c];
        out[i] = f2bf(g / (1.f + __expf(-g)) * u);
    }
}

extern "C" __global__ void add_in_place(float* __restrict__ x, const float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// Copies selected rows of x (f32) into a dense f32 buffer.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const int* __restrict__ rows_idx,
                                       float* __restrict__ out, int count, int width) {
    int r = blockIdx.x;
    if (r >= count) return;
    const float* src = x + (size_t)rows_idx[r] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[(size_t)r * width + i] = src[i];
}

// Seeded uniform values in [-amp, amp] (dummy weights of shapes too big to build on the host).
extern "C" __global__ void fill_uniform_bf16(bf16* __restrict__ out, long long n,
                                             unsigned long long seed, float amp) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float unit = (float)(z >> 40) / (float)(1ull << 24);
        out[i] = f2bf((unit * 2.f - 1.f) * amp);
    }
}

// Host staging of the paged cache, one launch per layer instead of a copy per block: one CUDA
// block per listed cache block, copying its K and V (`block_elems` bf16, an even count) as
// 32-bit words between the cache and a dense buffer of the listed blocks in list order.
extern "C" __global__ void gather_kv_blocks(const bf16* __restrict__ cache, long long layer_offset,
                                            const int* __restrict__ blocks, int count, int block_elems,
                                            bf16* __restrict__ out) {
    int i = blockIdx.x;
    if (i >= count) return;
    const unsigned int* src = (const unsigned int*)(cache + layer_offset + (size_t)blocks[i] * block_elems);
    unsigned int* dst = (unsigned int*)(out + (size_t)i * block_elems);
    for (int w = threadIdx.x; w < block_elems / 2; w += blockDim.x) dst[w] = src[w];
}

extern "C" __global__ void scatter_kv_blocks(const bf16* __restrict__ staged, const int* __restrict__ blocks,
                                             int count, int block_elems, bf16* __restrict__ cache,
                                             long long layer_offset) {
    int i = blockIdx.x;
    if (i >= count) return;
    const unsigned int* src = (const unsigned int*)(staged + (size_t)i * block_elems);
    unsigned int* dst = (unsigned int*)(cache + layer_offset + (size_t)blocks[i] * block_elems);
    for (int w = threadIdx.x; w < block_elems / 2; w += blockDim.x) dst[w] = src[w];
}
