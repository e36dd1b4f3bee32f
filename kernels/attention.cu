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
// token per item, `attention_decode_mma_*`: K and V read straight into
// tensor-core fragments) split the keys across blocks (flash-decoding), and
// the splits merge inside a cluster of the split blocks
// (`attention_decode_cluster_*`, up to 16 splits) or in `attention_combine`
// after; prefill launches
// (`attention_prefill_*`: R = n_q * group rows, at most MAXR, K and V tiles in
// shared memory) use items of several query tokens and one split.
//
// Prefill scores are computed on CUDA cores in f32; tensor-core tiles there
// are the next step (BENCHMARKS.md says what this costs in prefill).

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
// (one split), as this split's partials for attention_combine, or (CLUSTER)
// into cl_ml / cl_acc in this block's shared memory for decode_merge_cluster.
template <int HD, int G, int WARPS, bool CLUSTER>
__device__ __forceinline__ void decode_merge_warps(const float (*sm_m)[G], const float (*sm_l)[G],
                                                   const float (*sm_acc)[G][HD], int group, int q_row, int kvh,
                                                   int split, int n_heads, int n_splits, bf16* __restrict__ out,
                                                   float* __restrict__ part_acc, float* __restrict__ part_ml,
                                                   float (*cl_ml)[2], float (*cl_acc)[HD]) {
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
        if (CLUSTER) {
            cl_acc[g][d] = a;
            if (d == 0) {
                cl_ml[g][0] = mx;
                cl_ml[g][1] = lsum;
            }
        } else if (n_splits == 1) {
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

// Up to this many splits merge in one cluster (16: a non-portable cluster
// size, which Hopper and Blackwell allow; keep in step with model.rs).
constexpr int MAX_CLUSTER_SPLITS = 16;

// A decode launch whose splits of an (item, KV head) are the blocks of one
// cluster (rank = split): each block left its (m, l, acc) in its shared
// memory (decode_merge_warps); after a cluster barrier, block `split` merges
// every n_splits-th output of the group's heads, out = sum_s acc_s w_s /
// sum_s l_s w_s with w_s = e^(m_s - max m), reading the other blocks' shared
// memory, and writes it; a second barrier keeps each block's shared memory
// alive until the others are done with it. No partials through global
// memory and no combine launch (2.8 us a layer at batch 1). Fast numerics
// only: the plan never asks for it under the batch-invariant split (its
// 8-warp blocks sum a split's keys in another order than the 4-warp kernel
// that attention_combine follows).
template <int HD>
__device__ __forceinline__ void decode_merge_cluster(float (*cl_ml)[2], float (*cl_acc)[HD], int group, int q_row,
                                                     int kvh, int split, int n_heads, int n_splits,
                                                     bf16* __restrict__ out) {
    cluster_sync();
    const u32 ml_at = smem_u32(cl_ml), acc_at = smem_u32(cl_acc);
    for (int i = split * blockDim.x + threadIdx.x; i < group * HD; i += n_splits * blockDim.x) {
        const int g = i / HD, d = i % HD;
        float m_s[MAX_CLUSTER_SPLITS], l_s[MAX_CLUSTER_SPLITS], acc_s[MAX_CLUSTER_SPLITS];
        float max_m = NEG_INF;
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; s++) {
            if (s < n_splits) {
                m_s[s] = ld_cluster(cluster_map(ml_at + 8 * g, s));
                l_s[s] = ld_cluster(cluster_map(ml_at + 8 * g + 4, s));
                acc_s[s] = ld_cluster(cluster_map(acc_at + 4 * (g * HD + d), s));
            }
        }
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; s++)
            if (s < n_splits) max_m = fmaxf(max_m, m_s[s]);
        float l = 0.0f, a = 0.0f;
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; s++) {
            if (s < n_splits && m_s[s] != NEG_INF) {
                const float w = expf(m_s[s] - max_m);
                l += l_s[s] * w;
                a += acc_s[s] * w;
            }
        }
        out[(u64)q_row * n_heads * HD + (kvh * group + g) * HD + d] = f32_to_bf16(l > 0.0f ? a / l : 0.0f);
    }
    cluster_sync();
}

// Decode on the tensor cores (mma.sync m16n8k16, BF16 in, f32 out): one
// query token per work item; the keys of a split are the block's, its
// warps' results merged at the end (decode_merge_warps), for groups of at
// most 8 query heads. Each warp takes 16 keys at a time, with keys and
// dims as the MMA's M and heads as its N (8), so that no row of it is idle.
// S^T = K . Q^T: lane (g, t) loads the K rows of keys n0 + g and n0 + 8 + g
// at dims t * HD/4 .. + HD/4 (16-byte loads) and query head g's same dims
// (once); as the dot product does not care in which order dims are summed,
// k-step ks pairs the MMA's columns {2t, 2t + 1} and {2t + 8, 2t + 9} with
// dims t * HD/4 + 4ks + {0, 1} and {2, 3} on both sides. The scores come out
// as keys x heads: lane (g, t) holds heads 2t and 2t + 1 of keys g and g + 8,
// so each head's softmax over the 16 keys is three shuffles across g, and
// the lane keeps its two heads' running max and sum. O^T = V^T . P^T: the
// probabilities, rounded to BF16, are an 8 x 8 matrix per key half whose
// transpose (movmatrix) is P^T's B fragment; the same lanes load the same
// dims of the two keys' V rows, each 32-bit word a column pair of an 8 keys
// x 8 dims matrix, and its transpose is a quarter of V^T's A fragment. Dims
// of such a matrix are t * HD/4 + 8j + 2w + {0, 1} across its columns t, so
// output row g of the MMA pairing words (2p, 2p + 1) of 16-byte word j is
// dim (g / 2) * HD/4 + 8j + 2(2p + r) + g % 2 (r = 0 for c0/c1, 1 for
// c2/c3). Per 16 keys a lane issues HD/8 MMAs and HD/8 + 2 movmatrix where
// the CUDA-core kernel this replaced (a key a lane, scores against Q in
// shared memory, P.V by shuffles) issued ~800 dependent FMAs and shuffles,
// which bound it at batch 1 (BENCHMARKS.md).
//
// EARLY (the cluster kernels, launched early: Gpu::launch_cluster_early):
// the block waits for the kernel ahead only after loading its first step's
// keys before the query token's. That is sound (common.cuh) because what it
// reads before the wait was written before the kernel ahead began: the work
// items, block tables and split (the step's upload, a copy ahead of its
// first kernel) and the keys of earlier steps; the kernel ahead writes the
// query and the step's own keys and values (RoPE), read after the wait.
template <int HD, int WARPS, bool CLUSTER, bool EARLY = false>
__device__ __forceinline__ void attention_decode_mma(ATTN_ARGS) {
    constexpr int G = 8;
    constexpr int DL = HD / 4;   // dims a quad position covers
    constexpr int KS = HD / 16;  // k-steps of S^T, and m-tiles of O^T
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

    // This lane's two keys (n0 + g, n0 + 8 + g) of a 16-key step: K and V
    // rows, all loads at once; keys from `from` on (zeros below it) and
    // under `to` (zeros from it).
    uint4 kw[2][VJ], vw[2][VJ];
    auto load_kv = [&](int n0, int from, int to) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int key = n0 + 8 * h + g;
            if ((!EARLY || key >= from) && key < to) {
                const u64 row = ((u64)table[key / block_size] * block_size + key % block_size) * kv_dim + kvh * HD + t * DL;
#pragma unroll
                for (int c = 0; c < VJ; c++) {
                    kw[h][c] = ((const uint4*)(k_cache + row))[c];
                    vw[h][c] = ((const uint4*)(v_cache + row))[c];
                }
            } else if (!EARLY || key >= to) {
#pragma unroll
                for (int c = 0; c < VJ; c++) kw[h][c] = vw[h][c] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    int n0 = k_begin + 16 * warp;
    if (EARLY) {
        // The first step's keys before the query's (written by earlier
        // steps), under the tail of the kernel ahead; its query and the
        // query token's own key and value (which that kernel writes) after.
        load_kv(n0, 0, min(k_end, q_pos));
        wait_for_previous_kernels();
        load_kv(n0, q_pos, k_end);
    }
    // Query head g's dims t * DL .., 2 words a k-step (b0, b1 of Q^T).
    u32 qb[2 * KS];
    {
        const uint4* qrow = (const uint4*)(q + (u64)q_row * q_dim + (kvh * group + g) * HD + t * DL);
#pragma unroll
        for (int c = 0; c < VJ; c++) {
            const uint4 v = g < group ? qrow[c] : make_uint4(0, 0, 0, 0);
            qb[4 * c] = v.x;
            qb[4 * c + 1] = v.y;
            qb[4 * c + 2] = v.z;
            qb[4 * c + 3] = v.w;
        }
    }
    // O^T: m-tile (j, p) rows = dims of words 2p (c0, c1) and 2p + 1 (c2, c3)
    // of 16-byte word j; columns = heads 2t, 2t + 1.
    float o[VJ][2][4];
#pragma unroll
    for (int j = 0; j < VJ; j++)
#pragma unroll
        for (int p = 0; p < 2; p++) o[j][p][0] = o[j][p][1] = o[j][p][2] = o[j][p][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (bool first = true; n0 < k_end; n0 += 16 * WARPS, first = false) {
        if (!EARLY || !first) load_kv(n0, 0, k_end);
        // S^T: c0, c1 = keys n0 + g, heads 2t, 2t + 1; c2, c3 = key n0 + 8 + g.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const uint4 lo = kw[0][ks >> 1], hi = kw[1][ks >> 1];
            const bool odd = ks & 1;
            mma_bf16_16816(sc, odd ? lo.z : lo.x, odd ? hi.z : hi.x, odd ? lo.w : lo.y, odd ? hi.w : hi.y, qb[2 * ks],
                           qb[2 * ks + 1]);
        }
        float p[4], corr[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float s0 = n0 + g < k_end ? sc[e] * scale : NEG_INF;
            const float s1 = n0 + 8 + g < k_end ? sc[2 + e] * scale : NEG_INF;
            float mx = fmaxf(s0, s1);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            const float m_new = fmaxf(m[e], mx);
            // All keys so far masked (m_new = -inf): nothing to add or rescale.
            corr[e] = m_new == NEG_INF ? 1.0f : expf(m[e] - m_new);
            p[e] = m_new == NEG_INF ? 0.0f : expf(s0 - m_new);
            p[2 + e] = m_new == NEG_INF ? 0.0f : expf(s1 - m_new);
            float ps = p[e] + p[2 + e];
            ps += __shfl_xor_sync(0xffffffffu, ps, 4);
            ps += __shfl_xor_sync(0xffffffffu, ps, 8);
            ps += __shfl_xor_sync(0xffffffffu, ps, 16);
            l[e] = l[e] * corr[e] + ps;
            m[e] = m_new;
        }
        // P^T's B fragment: the keys x heads probabilities, transposed.
        u32 pb[2];
        {
            const u32 lo = (u32)f32_to_bf16(p[0]) | ((u32)f32_to_bf16(p[1]) << 16);
            const u32 hi = (u32)f32_to_bf16(p[2]) | ((u32)f32_to_bf16(p[3]) << 16);
            asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(pb[0]) : "r"(lo));
            asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(pb[1]) : "r"(hi));
        }
#pragma unroll
        for (int j = 0; j < VJ; j++)
#pragma unroll
            for (int pp = 0; pp < 2; pp++) {
                // V^T's A fragment: dims of words 2pp (a0, a2) and 2pp + 1
                // (a1, a3), keys 0-7 (a0, a1) and 8-15 (a2, a3).
                u32 a[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const uint4 v4 = vw[i >> 1][j];
                    const int wi = 2 * pp + (i & 1);
                    const u32 raw = wi == 0 ? v4.x : wi == 1 ? v4.y : wi == 2 ? v4.z : v4.w;
                    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(a[i]) : "r"(raw));
                }
                float* acc = o[j][pp];
                acc[0] *= corr[0];
                acc[1] *= corr[1];
                acc[2] *= corr[0];
                acc[3] *= corr[1];
                mma_bf16_16816(acc, a[0], a[1], a[2], a[3], pb[0], pb[1]);
            }
    }
    if (g == 0) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            sm_m[warp][2 * t + e] = m[e];
            sm_l[warp][2 * t + e] = l[e];
        }
    }
#pragma unroll
    for (int j = 0; j < VJ; j++)
#pragma unroll
        for (int pp = 0; pp < 2; pp++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int d = (g >> 1) * DL + 8 * j + 2 * (2 * pp + r) + (g & 1);
                sm_acc[warp][2 * t][d] = o[j][pp][2 * r];
                sm_acc[warp][2 * t + 1][d] = o[j][pp][2 * r + 1];
            }
    __syncthreads();
    __shared__ float cl_ml[CLUSTER ? G : 1][2];
    __shared__ float cl_acc[CLUSTER ? G : 1][HD];
    decode_merge_warps<HD, G, WARPS, CLUSTER>(sm_m, sm_l, sm_acc, group, q_row, kvh, split, n_heads, n_splits, out,
                                              part_acc, part_ml, cl_ml, cl_acc);
    if (CLUSTER) decode_merge_cluster<HD>(cl_ml, cl_acc, group, q_row, kvh, split, n_heads, n_splits, out);
}

// Groups of up to 8 query heads a KV head.
extern "C" __global__ void __launch_bounds__(128) attention_decode_mma_hd64(ATTN_ARGS) {
    wait_for_previous_kernels();
    attention_decode_mma<64, 4, false>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(128) attention_decode_mma_hd128(ATTN_ARGS) {
    wait_for_previous_kernels();
    attention_decode_mma<128, 4, false>(ATTN_PASS);
}
// The same with 8 warps, launched in clusters of the n_splits blocks of an
// (item, KV head), 2 <= n_splits <= MAX_CLUSTER_SPLITS: the splits merge
// inside the cluster (decode_merge_cluster), with no attention_combine
// after. 8 warps, so that a split of 128 keys (the plan's for short
// sequences, which fewer splits must cover) is one 16-key step a warp.
// They wait inside attention_decode_mma (EARLY), after loading their first
// keys before the query token's, and are programmatic launches inside decode
// graphs too (model.rs, launch_attention).
extern "C" __global__ void __launch_bounds__(256) attention_decode_cluster_hd64(ATTN_ARGS) {
    // waits in attention_decode_mma, after loading its first earlier keys
    attention_decode_mma<64, 8, true, true>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(256) attention_decode_cluster_hd128(ATTN_ARGS) {
    // waits in attention_decode_mma, after loading its first earlier keys
    attention_decode_mma<128, 8, true, true>(ATTN_PASS);
}
// Prefill: up to 64 rows (query tokens x query heads of a KV head) per item.
extern "C" __global__ void __launch_bounds__(256) attention_prefill_hd64(ATTN_ARGS) {
    wait_for_previous_kernels();
    attention_tile_loop<64, 64, 256, 64>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(256) attention_prefill_hd128(ATTN_ARGS) {
    wait_for_previous_kernels();
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
    wait_for_previous_kernels();
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
