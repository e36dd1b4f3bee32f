// Shared by every kernel file: the loader puts this text in front of each one
// (NVRTC is given no include paths, so the kernels need no CUDA headers).
//
// bf16 is carried as its 16 bits; conversions are written out here, rounding
// to nearest even as half::bf16 does on the host.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16 x) {
    return __uint_as_float(((u32)x) << 16);
}

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// The two bf16 halves of a 32-bit word: element 2i is the low half.
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = lane < warps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// splitmix64: the synthetic weights' generator (the host has the same, in
// compute::cuda::synthetic, to check against).
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Programmatic dependent launch (Hopper on; Gpu::launch asks for it on every
// launch): a kernel's blocks may start while the kernel ahead of it in the
// stream is still running, so that launching and ramping up overlap its tail.
// pdl_wait() blocks until the kernel ahead has finished and its writes are
// visible; every kernel calls it before it reads anything an earlier kernel
// wrote or writes anything one reads (only weights, which no step writes,
// may be read before). pdl_release() lets the next kernel start launching;
// as it launches only once every block of this one has released (or ended),
// its blocks take SM room only as this one's leave.
// (`kernels_wait_before_their_work` in nvrtc.rs checks that every kernel
// calls one of these.)
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Both, first thing: for kernels with nothing to do before their inputs.
__device__ __forceinline__ void pdl_enter() {
    pdl_release();
    pdl_wait();
}
