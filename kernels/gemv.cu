// Skinny GEMMs for decode (n <= 8 tokens): y[j, r] = sum_c w[r, c] x[j, c]
// (+ y[j, r] when accumulate), BF16 weights and activations, f32 out. The
// weights are read once, 16 bytes per thread per load, UNROLL loads per row
// in flight, so enough bytes are in the air to keep HBM busy; x (a few KB)
// comes from L1. cols must be a multiple of 8. This is also the shape the FP4
// kernels take (dequantize in registers, then the same sums).

__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    return bf16_lo(w.x) * x[0] + bf16_hi(w.x) * x[1] + bf16_lo(w.y) * x[2] + bf16_hi(w.y) * x[3] +
           bf16_lo(w.z) * x[4] + bf16_hi(w.z) * x[5] + bf16_lo(w.w) * x[6] + bf16_hi(w.w) * x[7];
}

__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

// A block of 4 warps takes ROWS rows; its 128 threads split the columns
// (thread t reads columns 8t .. 8t + 7 of every 1024), so short and long rows
// alike give many blocks and many loads in flight; partial sums meet in shared
// memory in a fixed order (deterministic).
template <int N, int ROWS, int UNROLL>
__device__ __forceinline__ void gemv(const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y,
                                     int n, int rows, int cols, int accumulate) {
    constexpr int THREADS = 128, STEP = THREADS * 8;
    __shared__ float partial[THREADS / 32][ROWS][N];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * ROWS;
    float acc[ROWS][N];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int j = 0; j < N; j++) acc[r][j] = 0.0f;
    for (int c0 = threadIdx.x * 8; c0 < cols; c0 += STEP * UNROLL) {
        uint4 wv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * STEP;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                wv[u][r] = (c < cols && row0 + r < rows)
                               ? __ldg((const uint4*)(w + (u64)(row0 + r) * cols + c))
                               : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * STEP;
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
    for (int i = threadIdx.x; i < ROWS * N; i += THREADS) {
        const int r = i / N, j = i % N;
        if (j < n && row0 + r < rows) {
            float s = 0.0f;
#pragma unroll
            for (int wi = 0; wi < THREADS / 32; wi++) s += partial[wi][r][j];
            float* out = y + (u64)j * rows + row0 + r;
            *out = accumulate ? *out + s : s;
        }
    }
}

// Rows per block: N=1: 2, N=2: 4, N=4: 4, N=8: 8 (keep in step with device.rs).
#define GEMV_ARGS const bf16 *__restrict__ w, const bf16 *__restrict__ x, float *__restrict__ y, int n, int rows, \
                  int cols, int accumulate
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n1(GEMV_ARGS) { gemv<1, 2, 4>(w, x, y, n, rows, cols, accumulate); }
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n2(GEMV_ARGS) { gemv<2, 4, 2>(w, x, y, n, rows, cols, accumulate); }
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n4(GEMV_ARGS) { gemv<4, 4, 2>(w, x, y, n, rows, cols, accumulate); }
extern "C" __global__ void __launch_bounds__(128) gemv_bf16_n8(GEMV_ARGS) { gemv<8, 8, 1>(w, x, y, n, rows, cols, accumulate); }
