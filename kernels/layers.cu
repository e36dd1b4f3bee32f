// The per-token pieces of a Llama layer around the GEMMs: embedding, RMSNorm,
// RoPE with the KV cache write, SwiGLU. The residual stream is f32; GEMM inputs
// are bf16.

// x[t] = embedding row tokens[t]. One block per token.
extern "C" __global__ void embed_rows(const bf16* __restrict__ table, const int* __restrict__ tokens,
                                      float* __restrict__ x, int hidden) {
    pdl_enter();
    const bf16* row = table + (u64)tokens[blockIdx.x] * hidden;
    float* out = x + (u64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = bf16_to_f32(row[i]);
}

// out[b] = bf16(x[r] / rms(x[r]) * w), r = rows[b] (or b when rows is null).
// One block per output row.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const int* __restrict__ rows,
                                    const float* __restrict__ w, bf16* __restrict__ out, int hidden, float eps) {
    pdl_enter();
    __shared__ float scratch[32];
    const int r = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* xr = x + (u64)r * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)hidden + eps);
    bf16* o = out + (u64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = f32_to_bf16(xr[i] * scale * w[i]);
}

// qkv: one f32 row per token, [q (n_heads * head_dim) | k (kv_dim) | v (kv_dim)].
// Rotates adjacent pairs (2i, 2i + 1) of every Q and K head by pos * theta^(-2i / head_dim),
// writes Q as bf16 to q_out, and K and V as bf16 into cache slot slots[t]
// (slot = block * block_size + pos % block_size; the caches are this layer's).
// One block per token.
extern "C" __global__ void rope_store_kv(const float* __restrict__ qkv, const int* __restrict__ positions,
                                         const int* __restrict__ slots, bf16* __restrict__ q_out,
                                         bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                         int n_heads, int n_kv_heads, int head_dim, float theta) {
    pdl_enter();
    const int t = blockIdx.x;
    const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    const float* row = qkv + (u64)t * (q_dim + 2 * kv_dim);
    const float pos = (float)positions[t];
    const u64 slot = (u64)slots[t];
    const int half = head_dim / 2;
    const int pairs = (n_heads + n_kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int i = p % half;
        const float freq = powf(theta, -2.0f * (float)i / (float)head_dim);
        float s, c;
        sincosf(pos * freq, &s, &c);
        const int at = 2 * p;
        const float a = row[at], b = row[at + 1];
        const bf16 ra = f32_to_bf16(a * c - b * s), rb = f32_to_bf16(a * s + b * c);
        if (at < q_dim) {
            q_out[(u64)t * q_dim + at] = ra;
            q_out[(u64)t * q_dim + at + 1] = rb;
        } else {
            k_cache[slot * kv_dim + at - q_dim] = ra;
            k_cache[slot * kv_dim + at - q_dim + 1] = rb;
        }
    }
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x)
        v_cache[slot * kv_dim + i] = f32_to_bf16(row[q_dim + kv_dim + i]);
}

// gate_up: one f32 row per token, [gate (ffn) | up (ffn)]; out = bf16(silu(gate) * up).
extern "C" __global__ void silu_mul(const float* __restrict__ gate_up, bf16* __restrict__ out, int ffn, u64 n) {
    pdl_enter();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n * ffn; i += (u64)gridDim.x * blockDim.x) {
        const u64 t = i / ffn, j = i % ffn;
        const float g = gate_up[t * 2 * ffn + j], u = gate_up[t * 2 * ffn + ffn + j];
        out[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// Greedy sampling on the device: out[b] = argmax of logits row b (the lowest
// index among equal maxima, as the CPU sampler picks). One block per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    pdl_enter();
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* row = logits + (u64)blockIdx.x * vocab;
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = row[i];
        if (x > v) { v = x; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_v[warp] = v; best_i[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (best_v[w] > v || (best_v[w] == v && best_i[w] < idx)) { v = best_v[w]; idx = best_i[w]; }
        out[blockIdx.x] = idx;
    }
}
