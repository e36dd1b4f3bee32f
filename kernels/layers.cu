// The per-token pieces of a Llama layer around the GEMMs: embedding, RMSNorm,
// RoPE with the KV cache write, SwiGLU. The residual stream is f32; GEMM inputs
// are bf16.

// x[t] = embedding row tokens[t], and with x_bf16 (not null; for the fused
// one-token GEMVs, gemv.cu and fp4.cu) the row to x_bf16 too: as it is
// (BF16), or times the first norm's weights g where g is not null (the FP4
// kernels', whose weights cannot take g folded in), and then the sums of
// its squares by 16 elements to sumsq_tiles (hidden a multiple of 16; one
// token). One block per token.
extern "C" __global__ void embed_rows(const bf16* __restrict__ table, const int* __restrict__ tokens,
                                      float* __restrict__ x, bf16* __restrict__ x_bf16, const float* __restrict__ g,
                                      float* __restrict__ sumsq_tiles, int hidden) {
    wait_for_previous_kernels();
    const bf16* row = table + (u64)tokens[blockIdx.x] * hidden;
    float* out = x + (u64)blockIdx.x * hidden;
    const u64 at = (u64)blockIdx.x * hidden;
    // Every thread goes round the same number of times (blockDim a multiple
    // of 32), so that 16 lanes can add up their tile's squares.
    for (int i0 = 0; i0 < hidden; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const float v = i < hidden ? bf16_to_f32(row[i]) : 0.0f;
        if (i < hidden) {
            out[i] = v;
            if (x_bf16) x_bf16[at + i] = g ? f32_to_bf16(v * g[i]) : row[i];
        }
        if (sumsq_tiles) {
            float ss = v * v;
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if ((threadIdx.x & 15) == 0 && i < hidden) sumsq_tiles[i >> 4] = ss;
        }
    }
}

// out[b] = bf16(x[r] / rms(x[r]) * w), r = rows[b] (or b when rows is null).
// One block of RMS_THREADS threads per output row; a thread holds up to
// RMS_VEC float4s of the row (hidden a multiple of 4, at most RMS_THREADS *
// RMS_VEC * 4 = 16,384; compute::cuda::layers checks), so the row is read
// once with every load in flight. (256 threads striding the row, each load
// waiting for the last, took 11.8 us a row at batch 1 under ncu: 65 of them
// a step of an 8B model.)
// x / rms(x) * w rounded to BF16, two at a time, given scale = 1 / rms.
__device__ __forceinline__ u32 rms_scaled_bf16x2(float a, float b, float scale, float wa, float wb) {
    return (u32)f32_to_bf16(a * scale * wa) | ((u32)f32_to_bf16(b * scale * wb) << 16);
}

#define RMS_THREADS 1024
#define RMS_VEC 4
extern "C" __global__ void __launch_bounds__(RMS_THREADS) rms_norm(const float* __restrict__ x, const int* __restrict__ rows,
                                    const float* __restrict__ w, bf16* __restrict__ out, int hidden, float eps) {
    wait_for_previous_kernels();
    __shared__ float scratch[32];
    const int r = rows ? rows[blockIdx.x] : blockIdx.x;
    const float4* xr = (const float4*)(x + (u64)r * hidden);
    const float4* w4 = (const float4*)w;
    const int quads = hidden >> 2;
    float4 v[RMS_VEC], wv[RMS_VEC];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) {
        const int i = threadIdx.x + k * RMS_THREADS;
        v[k] = i < quads ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        wv[k] = i < quads ? w4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)hidden + eps);
    uint2* o = (uint2*)(out + (u64)blockIdx.x * hidden);
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) {
        const int i = threadIdx.x + k * RMS_THREADS;
        if (i < quads) {
            o[i] = make_uint2(rms_scaled_bf16x2(v[k].x, v[k].y, scale, wv[k].x, wv[k].y),
                              rms_scaled_bf16x2(v[k].z, v[k].w, scale, wv[k].z, wv[k].w));
        }
    }
}

// qkv: one f32 row per token, [q (n_heads * head_dim) | k (kv_dim) | v (kv_dim)].
// Rotates adjacent pairs (2i, 2i + 1) of every Q and K head by pos * theta^(-2i / head_dim),
// writes Q as bf16 to q_out, and K and V as bf16 into cache slot slots[t]
// (slot = block * block_size + pos % block_size; the caches are this layer's).
// Grid (token, ROPE_HEADS heads of Q then K), a pair a thread (ROPE_HEADS *
// head_dim / 2 threads); a K head's threads copy the same head of V. (One
// block a token looping over the 2,560 pairs of an 8B layer took 15.7 us at
// batch 1 under ncu; one head a block, 51 us for a 1,024-token prefill.)
#define ROPE_HEADS 4
extern "C" __global__ void rope_store_kv(const float* __restrict__ qkv, const int* __restrict__ positions,
                                         const int* __restrict__ slots, bf16* __restrict__ q_out,
                                         bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                         int n_heads, int n_kv_heads, int head_dim, float theta) {
    wait_for_previous_kernels();
    const RopeKvOut o{positions, slots, q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim, theta};
    const int half = head_dim / 2;
    const int t = blockIdx.x, head = blockIdx.y * ROPE_HEADS + threadIdx.x / half, i = threadIdx.x % half;
    if (head >= n_heads + n_kv_heads) return;
    const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    const float* row = qkv + (u64)t * (q_dim + 2 * kv_dim);
    const int at = head * head_dim + 2 * i;
    const float2 ab = *(const float2*)(row + at);
    rope_kv_pair(o, t, at, ab.x, ab.y);
    if (head >= n_heads) {
        const float2 v = *(const float2*)(row + at + kv_dim);
        rope_kv_pair(o, t, at + kv_dim, v.x, v.y);
    }
}

// gate_up: one f32 row per token, [gate (ffn) | up (ffn)] where run is 0,
// else gate and up in alternate runs of `run` (gate 0..run-1, up 0..run-1,
// gate run.., as FP4 weights are stored: model.rs, GATE_UP_RUN);
// out = bf16(silu(gate) * up).
extern "C" __global__ void silu_mul(const float* __restrict__ gate_up, bf16* __restrict__ out, int ffn, int run,
                                    u64 n) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n * ffn; i += (u64)gridDim.x * blockDim.x) {
        const u64 t = i / ffn, j = i % ffn;
        const u64 at = run ? j / run * 2 * run + j % run : j, up = run ? (u64)run : (u64)ffn;
        const float g = gate_up[t * 2 * ffn + at], u = gate_up[t * 2 * ffn + at + up];
        out[i] = f32_to_bf16(silu_times(g, u));
    }
}

// Greedy sampling on the device: out[b] = argmax of logits row b (the lowest
// index among equal maxima, as the CPU sampler picks). One block per row;
// each thread scans its float4s ARGMAX_UNROLL loads at a time (vocab a
// multiple of 4; one load at a time, a 128k vocabulary took 47 us).
#define ARGMAX_UNROLL 8
__device__ __forceinline__ void argmax_take(float x, int i, float& v, int& idx) {
    if (x > v || (x == v && i < idx)) { v = x; idx = i; }
}
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    wait_for_previous_kernels();
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float4* row = (const float4*)(logits + (u64)blockIdx.x * vocab);
    const int quads = vocab >> 2;
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int q0 = threadIdx.x; q0 < quads; q0 += ARGMAX_UNROLL * blockDim.x) {
        float4 f[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const int q = q0 + u * blockDim.x;
            f[u] = q < quads ? row[q] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const int i = 4 * (q0 + u * blockDim.x);
            argmax_take(f[u].x, i, v, idx);
            argmax_take(f[u].y, i + 1, v, idx);
            argmax_take(f[u].z, i + 2, v, idx);
            argmax_take(f[u].w, i + 3, v, idx);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        argmax_take(ov, oi, v, idx);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_v[warp] = v; best_i[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) argmax_take(best_v[w], best_i[w], v, idx);
        out[blockIdx.x] = idx;
    }
}
