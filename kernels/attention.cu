// Causal attention over the paged KV cache (bf16), flash style: K and V are
// read tile by tile into shared memory, with an online softmax, so each key is
// read once per block.
//
// A work item is a run of query tokens of one sequence: {seq, q_row, n_q, q_pos}
// (query tokens q_row .. q_row + n_q - 1 of the batch, at positions q_pos ..).
// Query token i sees keys 0 ..= q_pos + i of its sequence, which live in pages
// tables[seq * max_blocks + key / block_size], slot key % block_size.
//
// Grid: (item, KV head, split). A block takes the query heads that share its KV
// head (GQA) for every query token of its item. Decode launches (one query
// token per item, `attention_decode_*`) split the keys across blocks
// (flash-decoding) and `attention_combine` merges the splits; prefill launches
// (`attention_prefill_*`: R = n_q * group rows, at most MAXR, K and V tiles in
// shared memory) use items of several query tokens and one split.
//
// Scores are computed on CUDA cores in f32; tensor-core tiles are the next step
// (BENCHMARKS.md says what this costs in prefill).

template <int HD, int MAXR, int NT, int KT>
__device__ __forceinline__ void attention_tile_loop(
    const bf16* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const int* __restrict__ tables, int max_blocks, int block_size, const int* __restrict__ items,
    int n_heads, int n_kv_heads, float scale, int n_splits, const int* __restrict__ keys_per_split_at,
    bf16* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* qs = (float*)smem_raw;                 // MAXR x HD, pre-scaled
    float* ps = qs + MAXR * HD;                   // MAXR x KT scores, then probabilities
    float* row_m = ps + MAXR * KT;                // running max
    float* row_l = row_m + MAXR;                  // running sum
    float* row_scale = row_l + MAXR;              // this tile's rescale of the accumulators
    bf16* ks = (bf16*)(row_scale + MAXR);         // KT x (HD + 2): padded, conflict-free rows
    bf16* vs = ks + KT * (HD + 2);                // KT x HD

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int* item = items + 4 * blockIdx.x;
    const int seq = item[0], q_row = item[1], n_q = item[2], q_pos = item[3];
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int rows = n_q * group;
    const int q_dim = n_heads * HD, kv_dim = n_kv_heads * HD;
    const int kv_len = q_pos + n_q;
    const int keys_per_split = *keys_per_split_at;
    const int k_begin = split * keys_per_split;
    const int k_end = min(kv_len, k_begin + keys_per_split);
    const int* table = tables + (u64)seq * max_blocks;

    for (int i = tid; i < rows * HD; i += NT) {
        const int r = i / HD, d = i % HD;
        const int head = kvh * group + r % group;
        qs[i] = bf16_to_f32(q[(u64)(q_row + r / group) * q_dim + head * HD + d]) * scale;
    }
    for (int r = tid; r < MAXR; r += NT) {
        row_m[r] = NEG_INF;
        row_l[r] = 0.0f;
    }
    constexpr int PER_THREAD = MAXR * HD / NT;
    float acc[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; j++) acc[j] = 0.0f;
    __syncthreads();

    for (int k0 = k_begin; k0 < k_end; k0 += KT) {
        // K and V of keys k0 .. k0 + KT, 16 bytes per load.
        constexpr int CHUNKS = HD / 8;
        for (int c = tid; c < KT * CHUNKS; c += NT) {
            const int kk = c / CHUNKS, part = c % CHUNKS, key = k0 + kk;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (key < k_end) {
                const u64 slot = (u64)table[key / block_size] * block_size + key % block_size;
                const u64 at = slot * kv_dim + kvh * HD;
                kv4 = ((const uint4*)(k_cache + at))[part];
                vv4 = ((const uint4*)(v_cache + at))[part];
            }
            u32* kd = (u32*)(ks + kk * (HD + 2)) + part * 4;
            kd[0] = kv4.x; kd[1] = kv4.y; kd[2] = kv4.z; kd[3] = kv4.w;
            ((uint4*)(vs + kk * HD))[part] = vv4;
        }
        __syncthreads();

        for (int i = tid; i < rows * KT; i += NT) {
            const int r = i / KT, kk = i % KT, key = k0 + kk;
            float s = NEG_INF;
            if (key < k_end && key <= q_pos + r / group) {
                const float* qr = qs + r * HD;
                const u32* kr = (const u32*)(ks + kk * (HD + 2));
                float a = 0.0f;
#pragma unroll 8
                for (int w = 0; w < HD / 2; w++) {
                    const u32 kw = kr[w];
                    a = fmaf(qr[2 * w], bf16_lo(kw), a);
                    a = fmaf(qr[2 * w + 1], bf16_hi(kw), a);
                }
                s = a;
            }
            ps[i] = s;
        }
        __syncthreads();

        for (int r = warp; r < rows; r += NT / 32) {
            float* pr = ps + r * KT;
            float mx = NEG_INF;
            for (int kk = lane; kk < KT; kk += 32) mx = fmaxf(mx, pr[kk]);
            mx = warp_max(mx);
            const float m_old = row_m[r], m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int kk = lane; kk < KT; kk += 32) {
                const float s = pr[kk];
                const float p = s == NEG_INF ? 0.0f : expf(s - m_new);
                pr[kk] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float rescale = m_old == NEG_INF ? 0.0f : expf(m_old - m_new);
                row_scale[r] = rescale;
                row_l[r] = row_l[r] * rescale + sum;
                row_m[r] = m_new;
            }
        }
        __syncthreads();

#pragma unroll
        for (int j = 0; j < PER_THREAD; j++) {
            const int o = tid + j * NT, r = o / HD, d = o % HD;
            if (r < rows) {
                const float* pr = ps + r * KT;
                float a = acc[j] * row_scale[r];
                for (int kk = 0; kk < KT; kk++) a = fmaf(pr[kk], bf16_to_f32(vs[kk * HD + d]), a);
                acc[j] = a;
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int j = 0; j < PER_THREAD; j++) {
        const int o = tid + j * NT, r = o / HD, d = o % HD;
        if (r < rows) {
            const u64 token = q_row + r / group;
            const int head = kvh * group + r % group;
            if (n_splits == 1) {
                const float l = row_l[r];
                out[token * q_dim + head * HD + d] = f32_to_bf16(l > 0.0f ? acc[j] / l : 0.0f);
            } else {
                const u64 at = (token * n_heads + head) * n_splits + split;
                part_acc[at * HD + d] = acc[j];
                if (d == 0) {
                    part_ml[2 * at] = row_m[r];
                    part_ml[2 * at + 1] = row_l[r];
                }
            }
        }
    }
}

// Shared memory of one block, in bytes (the host computes the same).
#define ATTN_SMEM(HD, MAXR, KT) ((MAXR) * (HD) * 4 + (MAXR) * (KT) * 4 + 3 * (MAXR) * 4 + (KT) * ((HD) + 2) * 2 + (KT) * (HD) * 2)

#define ATTN_ARGS                                                                                          \
    const bf16 *__restrict__ q, const bf16 *__restrict__ k_cache, const bf16 *__restrict__ v_cache,       \
        const int *__restrict__ tables, int max_blocks, int block_size, const int *__restrict__ items,     \
        int n_heads, int n_kv_heads, float scale, int n_splits, const int *__restrict__ keys_per_split_at,      \
        bf16 *__restrict__ out, \
        float *__restrict__ part_acc, float *__restrict__ part_ml
#define ATTN_PASS q, k_cache, v_cache, tables, max_blocks, block_size, items, n_heads, n_kv_heads, scale, \
                  n_splits, keys_per_split_at, out, part_acc, part_ml

// The end of a decode block: its warps' (m, l, acc) of each of the group's
// heads, in shared memory, merged in warp order, then written as the output
// (one split) or as this split's partials for attention_combine.
template <int HD, int G, int WARPS>
__device__ __forceinline__ void decode_merge_warps(const float (*sm_m)[G], const float (*sm_l)[G],
                                                   const float (*sm_acc)[G][HD], int group, int q_row, int kvh,
                                                   int split, int n_heads, int n_splits, bf16* __restrict__ out,
                                                   float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const int q_dim = n_heads * HD;
    for (int i = threadIdx.x; i < group * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        float mx = NEG_INF;
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, sm_m[w][g]);
        float lsum = 0.0f, a = 0.0f;
        if (mx != NEG_INF) {
            for (int w = 0; w < WARPS; w++) {
                if (sm_m[w][g] == NEG_INF) continue;
                const float f = expf(sm_m[w][g] - mx);
                lsum += sm_l[w][g] * f;
                a += sm_acc[w][g][d] * f;
            }
        }
        const int head = kvh * group + g;
        if (n_splits == 1) {
            out[(u64)q_row * q_dim + head * HD + d] = f32_to_bf16(lsum > 0.0f ? a / lsum : 0.0f);
        } else {
            const u64 at = ((u64)q_row * n_heads + head) * n_splits + split;
            part_acc[at * HD + d] = a;
            if (d == 0) {
                part_ml[2 * at] = mx;
                part_ml[2 * at + 1] = lsum;
            }
        }
    }
}

// Decode: one query token per item. Each warp takes tiles of 32 keys, one key
// per lane: a lane reads its key's whole K row (16-byte loads) and scores it
// against the group's query heads (from shared memory), the tile's softmax is
// two warp reductions per head, then the lanes switch roles for P.V: lane l
// owns dims [l * D, (l + 1) * D) of every head, loads them from all the
// tile's V rows at once (coalesced) and walks them, taking each key's
// probability by shuffle. No barriers inside
// the loop; the block's 4 warps are merged through shared memory at the end.
// G: query heads per KV head, at most.
// A lane's dims of one V row, raw: 2 BF16 (one word) or 4 (two).
template <int D> struct VWordOf { using T = u32; };
template <> struct VWordOf<4> { using T = uint2; };

template <int HD, int G>
__device__ __forceinline__ void attention_decode_tiles(ATTN_ARGS) {
    constexpr int D = HD / 32;  // 2 or 4 output dims a lane
    constexpr int WARPS = 4;
    __shared__ __align__(16) float sm_q[G][HD];
    __shared__ float sm_m[WARPS][G], sm_l[WARPS][G];
    __shared__ float sm_acc[WARPS][G][HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int* item = items + 4 * blockIdx.x;
    const int seq = item[0], q_row = item[1], q_pos = item[3];
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int q_dim = n_heads * HD, kv_dim = n_kv_heads * HD;
    const int keys_per_split = *keys_per_split_at;
    const int k_begin = split * keys_per_split;
    const int k_end = min(q_pos + 1, k_begin + keys_per_split);
    const int* table = tables + (u64)seq * max_blocks;

    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        sm_q[g][d] = g < group ? bf16_to_f32(q[(u64)q_row * q_dim + (kvh * group + g) * HD + d]) * scale : 0.0f;
    }
    __syncthreads();

    float acc[G][D], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int d = 0; d < D; d++) acc[g][d] = 0.0f;
    }
    for (int k0 = k_begin + warp * 32; k0 < k_end; k0 += WARPS * 32) {
        const int key = k0 + lane;
        const bool valid = key < k_end;
        u64 row = 0;
        if (valid) row = ((u64)table[key / block_size] * block_size + key % block_size) * kv_dim + kvh * HD;
        // Scores: this lane's key against every head.
        float s[G];
#pragma unroll
        for (int g = 0; g < G; g++) s[g] = 0.0f;
        if (valid) {
            // The whole K row first (HD / 8 loads in flight), then the sums.
            uint4 krow[HD / 8];
#pragma unroll
            for (int c = 0; c < HD / 8; c++) krow[c] = ((const uint4*)(k_cache + row))[c];
#pragma unroll
            for (int c = 0; c < HD / 8; c++) {
                const uint4 kw = krow[c];
                const float k8[8] = {bf16_lo(kw.x), bf16_hi(kw.x), bf16_lo(kw.y), bf16_hi(kw.y),
                                     bf16_lo(kw.z), bf16_hi(kw.z), bf16_lo(kw.w), bf16_hi(kw.w)};
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const float4 qa = *(const float4*)&sm_q[g][c * 8];
                    const float4 qb = *(const float4*)&sm_q[g][c * 8 + 4];
                    s[g] += qa.x * k8[0] + qa.y * k8[1] + qa.z * k8[2] + qa.w * k8[3] +
                            qb.x * k8[4] + qb.y * k8[5] + qb.z * k8[6] + qb.w * k8[7];
                }
            }
        }
        // The tile's softmax, per head; p[g] is this lane's key's weight.
        float p[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float tile_max = warp_max(valid ? s[g] : NEG_INF);
            const float m_new = fmaxf(m[g], tile_max);
            const float corr = expf(m[g] - m_new);  // 0 while m[g] is -inf
            p[g] = valid ? expf(s[g] - m_new) : 0.0f;
            l[g] = l[g] * corr + warp_sum(p[g]);
            m[g] = m_new;
#pragma unroll
            for (int d = 0; d < D; d++) acc[g][d] *= corr;
        }
        // P.V: the tile's V rows, all loaded (raw BF16, this lane's dims of
        // each) before any is used, so one memory latency a tile instead of
        // one per few rows; then this lane adds its dims of each row, taking
        // the key's weight by shuffle.
        const int n_keys = min(32, k_end - k0);
        using VWord = typename VWordOf<D>::T;
        VWord vraw[32];
#pragma unroll
        for (int u = 0; u < 32; u++) {
            const u64 vrow = __shfl_sync(0xffffffffu, row, u);
            if (u < n_keys) {
                vraw[u] = *(const VWord*)(v_cache + vrow + lane * D);
            } else {
                vraw[u] = VWord{};
            }
        }
#pragma unroll
        for (int u = 0; u < 32; u++) {
            float v[D];
            if constexpr (D == 4) {
                v[0] = bf16_lo(vraw[u].x); v[1] = bf16_hi(vraw[u].x); v[2] = bf16_lo(vraw[u].y); v[3] = bf16_hi(vraw[u].y);
            } else {
                v[0] = bf16_lo(vraw[u]); v[1] = bf16_hi(vraw[u]);
            }
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float pj = __shfl_sync(0xffffffffu, p[g], u);
#pragma unroll
                for (int d = 0; d < D; d++) acc[g][d] = fmaf(pj, v[d], acc[g][d]);
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int d = 0; d < D; d++) sm_acc[warp][g][lane * D + d] = acc[g][d];
    __syncthreads();
    decode_merge_warps<HD, G, WARPS>(sm_m, sm_l, sm_acc, group, q_row, kvh, split, n_heads, n_splits, out, part_acc,
                                     part_ml);
}

extern "C" __global__ void __launch_bounds__(128) attention_decode_hd64_g4(ATTN_ARGS) {
    attention_decode_tiles<64, 4>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(128) attention_decode_hd64_g8(ATTN_ARGS) {
    attention_decode_tiles<64, 8>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(128) attention_decode_hd128_g4(ATTN_ARGS) {
    attention_decode_tiles<128, 4>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(128) attention_decode_hd128_g8(ATTN_ARGS) {
    attention_decode_tiles<128, 8>(ATTN_PASS);
}
// Decode on the tensor cores (mma.sync m16n8k16, BF16 in, f32 out): the
// same work items, splits and partials as attention_decode_tiles, for groups
// of at most 8 query heads (rows 0-7 of the MMA; 8-15 are zeros). Each warp
// takes 16 keys at a time. Q.K: lane (g, t) loads query head g's dims
// t * HD/4 .. + HD/4 once and, for keys n0 + g and n0 + 8 + g, the same
// dims of their K rows (16-byte loads); as the dot product does not care in
// which order dims are summed, MMA k-step ks pairs the A columns {2t, 2t + 1}
// and {2t + 8, 2t + 9} with dims t * HD/4 + 4ks + {0, 1} and {2, 3} on both
// sides. The scores come out as rows (heads) x keys, each row on the four
// lanes of a quad: its softmax takes two shuffles, and the probabilities,
// rounded to BF16, are the A fragment of P.V as they lie. V: the same lanes
// load the same dims of the two keys' V rows; each 32-bit word is a column
// pair of an 8 keys x 8 dims matrix (keys down, lane t's dims across), which
// movmatrix transposes into the B fragment. The dims of such a matrix are
// t * HD/4 + 8j + 2w + {0, 1} for its t, so the output columns {2t, 2t + 1}
// land on lane t's own dims. Per 16 keys a lane issues 2 * HD/8 MMAs where
// the CUDA-core kernel above issued ~800 dependent FMAs and shuffles (what
// bound it at batch 1, BENCHMARKS.md).
template <int HD>
__device__ __forceinline__ void attention_decode_mma(ATTN_ARGS) {
    constexpr int WARPS = 4, G = 8;
    constexpr int DL = HD / 4;   // dims a quad position covers
    constexpr int KS = HD / 16;  // k-steps of Q.K
    constexpr int VJ = DL / 8;   // 16-byte words of a row a lane loads
    __shared__ float sm_m[WARPS][G], sm_l[WARPS][G];
    __shared__ float sm_acc[WARPS][G][HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int* item = items + 4 * blockIdx.x;
    const int seq = item[0], q_row = item[1], q_pos = item[3];
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int q_dim = n_heads * HD, kv_dim = n_kv_heads * HD;
    const int keys_per_split = *keys_per_split_at;
    const int k_begin = split * keys_per_split;
    const int k_end = min(q_pos + 1, k_begin + keys_per_split);
    const int* table = tables + (u64)seq * max_blocks;

    // Query head g's dims t * DL .., as KS pairs of words (a0, a2).
    u32 qa[2 * KS];
    {
        const uint4* qrow = (const uint4*)(q + (u64)q_row * q_dim + (kvh * group + g) * HD + t * DL);
#pragma unroll
        for (int c = 0; c < VJ; c++) {
            const uint4 v = g < group ? qrow[c] : make_uint4(0, 0, 0, 0);
            qa[4 * c] = v.x;
            qa[4 * c + 1] = v.y;
            qa[4 * c + 2] = v.z;
            qa[4 * c + 3] = v.w;
        }
    }
    float o[VJ][4][4];
#pragma unroll
    for (int j = 0; j < VJ; j++)
#pragma unroll
        for (int w = 0; w < 4; w++) o[j][w][0] = o[j][w][1] = o[j][w][2] = o[j][w][3] = 0.0f;
    float m = NEG_INF, l = 0.0f;

    for (int n0 = k_begin + 16 * warp; n0 < k_end; n0 += 16 * WARPS) {
        // This lane's two keys (n0 + g, n0 + 8 + g): K and V, all loads at once.
        uint4 kw[2][VJ], vw[2][VJ];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int key = n0 + 8 * h + g;
            if (key < k_end) {
                const u64 row = ((u64)table[key / block_size] * block_size + key % block_size) * kv_dim + kvh * HD + t * DL;
#pragma unroll
                for (int c = 0; c < VJ; c++) {
                    kw[h][c] = ((const uint4*)(k_cache + row))[c];
                    vw[h][c] = ((const uint4*)(v_cache + row))[c];
                }
            } else {
#pragma unroll
                for (int c = 0; c < VJ; c++) kw[h][c] = vw[h][c] = make_uint4(0, 0, 0, 0);
            }
        }
        // Scores: rows = heads, columns = keys n0 + 8h + {2t, 2t + 1}.
        float sc[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sc[h][0] = sc[h][1] = sc[h][2] = sc[h][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                const uint4 k4 = kw[h][ks >> 1];
                const u32 b0 = (ks & 1) ? k4.z : k4.x, b1 = (ks & 1) ? k4.w : k4.y;
                mma_bf16_16816(sc[h], qa[2 * ks], 0u, qa[2 * ks + 1], 0u, b0, b1);
            }
        }
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int key = n0 + 8 * (i >> 1) + 2 * t + (i & 1);
            s[i] = key < k_end ? sc[i >> 1][i & 1] * scale : NEG_INF;
        }
        float mx = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m, mx);
        // All keys so far masked (m_new = -inf): nothing to add, nothing to rescale.
        const float corr = m_new == NEG_INF ? 1.0f : expf(m - m_new);
        float p[4], ps = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            p[i] = m_new == NEG_INF ? 0.0f : expf(s[i] - m_new);
            ps += p[i];
        }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        l = l * corr + ps;
        m = m_new;
        // P as the A fragment: columns {2t, 2t + 1} are keys n0 + 2t + {0, 1},
        // {2t + 8, 2t + 9} keys n0 + 8 + 2t + {0, 1}.
        const u32 pa0 = (u32)f32_to_bf16(p[0]) | ((u32)f32_to_bf16(p[1]) << 16);
        const u32 pa2 = (u32)f32_to_bf16(p[2]) | ((u32)f32_to_bf16(p[3]) << 16);
#pragma unroll
        for (int j = 0; j < VJ; j++)
#pragma unroll
            for (int w = 0; w < 4; w++) {
                u32 b[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint4 v4 = vw[h][j];
                    const u32 raw = w == 0 ? v4.x : w == 1 ? v4.y : w == 2 ? v4.z : v4.w;
                    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(b[h]) : "r"(raw));
                }
                float* acc = o[j][w];
                acc[0] *= corr;
                acc[1] *= corr;
                mma_bf16_16816(acc, pa0, 0u, pa2, 0u, b[0], b[1]);
            }
    }
    if (t == 0 && g < G) {
        sm_m[warp][g] = m;
        sm_l[warp][g] = l;
    }
#pragma unroll
    for (int j = 0; j < VJ; j++)
#pragma unroll
        for (int w = 0; w < 4; w++) {
            sm_acc[warp][g][t * DL + 8 * j + 2 * w] = o[j][w][0];
            sm_acc[warp][g][t * DL + 8 * j + 2 * w + 1] = o[j][w][1];
        }
    __syncthreads();
    decode_merge_warps<HD, G, WARPS>(sm_m, sm_l, sm_acc, group, q_row, kvh, split, n_heads, n_splits, out, part_acc,
                                     part_ml);
}

// Groups of up to 8 query heads a KV head.
extern "C" __global__ void __launch_bounds__(128) attention_decode_mma_hd64(ATTN_ARGS) {
    attention_decode_mma<64>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(128) attention_decode_mma_hd128(ATTN_ARGS) {
    attention_decode_mma<128>(ATTN_PASS);
}
// Prefill: up to 64 rows (query tokens x query heads of a KV head) per item.
extern "C" __global__ void __launch_bounds__(256) attention_prefill_hd64(ATTN_ARGS) {
    attention_tile_loop<64, 64, 256, 64>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(256) attention_prefill_hd128(ATTN_ARGS) {
    attention_tile_loop<128, 64, 256, 64>(ATTN_PASS);
}

// Merges the splits of a decode launch: for each (token, head) of rows[],
// out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M). Grid (row, head),
// head_dim threads (at most 128), thread d writing dim d. Every load is
// issued before its value is needed: the splits' maxima a split a thread,
// their weights into shared memory head_dim splits at a time, then each
// dim's partials 8 at a time (a loop that loaded and used one split at a
// time waited on memory 34 times at 17 splits: 3.8 us a layer at batch 1).
// The sums are in split order for a given split count, and empty splits
// (m = -inf) add exact zeros, so a sequence's result does not depend on the
// longest sequence in the batch (batch invariance).
extern "C" __global__ void __launch_bounds__(128) attention_combine(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, const int* __restrict__ rows,
    int n_heads, int head_dim, int n_splits, bf16* __restrict__ out) {
    __shared__ float weight[128];
    __shared__ float scratch[32];
    const u64 token = rows[blockIdx.x];
    const int head = blockIdx.y, d = threadIdx.x;
    const u64 base = (token * n_heads + head) * n_splits;
    float m = NEG_INF;
    for (int s = d; s < n_splits; s += head_dim) m = fmaxf(m, part_ml[2 * (base + s)]);
    m = block_max(m, scratch);
    float l = 0.0f, a = 0.0f;
    for (int s0 = 0; s0 < n_splits; s0 += head_dim) {
        const int s = s0 + d;
        float w = 0.0f;
        if (s < n_splits && m != NEG_INF) {
            const float2 ml = *(const float2*)(part_ml + 2 * (base + s));
            if (ml.x != NEG_INF) {
                w = expf(ml.x - m);
                l += ml.y * w;
            }
        }
        weight[d] = w;
        __syncthreads();
        const int count = min(head_dim, n_splits - s0);
        const float* acc = part_acc + (base + s0) * head_dim + d;
#pragma unroll 8
        for (int k = 0; k < count; k++) a = fmaf(acc[(u64)k * head_dim], weight[k], a);
        __syncthreads();
    }
    l = block_sum(l, scratch);
    out[token * n_heads * head_dim + head * head_dim + d] = f32_to_bf16(l > 0.0f ? a / l : 0.0f);
}
