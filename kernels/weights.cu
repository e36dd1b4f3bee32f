// Weights onto the device as bf16: from f32, from llama.cpp's Q4_1 and Q8_0
// blocks (dequantized here, on the GPU), or generated (synthetic models).

// out[i] = bf16(in[i]).
extern "C" __global__ void f32_to_bf16_array(const float* __restrict__ in, bf16* __restrict__ out, u64 n) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(in[i]);
}

// Q4_1: per block of 32, w[j] = (q[j] & 15) * d + m and w[j + 16] = (q[j] >> 4) * d + m,
// for j < 16 (the CPU's Weight::Quant layout: scales, mins, 16 bytes per block).
extern "C" __global__ void dequant_q4_1(const float* __restrict__ scales, const float* __restrict__ mins,
                                        const unsigned char* __restrict__ qs, bf16* __restrict__ out, u64 blocks) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < blocks * 16; i += (u64)gridDim.x * blockDim.x) {
        const u64 b = i >> 4;
        const int j = (int)(i & 15);
        const unsigned char q = qs[i];
        const float d = scales[b], m = mins[b];
        out[b * 32 + j] = f32_to_bf16((float)(q & 15) * d + m);
        out[b * 32 + j + 16] = f32_to_bf16((float)(q >> 4) * d + m);
    }
}

// Q8_0: w = q * d, 32 signed bytes per block.
extern "C" __global__ void dequant_q8_0(const float* __restrict__ scales, const signed char* __restrict__ qs,
                                        bf16* __restrict__ out, u64 blocks) {
    wait_for_previous_kernels();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < blocks * 32; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16((float)qs[i] * scales[i >> 5]);
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
