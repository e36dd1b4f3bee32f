// Skinny GEMMs for decode (n <= 8 tokens): y[j, r] = sum_c w[r, c] x[j, c]
// (+ y[j, r] when accumulate), BF16 weights and activations, f32 out. The
// weights are read once, 16 bytes per thread per load, UNROLL loads per row
// in flight, so enough bytes are in the air to keep HBM busy; x (a few KB)
// comes from L1. cols must be a multiple of 8. This is also the shape the FP4
// kernels take (dequantize in registers, then the same sums).
//
// The one-token kernels ask for 10 blocks an SM (`__launch_bounds__(128,
// 10)`: at most 48 registers, from 56-72, with no spills in the hot loops):
// +0.1-0.4 points of the roofline at batch 1; 8 was 0.4-0.8 slower and 12
// spills (BENCHMARKS.md).
//
// The fused one-token kernels at the end take a layer's two input projections
// with what comes before and after them: the RMSNorm in front, and RoPE with
// the KV write (`gemv_norm_rope_n1`, QKV) or SwiGLU (`gemv_norm_swiglu_n1`,
// gate and up); the output projections write what those read
// (`gemv_residual_n1`). A batch-1 layer is then six launches (ten unfused).
// The norm costs no extra pass and no extra read: the model folds each
// norm's weights g into the columns of the projection after it at load
// (bf16(W g), one rounding, as bf16(W) was), so that W (x / rms(x) * g) =
// ((W g) x) / rms(x): the block takes its dot products over x, the
// residual's BF16 copy (which the embedding or the output projection before
// writes), sums x^2 from the same values in the same loop, and scales its
// sums at the end. (Three other forms were slower: the dot products over a
// second row, bf16(x * g), written by the kernel before, 1.3 points of the
// roofline at batch 1; g read in the loop and multiplied there, 1.3-1.5 us a
// matrix; the output projections adding up x^2 for the reader with integer
// atomics. An earlier try had each block normalize x in a pass of its own
// before the GEMV, from the f32 residual: every block's extra reads, 14,336
// blocks for gate_up, tripled what an SM read; a batch-1 step went from 4.55
// to 6.16 ms. BENCHMARKS.md.)

__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    return bf16_lo(w.x) * x[0] + bf16_hi(w.x) * x[1] + bf16_lo(w.y) * x[2] + bf16_hi(w.y) * x[3] +
           bf16_lo(w.z) * x[4] + bf16_hi(w.z) * x[5] + bf16_lo(w.w) * x[6] + bf16_hi(w.w) * x[7];
}

__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

constexpr int GEMV_THREADS = 128, GEMV_STEP = GEMV_THREADS * 8;

// A block of 4 warps takes ROWS rows, row0 + r * row_step (r < ROWS); its 128
// threads split the columns (thread t reads columns 8t .. 8t + 7 of every
// 1024), so short and long rows alike give many blocks and many loads in
// flight. Leaves each warp's sums in partial[warp][r][j].
//
// With NORM (one token): the block's sum of x^2 also goes to sumsq[warp]
// (see block_rms_scale).
template <int N, int ROWS, int UNROLL, bool NORM = false>
__device__ __forceinline__ void gemv_block_sums(const bf16* __restrict__ w, const bf16* __restrict__ x, int n, int row0, int row_step,
                                                int rows, int cols, float (*partial)[ROWS][N], float* sumsq = nullptr) {
    static_assert(!NORM || N == 1, "the fused norm takes one token");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float ss = 0.0f;
    float acc[ROWS][N];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int j = 0; j < N; j++) acc[r][j] = 0.0f;
    for (int c0 = threadIdx.x * 8; c0 < cols; c0 += GEMV_STEP * UNROLL) {
        uint4 wv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * GEMV_STEP;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const int row = row0 + r * row_step;
                wv[u][r] = (c < cols && row < rows) ? __ldg((const uint4*)(w + (u64)row * cols + c))
                                                    : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * GEMV_STEP;
            if (c >= cols) break;
#pragma unroll
            for (int j = 0; j < N; j++) {
                if (j < n) {
                    float xf[8];
                    unpack8(__ldg((const uint4*)(x + (u64)j * cols + c)), xf);
                    if (NORM) {
#pragma unroll
                        for (int e = 0; e < 8; e++) ss += xf[e] * xf[e];
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; r++) acc[r][j] += dot8(wv[u][r], xf);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int j = 0; j < N; j++) {
            const float s = warp_sum(acc[r][j]);
            if (lane == 0) partial[warp][r][j] = s;
        }
    if (NORM) {
        ss = warp_sum(ss);
        if (lane == 0) sumsq[warp] = ss;
    }
    __syncthreads();
}

// 1 / rms(x) from gemv_block_sums' per-warp sums of x^2 (added in warp order).
__device__ __forceinline__ float block_rms_scale(const float* sumsq, int cols, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int wi = 0; wi < GEMV_THREADS / 32; wi++) ss += sumsq[wi];
    return 1.0f / sqrtf(ss / (float)cols + eps);
}

// Row r's sum for token j, the warps' parts added in a fixed order (deterministic).
template <int ROWS, int N>
__device__ __forceinline__ float block_row_sum(float (*partial)[ROWS][N], int r, int j) {
    float s = 0.0f;
#pragma unroll
    for (int wi = 0; wi < GEMV_THREADS / 32; wi++) s += partial[wi][r][j];
    return s;
}

template <int N, int ROWS, int UNROLL>
__device__ __forceinline__ void gemv(const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y,
                                     int n, int rows, int cols, int accumulate) {
    __shared__ float partial[GEMV_THREADS / 32][ROWS][N];
    const int row0 = blockIdx.x * ROWS;
    gemv_block_sums<N, ROWS, UNROLL>(w, x, n, row0, 1, rows, cols, partial);
    for (int i = threadIdx.x; i < ROWS * N; i += GEMV_THREADS) {
        const int r = i / N, j = i % N;
        if (j < n && row0 + r < rows) {
            const float s = block_row_sum(partial, r, j);
            float* out = y + (u64)j * rows + row0 + r;
            *out = accumulate ? *out + s : s;
        }
    }
}

// Rows per block: N=1: 2, N=2: 4, N=4: 4, N=8: 8 (keep in step with device.rs).
#define GEMV_ARGS const bf16 *__restrict__ w, const bf16 *__restrict__ x, float *__restrict__ y, int n, int rows, \
                  int cols, int accumulate
extern "C" __global__ void __launch_bounds__(128, 10) gemv_bf16_n1(GEMV_ARGS) {
    wait_for_previous_kernels();
    gemv<1, 2, 4>(w, x, y, n, rows, cols, accumulate);
}
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n2(GEMV_ARGS) {
    wait_for_previous_kernels();
    gemv<2, 4, 2>(w, x, y, n, rows, cols, accumulate);
}
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n4(GEMV_ARGS) {
    wait_for_previous_kernels();
    gemv<4, 4, 2>(w, x, y, n, rows, cols, accumulate);
}
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n8(GEMV_ARGS) {
    wait_for_previous_kernels();
    gemv<8, 8, 1>(w, x, y, n, rows, cols, accumulate);
}

// One token: y += W x, and the new y as BF16 (y_bf16) for the fused input
// projection after it. An output projection, o or down, at batch 1; y and
// the sums are those of gemv_bf16_n1 with accumulate. Grid: rows / 2 blocks.
extern "C" __global__ void __launch_bounds__(128, 10) gemv_residual_n1(const bf16* __restrict__ w,
                                                                   const bf16* __restrict__ x, float* __restrict__ y,
                                                                   int rows, int cols, bf16* __restrict__ y_bf16) {
    wait_for_previous_kernels();
    __shared__ float partial[GEMV_THREADS / 32][2][1];
    const int row0 = blockIdx.x * 2;
    gemv_block_sums<1, 2, 4>(w, x, 1, row0, 1, rows, cols, partial);
    if (threadIdx.x < 2 && row0 + threadIdx.x < rows) {
        const int r = row0 + threadIdx.x;
        const float sum = y[r] + block_row_sum(partial, threadIdx.x, 0);
        y[r] = sum;
        y_bf16[r] = f32_to_bf16(sum);
    }
}

// One token, RMSNorm in front: x = bf16(residual) (`cols` wide, as
// gemv_residual_n1 or embed_rows wrote it), w with the norm's weights folded
// in. The QKV projection, a block taking one adjacent pair of rows, which
// RoPE rotates together (rope_kv_pair): Q to q_out, K and V into the token's
// cache slot. Grid: rows / 2 blocks.
extern "C" __global__ void __launch_bounds__(128, 10) gemv_norm_rope_n1(
    const bf16* __restrict__ w, const bf16* __restrict__ x, float eps, int rows, int cols,
    const int* __restrict__ positions, const int* __restrict__ slots, bf16* __restrict__ q_out,
    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int n_heads, int n_kv_heads, int head_dim, float theta) {
    wait_for_previous_kernels();
    __shared__ float partial[GEMV_THREADS / 32][2][1];
    __shared__ float sumsq[GEMV_THREADS / 32];
    const int row0 = blockIdx.x * 2;
    gemv_block_sums<1, 2, 4, true>(w, x, 1, row0, 1, rows, cols, partial, sumsq);
    if (threadIdx.x == 0) {
        const float scale = block_rms_scale(sumsq, cols, eps);
        const RopeKvOut o{positions, slots, q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim, theta};
        rope_kv_pair(o, 0, row0, block_row_sum(partial, 0, 0) * scale, block_row_sum(partial, 1, 0) * scale);
    }
}

// One token, as above: RMSNorm, then gate row b and up row ffn + b of the
// stacked [gate | up] weights in block b, out[b] = bf16(silu(gate) * up).
// Grid: ffn blocks.
extern "C" __global__ void __launch_bounds__(128, 10) gemv_norm_swiglu_n1(const bf16* __restrict__ w,
                                                                      const bf16* __restrict__ x, float eps, int ffn,
                                                                      int cols, bf16* __restrict__ out) {
    wait_for_previous_kernels();
    __shared__ float partial[GEMV_THREADS / 32][2][1];
    __shared__ float sumsq[GEMV_THREADS / 32];
    gemv_block_sums<1, 2, 4, true>(w, x, 1, blockIdx.x, ffn, 2 * ffn, cols, partial, sumsq);
    if (threadIdx.x == 0) {
        const float scale = block_rms_scale(sumsq, cols, eps);
        out[blockIdx.x] = f32_to_bf16(
            silu_times(block_row_sum(partial, 0, 0) * scale, block_row_sum(partial, 1, 0) * scale));
    }
}
