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

// Rotate-half RoPE on the Q and K parts of fused QKV rows, in place, and each token's
// rotated K and its V (bf16) into its slot of the paged cache: one launch where there were
// two, and K is rounded and stored straight from the rotation. Each block takes one token and
// `heads_per_block` of its Q and K heads (block b: token b / groups, group b % groups), so a
// decode step of a few tokens still spreads over many SMs while prefill keeps one block per
// token; the block computes each frequency's cosine and sine once into shared memory, then
// its threads rotate (head, pair) items.
extern "C" __global__ void rope_kv_write(float* __restrict__ qkv, const int* __restrict__ positions,
                                         const float* __restrict__ inv_freq, const int* __restrict__ token_seq,
                                         const int* __restrict__ block_tables, int max_blocks,
                                         bf16* __restrict__ cache, long long layer_offset, int rows,
                                         int row_width, int q_heads, int kv_heads, int head_dim,
                                         int heads_per_block) {
    __shared__ float cos_s[128], sin_s[128];
    int heads = q_heads + kv_heads;
    int groups = (heads + heads_per_block - 1) / heads_per_block;
    int t = blockIdx.x / groups;
    if (t >= rows) return;
    int h0 = (blockIdx.x % groups) * heads_per_block;
    int h1 = min(h0 + heads_per_block, heads);
    int half = head_dim / 2;
    int pos = positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float angle = (float)pos * inv_freq[i];
        cos_s[i] = cosf(angle);
        sin_s[i] = sinf(angle);
    }
    __syncthreads();
    float* row = qkv + (size_t)t * row_width;
    const float* v = row + (size_t)(q_heads + kv_heads) * head_dim;
    int block = block_tables[token_seq[t] * max_blocks + pos / BLOCK_SLOTS];
    int slot = pos % BLOCK_SLOTS;
    size_t part = (size_t)kv_heads * BLOCK_SLOTS * head_dim;
    bf16* blk = cache + layer_offset + (size_t)block * 2 * part;
    for (int idx = threadIdx.x; idx < (h1 - h0) * half; idx += blockDim.x) {
        int h = h0 + idx / half, i = idx % half;
        float c = cos_s[i], s = sin_s[i];
        // Q heads then K heads sit one after the other in the row.
        float* base = row + (size_t)h * head_dim;
        float x1 = base[i], x2 = base[i + half];
        float r1 = x1 * c - x2 * s, r2 = x2 * c + x1 * s;
        // K stays rotated in the row too: the rows stay what RoPE makes them, whoever reads them.
        base[i] = r1;
        base[i + half] = r2;
        if (h >= q_heads) {
            bf16* dst = blk + ((size_t)(h - q_heads) * BLOCK_SLOTS + slot) * head_dim;
            dst[i] = f2bf(r1);
            dst[i + half] = f2bf(r2);
        }
    }
    // V of the K heads this block took.
    int k0 = max(h0, q_heads) - q_heads, k1 = h1 - q_heads;
    for (int idx = k0 * head_dim + threadIdx.x; idx < k1 * head_dim; idx += blockDim.x) {
        int h = idx / head_dim, d = idx % head_dim;
        blk[part + ((size_t)h * BLOCK_SLOTS + slot) * head_dim + d] = f2bf(v[idx]);
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

// ---- Tensor-core attention (sm_80 and later) ----
//
// One CUDA block of 4 warps per (query tile, KV head, context split). A tile is up to 64 / G
// consecutive tokens of one sequence (G query heads per KV head): its 64 query rows, token-major
// (row r is token r / G, query head r % G of the group), share every K/V block the CUDA block
// reads, so each KV head's cache is read once per tile instead of once per query head and
// token. Each warp owns 16 rows. Scores and the weighted sum of V run as bf16 mma.sync
// m16n8k16 products with f32 accumulators (the FlashAttention-2 scheme: online softmax per row,
// P kept in registers as the A operand of the second product). Decode tiles (one token) split
// the context instead, so a batch of few sequences still fills the GPU; attention_combine then
// merges the splits' partial results.

// A 16x8 += 16x16 (row-major, bf16) x 16x8 (column-major, bf16) product of one warp, f32
// accumulators, in mma.sync's fragment layout: lane = 4 * group + t holds a = A[group][2t..2t+1],
// A[group+8][2t..], A[group][2t+8..], A[group+8][2t+8..]; b = B[2t..2t+1][group], B[2t+8..][group];
// c = C[group][2t..2t+1], C[group+8][2t..2t+1] (the lower index in the lower 16 bits). The
// CUDA-on-CPU harness supplies its own (tests/cuda_on_cpu/emu.h).
#ifndef CUDA_ON_CPU
__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned int* a, const unsigned int* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // the host launches these kernels only on sm_80 and later
#endif
}
#endif

__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
    return (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
}

struct alignas(16) words4 {
    unsigned int x, y, z, w;
};

#define ATTN_THREADS 128
#define ATTN_ROWS 64
#define ATTN_KEYS 64

template <int D>
__device__ __forceinline__ void flash_tile(const float* __restrict__ qkv, const int* __restrict__ positions,
                                           const int* __restrict__ token_seq, const int* __restrict__ block_tables,
                                           int max_blocks, const bf16* __restrict__ cache, long long layer_offset,
                                           const int* __restrict__ tiles, int splits, int keys_per_split,
                                           bf16* __restrict__ out, float* __restrict__ partial, int row_width,
                                           int q_heads, int kv_heads, float scale, bf16* sk, bf16* sv) {
    // sk, sv: K and V of ATTN_KEYS keys in shared memory, rows padded by 16 bytes so that a
    // warp's fragment loads (8 rows x 4 words) fall in 32 different banks.
    constexpr int STRIDE = D + 8;
    int b = blockIdx.x;
    int split = b % splits;
    b /= splits;
    int g = b % kv_heads, tile = b / kv_heads;
    int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    int group = q_heads / kv_heads;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int quad = lane >> 2, t = lane & 3;
    int active = count * group;  // rows in use
    int r0 = warp * 16 + quad, r1 = r0 + 8;
    int pos0 = r0 < active ? positions[first + r0 / group] : -1;
    int pos1 = r1 < active ? positions[first + r1 / group] : -1;
    const int* table = block_tables + token_seq[first] * max_blocks;
    int key_end = positions[first + count - 1] + 1;
    int k_begin = split * keys_per_split;
    int k_stop = key_end < k_begin + keys_per_split ? key_end : k_begin + keys_per_split;
    size_t part = (size_t)kv_heads * BLOCK_SLOTS * D;

    // This warp's 16 query rows as A fragments, scaled, in bf16.
    unsigned int qa[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = (i & 1) ? r1 : r0;
            int col = ks * 16 + 2 * t + ((i & 2) ? 8 : 0);
            float lo = 0.f, hi = 0.f;
            if (r < active) {
                const float* q = qkv + (size_t)(first + r / group) * row_width + (g * group + r % group) * D;
                lo = q[col] * scale;
                hi = q[col + 1] * scale;
            }
            qa[ks][i] = pack_bf16(lo, hi);
        }
    }
    float o[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    bool warp_busy = warp * 16 < active;

    for (int kt = k_begin; kt < k_stop; kt += ATTN_KEYS) {
        __syncthreads();  // every warp is done with the previous tile
        // 16-byte loads of ATTN_KEYS keys' K and V (whole cache blocks: k_begin is a multiple
        // of 64), zeros past the keys this split reads.
        constexpr int PER_BLOCK = BLOCK_SLOTS * D / 8;  // 16-byte words of one block's K (or V)
        constexpr int LOADS = (ATTN_KEYS / BLOCK_SLOTS) * 2 * PER_BLOCK / ATTN_THREADS;
        // Unrolled so that several independent 16-byte loads are in flight per thread.
#pragma unroll 4
        for (int n = 0; n < LOADS; n++) {
            int v = threadIdx.x + n * ATTN_THREADS;
            int j = v / (2 * PER_BLOCK), rem = v % (2 * PER_BLOCK);
            int is_v = rem / PER_BLOCK, w = rem % PER_BLOCK;
            int slot = w / (D / 8), d = (w % (D / 8)) * 8;
            int key = kt + j * BLOCK_SLOTS + slot;
            words4 val = {0u, 0u, 0u, 0u};
            if (key < k_stop) {
                int block = table[key / BLOCK_SLOTS];
                const bf16* src = cache + layer_offset + (size_t)block * 2 * part + is_v * part +
                                  ((size_t)g * BLOCK_SLOTS + slot) * D + d;
                val = *(const words4*)src;
            }
            bf16* dst = (is_v ? sv : sk) + (key - kt) * STRIDE + d;
            *(words4*)dst = val;
        }
        __syncthreads();
        if (!warp_busy) continue;
        // S = Q K^T for 64 keys: 8 tiles of 8 keys.
        float s[ATTN_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < ATTN_KEYS / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
                const bf16* kr = sk + (nt * 8 + quad) * STRIDE + ks * 16 + 2 * t;
                unsigned int kb[2] = {*(const unsigned int*)kr, *(const unsigned int*)(kr + 8)};
                mma_bf16_16816(s[nt], qa[ks], kb);
            }
        }
        // Causal and range masks, then the online softmax per row (a row's 64 scores are
        // spread over the 4 lanes of its quad).
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < ATTN_KEYS / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = kt + nt * 8 + 2 * t + (e & 1);
                int pos = e < 2 ? pos0 : pos1;
                if (key >= k_stop || key > pos) s[nt][e] = NEG_INF;
            }
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
        float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        // A row with no key yet keeps -inf: exponentials against 0 give 0, never NaN.
        float base0 = n0 == NEG_INF ? 0.f : n0, base1 = n1 == NEG_INF ? 0.f : n1;
        float c0 = __expf(m0 - base0), c1 = __expf(m1 - base1);
        m0 = n0;
        m1 = n1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            o[dt][0] *= c0;
            o[dt][1] *= c0;
            o[dt][2] *= c1;
            o[dt][3] *= c1;
        }
#pragma unroll
        for (int nt = 0; nt < ATTN_KEYS / 8; nt++) {
            s[nt][0] = __expf(s[nt][0] - base0);
            s[nt][1] = __expf(s[nt][1] - base0);
            s[nt][2] = __expf(s[nt][2] - base1);
            s[nt][3] = __expf(s[nt][3] - base1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }
        // O += P V: P's accumulators are already the A fragments of 16-key steps.
#pragma unroll
        for (int j = 0; j < ATTN_KEYS / 16; j++) {
            unsigned int pa[4] = {pack_bf16(s[2 * j][0], s[2 * j][1]), pack_bf16(s[2 * j][2], s[2 * j][3]),
                                  pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]),
                                  pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3])};
            const bf16* v0 = sv + (j * 16 + 2 * t) * STRIDE + quad;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                const bf16* v = v0 + dt * 8;
                unsigned int vb[2] = {(unsigned int)v[0] | ((unsigned int)v[STRIDE] << 16),
                                      (unsigned int)v[8 * STRIDE] | ((unsigned int)v[9 * STRIDE] << 16)};
                mma_bf16_16816(o[dt], pa, vb);
            }
        }
    }
    // Each lane summed its own columns: the row sums are the quad's.
    l0 += __shfl_xor_sync(0xffffffff, l0, 1);
    l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1);
    l1 += __shfl_xor_sync(0xffffffff, l1, 2);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int r = half ? r1 : r0;
        if (r >= active) continue;
        int token = first + r / group, head = g * group + r % group;
        float m = half ? m1 : m0, l = half ? l1 : l0;
        if (splits == 1) {
            bf16* dst = out + ((size_t)token * q_heads + head) * D + 2 * t;
            float inv = 1.f / l;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                dst[dt * 8] = f2bf(o[dt][2 * half] * inv);
                dst[dt * 8 + 1] = f2bf(o[dt][2 * half + 1] * inv);
            }
        } else {
            // Unnormalised sums against this split's max, then the max and the sum of weights.
            float* dst = partial + (((size_t)token * q_heads + head) * splits + split) * (D + 2);
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                dst[dt * 8 + 2 * t] = o[dt][2 * half];
                dst[dt * 8 + 2 * t + 1] = o[dt][2 * half + 1];
            }
            if (t == 0) {
                dst[D] = m;
                dst[D + 1] = l;
            }
        }
    }
}

// Grid: tiles x kv_heads x splits blocks of ATTN_THREADS (see above). `tiles` holds (first
// row, token count) pairs, at most ATTN_ROWS / G tokens of one sequence each, positions
// increasing; split s reads keys [s * keys_per_split, (s + 1) * keys_per_split), a multiple
// of ATTN_KEYS. With one split the output is written directly; otherwise `partial` gets each
// (token, query head, split)'s head_dim sums, max and weight sum for attention_combine.
// head_dim 64 or 128.
extern "C" __global__ void flash_attention(const float* __restrict__ qkv, const int* __restrict__ positions,
                                           const int* __restrict__ token_seq, const int* __restrict__ block_tables,
                                           int max_blocks, const bf16* __restrict__ cache, long long layer_offset,
                                           const int* __restrict__ tiles, int splits, int keys_per_split,
                                           bf16* __restrict__ out, float* __restrict__ partial, int row_width,
                                           int q_heads, int kv_heads, int head_dim, float scale) {
    // One shared buffer for both head sizes (one per instantiation would pass the 48 KiB of
    // static shared memory), as 16-byte words so that the tile loads' stores are aligned.
    __shared__ words4 sk_words[ATTN_KEYS * (128 + 8) / 8];
    __shared__ words4 sv_words[ATTN_KEYS * (128 + 8) / 8];
    bf16* sk = (bf16*)sk_words;
    bf16* sv = (bf16*)sv_words;
    if (head_dim == 128) {
        flash_tile<128>(qkv, positions, token_seq, block_tables, max_blocks, cache, layer_offset, tiles, splits,
                        keys_per_split, out, partial, row_width, q_heads, kv_heads, scale, sk, sv);
    } else if (head_dim == 64) {
        flash_tile<64>(qkv, positions, token_seq, block_tables, max_blocks, cache, layer_offset, tiles, splits,
                       keys_per_split, out, partial, row_width, q_heads, kv_heads, scale, sk, sv);
    }
}

// Merges flash_attention's context splits: one block per (token, query head), each split's
// sums weighted by exp(its max - the overall max).
extern "C" __global__ void attention_combine(const float* __restrict__ partial, bf16* __restrict__ out,
                                             int rows, int q_heads, int head_dim, int splits) {
    int rh = blockIdx.x;
    if (rh >= rows * q_heads) return;
    const float* p = partial + (size_t)rh * splits * (head_dim + 2);
    float m = NEG_INF;
    for (int s = 0; s < splits; s++) m = fmaxf(m, p[s * (head_dim + 2) + head_dim]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f, l = 0.f;
        for (int s = 0; s < splits; s++) {
            const float* ps = p + s * (head_dim + 2);
            float ms = ps[head_dim];
            if (ms == NEG_INF) continue;
            float w = __expf(ms - m);
            acc += w * ps[d];
            l += w * ps[head_dim + 1];
        }
        out[(size_t)rh * head_dim + d] = f2bf(acc / l);
    }
}

// out = bf16(silu(gate) * up) from fused [gate(f) | up(f)] rows.
extern "C" __global__ void silu_mul_bf16(const float* __restrict__ gate_up, bf16* __restrict__ out,
                                         int rows, int f) {
    size_t n = (size_t)rows * f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        // 32-bit division where the index fits (a 64-bit one is a long software sequence).
        size_t r, c;
        if (n <= 0xffffffffull) {
            unsigned int q = (unsigned int)i / (unsigned int)f;
            r = q;
            c = (unsigned int)i - q * (unsigned int)f;
        } else {
            r = i / f;
            c = i % f;
        }
        float g = gate_up[r * 2 * f + c];
        float u = gate_up[r * 2 * f + f + c];
        out[i] = f2bf(g / (1.f + __expf(-g)) * u);
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
