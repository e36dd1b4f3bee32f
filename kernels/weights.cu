// Weights onto the device as bf16: from f32, from llama.cpp's Q4_1 and Q8_0
// blocks (dequantized here, on the GPU), or generated (synthetic models).
// With col_scale (not null), element i is first multiplied by col_scale[i %
// cols] in f32 and rounded to bf16 once: an RMSNorm's weights folded into the
// input projection after it (compute::cuda::model).

__device__ __forceinline__ float col_scaled(float v, const float* __restrict__ col_scale, u64 i, u64 cols) {
    return col_scale ? v * col_scale[i % cols] : v;
}

// out[i] = bf16(in[i]).
extern "C" __global__ void f32_to_bf16_array(const float* __restrict__ in, bf16* __restrict__ out, u64 n,
                                             const float* __restrict__ col_scale, u64 cols) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(col_scaled(in[i], col_scale, i, cols));
}

// Q4_1: per block of 32, w[j] = (q[j] & 15) * d + m and w[j + 16] = (q[j] >> 4) * d + m,
// for j < 16 (the CPU's Weight::Quant layout: scales, mins, 16 bytes per block).
extern "C" __global__ void dequant_q4_1(const float* __restrict__ scales, const float* __restrict__ mins,
                                        const unsigned char* __restrict__ qs, bf16* __restrict__ out, u64 blocks,
                                        const float* __restrict__ col_scale, u64 cols) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < blocks * 16; i += (u64)gridDim.x * blockDim.x) {
        const u64 b = i >> 4;
        const int j = (int)(i & 15);
        const unsigned char q = qs[i];
        const float d = scales[b], m = mins[b];
        const u64 lo = b * 32 + j, hi = lo + 16;
        out[lo] = f32_to_bf16(col_scaled((float)(q & 15) * d + m, col_scale, lo, cols));
        out[hi] = f32_to_bf16(col_scaled((float)(q >> 4) * d + m, col_scale, hi, cols));
    }
}

// Q8_0: w = q * d, 32 signed bytes per block.
extern "C" __global__ void dequant_q8_0(const float* __restrict__ scales, const signed char* __restrict__ qs,
                                        bf16* __restrict__ out, u64 blocks, const float* __restrict__ col_scale,
                                        u64 cols) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < blocks * 32; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(col_scaled((float)qs[i] * scales[i >> 5], col_scale, i, cols));
}

// Uniform in [-scale, scale): element i from splitmix64(seed + i).
extern "C" __global__ void fill_uniform_bf16(bf16* __restrict__ out, u64 n, u64 seed, float scale) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = splitmix64(seed + i);
        const float unit = (float)(r >> 40) * (1.0f / 16777216.0f);  // 24 bits in [0, 1)
        out[i] = f32_to_bf16((2.0f * unit - 1.0f) * scale);
    }
}

// Random bits (synthetic FP4 codes): word i is splitmix64(seed + i)'s top 32.
extern "C" __global__ void fill_random_u32(u32* __restrict__ out, u64 n, u64 seed) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = (u32)(splitmix64(seed + i) >> 32);
}
