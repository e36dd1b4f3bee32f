// Skinny GEMMs for decode (n <= 8 tokens): y[j, r] = sum_c w[r, c] x[j, c]
// (+ y[j, r] when accumulate), BF16 weights and activations, f32 out. The
// weights are read once, 16 bytes per thread per load, UNROLL loads per row
// in flight, so enough bytes are in the air to keep HBM busy; x (a few KB)
// comes from L1. cols must be a multiple of 8. This is also the shape the FP4
// kernels take (dequantize in registers, then the same sums).
//
// The fused one-token kernels at the end (`gemv_rope_n1`, `gemv_swiglu_n1`)
// take a layer's two input projections with what comes after them: RoPE and
// the KV write (QKV), SwiGLU (gate and up), so that a batch-1 layer is seven
// launches, not nine. (Taking the RMSNorm in front too, each block
// normalizing x for itself, was tried: every block's extra pass over the
// residual and the norm's weights, 14,336 blocks for gate_up, tripled what
// an SM read; a batch-1 step went from 4.55 to 6.16 ms, about 1.1 ms of it
// this, BENCHMARKS.md.)

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
template <int N, int ROWS, int UNROLL>
__device__ __forceinline__ void gemv_block_sums(const bf16* __restrict__ w, const bf16* __restrict__ x, int n, int row0, int row_step,
                                                int rows, int cols, float (*partial)[ROWS][N]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
    __syncthreads();
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
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n1(GEMV_ARGS) {
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

// One token (row 0 of x, BF16, `cols` wide): the QKV projection, a block
// taking one adjacent pair of rows, which RoPE rotates together
// (rope_kv_pair): Q to q_out, K and V into the token's cache slot. Grid:
// rows / 2 blocks.
extern "C" __global__ void __launch_bounds__(128) gemv_rope_n1(
    const bf16* __restrict__ w, const bf16* __restrict__ x, int rows, int cols, const int* __restrict__ positions,
    const int* __restrict__ slots, bf16* __restrict__ q_out, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
    int n_heads, int n_kv_heads, int head_dim, float theta) {
    wait_for_previous_kernels();
    __shared__ float partial[GEMV_THREADS / 32][2][1];
    const int row0 = blockIdx.x * 2;
    gemv_block_sums<1, 2, 4>(w, x, 1, row0, 1, rows, cols, partial);
    if (threadIdx.x == 0) {
        const RopeKvOut o{positions, slots, q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim, theta};
        rope_kv_pair(o, 0, row0, block_row_sum(partial, 0, 0), block_row_sum(partial, 1, 0));
    }
}

// One token, as above: gate row b and up row ffn + b of the stacked
// [gate | up] weights in block b, out[b] = bf16(silu(gate) * up). Grid: ffn
// blocks.
extern "C" __global__ void __launch_bounds__(128) gemv_swiglu_n1(
    const bf16* __restrict__ w, const bf16* __restrict__ x, int ffn, int cols, bf16* __restrict__ out) {
    wait_for_previous_kernels();
    __shared__ float partial[GEMV_THREADS / 32][2][1];
    gemv_block_sums<1, 2, 4>(w, x, 1, blockIdx.x, ffn, 2 * ffn, cols, partial);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = f32_to_bf16(silu_times(block_row_sum(partial, 0, 0), block_row_sum(partial, 1, 0)));
    }
}

// --- One token, the weights streamed through shared memory ---
//
// The kernels above give a block one or two rows, so a 4,096-row matrix is
// 2,048 blocks that start together, wait on their loads together and end
// together: under ncu a layer's one-wave matrices (QKV, o, down) read 2.6-3.5
// TB/s where gate/up, seven waves of the same blocks, read 4.3 (BENCHMARKS.md,
// "Weights streamed"). Here one block an SM takes a contiguous range of units
// (a unit: the rows one output needs; a row, QKV's RoPE pair, or gate row b
// with up row ffn + b) and streams them through a ring of `stages`
// shared-memory stages filled by the bulk copy engine, each stage's landing
// counted on its mbarrier: the whole ring is in flight from the start, no
// register holds a load, and every SM has the same bytes to read. Stage s
// belongs to warp s % warps (stages a multiple of warps), which takes the
// units that land there in turn (unit i of the block in stage i % stages),
// sums each row (lane l: 16-byte chunks l, l + 32, ... against x in shared
// memory, in that order, then a warp sum: deterministic), hands the sums to
// the epilogue and refills the stage with the unit `stages` on. Dynamic
// shared memory: x (cols BF16, rounded up to 128 bytes), then the ring.
// With one block an SM, each block can afford to make x itself while the
// ring fills: the input projections take the residual row and normalize it
// (NormX), so RMSNorm needs no launch of its own.
#define STREAM_STAGES_MAX 32

// x as it is (cols BF16) into shared memory at xs.
struct CopyX {
    const bf16* x;
    int cols;
    __device__ __forceinline__ void operator()(u32 xs) const {
        for (int c = threadIdx.x; c < cols >> 3; c += blockDim.x) {
            const uint4 v = __ldg((const uint4*)x + c);
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(xs + 16 * c), "r"(v.x), "r"(v.y), "r"(v.z),
                         "r"(v.w)
                         : "memory");
        }
    }
};

// bf16(x / rms(x) * w) of the f32 row x (cols a multiple of 4, at most
// RMS_THREADS * RMS_VEC * 4) into shared memory at xs: what rms_norm
// (layers.cu) writes, to the bit. Each warp takes the place of rms_norm's
// warps vw = warp, warp + warps, ... (its 32 threads' sums of squares, as
// there), and every warp then sums the 32 warps' sums in their order.
struct NormX {
    const float* x;
    const float* w;
    int cols;
    float eps;
    __device__ __forceinline__ void operator()(u32 xs) const {
        __shared__ float warp_sums[RMS_THREADS / 32];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5, quads = cols >> 2;
        const float4* x4 = (const float4*)x;
        const float4* w4 = (const float4*)w;
        for (int vw = warp; vw < RMS_THREADS / 32; vw += warps) {
            float ss = 0.0f;
#pragma unroll
            for (int k = 0; k < RMS_VEC; k++) {
                const int i = vw * 32 + lane + k * RMS_THREADS;
                ss += i < quads ? sum_sq4(x4[i]) : 0.0f;
            }
            ss = warp_sum(ss);
            if (lane == 0) warp_sums[vw] = ss;
        }
        __syncthreads();
        const float scale = rms_scale(warp_sum(warp_sums[lane]), cols, eps);
        for (int i = threadIdx.x; i < quads; i += blockDim.x) {
            const uint2 v = rms_scaled_bf16x4(x4[i], scale, w4[i]);
            asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(xs + 8 * i), "r"(v.x), "r"(v.y) : "memory");
        }
    }
};

// Row r of unit u: u * R + r (adjacent rows), or u + r * second_at.
template <int R, class LoadX, class Epilogue>
__device__ __forceinline__ void gemv_stream(const bf16* __restrict__ w, int units, int cols, int stages, int second_at,
                                            LoadX load_x, Epilogue epilogue) {
    extern __shared__ __align__(128) unsigned char stream_smem[];
    __shared__ __align__(8) u64 landed[STREAM_STAGES_MAX];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int first = (int)((u64)blockIdx.x * units / gridDim.x);
    const int count = (int)((u64)(blockIdx.x + 1) * units / gridDim.x) - first;
    const u32 row_bytes = (u32)cols * 2, unit_bytes = R * row_bytes;
    const u32 xs = smem_u32(stream_smem), ring = xs + ((row_bytes + 127) & ~127u);
    const u32 bars = smem_u32(landed);
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) mbar_init(bars + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Unit i of this block into its stage (one lane).
    auto issue = [&](int i) {
        const int s = i % stages, u = first + i;
        const u32 bar = bars + 8 * s, dst = ring + (u32)s * unit_bytes;
        mbar_arrive_expect_bytes(bar, unit_bytes);
        if (second_at == 0) {
            bulk_copy_to_shared(dst, w + (u64)u * R * cols, unit_bytes, bar);
        } else {
#pragma unroll
            for (int r = 0; r < R; r++)
                bulk_copy_to_shared(dst + r * row_bytes, w + (u64)(u + r * second_at) * cols, row_bytes, bar);
        }
    };
    if (lane == 0)
        for (int i = warp; i < min(count, stages); i += warps) issue(i);
    load_x(xs);  // while the ring fills
    __syncthreads();
    const int chunks = cols >> 3;
    for (int i = warp; i < count; i += warps) {
        const int s = i % stages;
        mbar_wait(bars + 8 * s, (u32)(i / stages) & 1u);
        const u32 stage = ring + (u32)s * unit_bytes;
        float sums[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            float acc = 0.0f;
#pragma unroll 4
            for (int c = lane; c < chunks; c += 32) {
                float xf[8];
                unpack8(lds128(xs + 16 * c), xf);
                acc += dot8(lds128(stage + r * row_bytes + 16 * c), xf);
            }
            sums[r] = warp_sum(acc);
        }
        __syncwarp();  // every lane has read the stage
        if (lane == 0) {
            if (i + stages < count) {
                // The stage's reads (generic proxy) before the copy's writes (async proxy).
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                issue(i + stages);
            }
            epilogue(first + i, sums);
        }
    }
}

// Grid: one block an SM (at most one a unit), a warp a stage up to 8,
// shared memory as above; compute::cuda::device's `stream_shape` picks them.
// y[u] (+)= w[u] . x.
extern "C" __global__ void __launch_bounds__(256) gemv_stream_n1(const bf16* __restrict__ w, const bf16* __restrict__ x,
                                                                 float* __restrict__ y, int rows, int cols,
                                                                 int accumulate, int stages) {
    wait_for_previous_kernels();
    gemv_stream<1>(w, rows, cols, stages, 0, CopyX{x, cols}, [&](int u, const float (&s)[1]) {
        y[u] = accumulate ? y[u] + s[0] : s[0];
    });
}

// RMSNorm of the residual row x, then gemv_rope_n1's work (QKV rows in RoPE
// pairs): what rms_norm and gemv_stream_n1 and rope_store_kv give.
extern "C" __global__ void __launch_bounds__(256) gemv_stream_norm_rope_n1(
    const bf16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ norm_w, float eps, int rows,
    int cols, int stages, const int* __restrict__ positions, const int* __restrict__ slots, bf16* __restrict__ q_out,
    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int n_heads, int n_kv_heads, int head_dim, float theta) {
    wait_for_previous_kernels();
    const RopeKvOut o{positions, slots, q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim, theta};
    gemv_stream<2>(w, rows / 2, cols, stages, 0, NormX{x, norm_w, cols, eps},
                   [&](int u, const float (&s)[2]) { rope_kv_pair(o, 0, 2 * u, s[0], s[1]); });
}

// RMSNorm of the residual row x, then gemv_swiglu_n1's work (gate row b and
// up row ffn + b): what rms_norm, gemv_stream_n1 and silu_mul give.
extern "C" __global__ void __launch_bounds__(256) gemv_stream_norm_swiglu_n1(
    const bf16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ norm_w, float eps, int ffn,
    int cols, int stages, bf16* __restrict__ out) {
    wait_for_previous_kernels();
    gemv_stream<2>(w, ffn, cols, stages, ffn, NormX{x, norm_w, cols, eps},
                   [&](int u, const float (&s)[2]) { out[u] = f32_to_bf16(silu_times(s[0], s[1])); });
}
