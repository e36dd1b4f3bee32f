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

// Reduces over the block (blockDim.x a multiple of 32, at most 1024) with
// the warp reduction `warp_op` and the identity `none`; every thread gets the
// result. `scratch` holds 32 floats of shared memory.
template <float (*warp_op)(float)>
__device__ __forceinline__ float block_reduce(float v, float none, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_op(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = lane < warps ? scratch[lane] : none;
    v = warp_op(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<warp_sum>(v, 0.0f, scratch); }
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<warp_max>(v, NEG_INF, scratch); }

// c += A . B on the BF16 tensor cores (m16n8k16, f32 accumulators): lane
// (g = lane / 4, t = lane % 4) holds A's rows g (a0, a2) and g + 8 (a1, a3)
// at columns {2t, 2t + 1} (a0, a1) and {2t + 8, 2t + 9} (a2, a3), B's column
// g at rows {2t, 2t + 1} (b0) and {2t + 8, 2t + 9} (b1), and c's rows g (c0,
// c1) and g + 8 (c2, c3) at columns {2t, 2t + 1}.
__device__ __forceinline__ void mma_bf16_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90 on). Outside CUDA graphs, Gpu::launch
// lets a kernel start before the one ahead of it on the stream has finished,
// so that its launch and its blocks' start overlap that kernel's tail (a step
// with a prefill chunk runs eagerly: ~260 launches at batch 1). The rule that
// keeps it correct: every kernel calls wait_for_previous_kernels() first, on
// every path, before it touches anything another kernel reads or writes. The
// wait returns once every kernel before it on the stream has finished and
// its writes are visible (so a kernel's end implies the end of all before
// it); then it lets the next kernel's blocks start, which wait in turn. A
// plain launch makes both instructions no-ops. A test (compute::cuda::device)
// checks that every kernel calls it first, but for two exceptions: the fused
// one-token and the 16-token FP4 GEMVs (fp4.cu) copy their first weights
// before they wait, and decode attention in clusters (attention.cu, EARLY)
// loads its first keys of earlier steps; both are programmatic launches
// inside decode graphs too (Gpu::launch_early, Gpu::launch_cluster_early),
// so that those reads run under the tail of the kernel ahead. That is sound
// because what they read before the wait was written before the kernel
// ahead began: no kernel writes weights except the synthetic models' random
// fill (fill_random_u32), which uploads follow on the stream (a copy between
// two kernels ends the overlap); earlier steps' keys and the step's upload
// precede it too; and the kernel ahead has passed its own wait, so every
// kernel before it has ended. (Measured and
// not kept: every kernel a programmatic launch inside decode graphs, 2%
// slower at batch 1; GEMVs prefetching their first weights into L2 before
// the wait, 13% slower; BENCHMARKS.md.)
__device__ __forceinline__ void wait_for_previous_kernels() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A shared-memory pointer as the 32-bit address PTX takes.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// Global -> shared, 16 (L2 only) or 4 bytes, to a shared address
// (smem_u32); `bytes` 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16_shared(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async4_shared(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
// The same to a shared pointer (fp4.cu's tiled GEMM, fp4_blackwell.cu).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    cp_async16_shared(smem_u32(dst), src, bytes);
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int bytes) {
    cp_async4_shared(smem_u32(dst), src, bytes);
}

// Thread block clusters (compute capability 9.0 on). cluster_sync: every
// thread of every block of the cluster arrives, and waits for all (release /
// acquire: shared-memory writes before it are visible to the cluster's reads
// after it). cluster_map: this block's shared address a, as the same address
// in block `rank`'s shared memory, for ld_cluster.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ u32 cluster_map(u32 a, u32 rank) {
    u32 r = a;
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
#endif
    return r;
}
__device__ __forceinline__ float ld_cluster(u32 a) {
    float v = 0.0f;
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a));
#endif
    return v;
}

// Shared loads from a shared address.
__device__ __forceinline__ uint4 lds128(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ u32 lds_u16(u32 a) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ u32 lds_u8(u32 a) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

// v, hidden from the compiler's rematerialization: a value derived from
// threadIdx (an address) is otherwise recomputed in every loop iteration
// that uses it rather than kept in a register.
__device__ __forceinline__ u32 opaque(u32 v) {
    asm volatile("" : "+r"(v));
    return v;
}
template <class T>
__device__ __forceinline__ const T* opaque(const T* p) {
    asm volatile("" : "+l"(p));
    return p;
}

// splitmix64: the synthetic weights' generator (the host has the same, in
// compute::cuda::synthetic, to check against).
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// The per-token steps that kernels of two files do (layers.cu on their own,
// gemv.cu fused after the decode GEMV), written once.

// silu(g) * u, SwiGLU's gate times its up projection.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Where one token's Q, K and V go after the QKV projection.
struct RopeKvOut {
    const int* positions;
    const int* slots;
    bf16* q_out;
    bf16* k_cache;
    bf16* v_cache;
    int n_heads, n_kv_heads, head_dim;
    float theta;
};

// One adjacent pair (at, at + 1) of token t's QKV row ([q | k | v], at even),
// values (a, b): a Q or K pair rotated by RoPE (pos * theta^(-2i / head_dim),
// i its pair in the head) and written as BF16 to q_out or the cache slot of
// the token; a V pair written as is.
// (rope_kv_pair_at: token t's cache slot and position given, loaded before.)
__device__ __forceinline__ void rope_kv_pair_at(const RopeKvOut& o, int t, u64 slot, int position, int at, float a,
                                                float b) {
    const int q_dim = o.n_heads * o.head_dim, kv_dim = o.n_kv_heads * o.head_dim;
    if (at >= q_dim + kv_dim) {
        *(u32*)(o.v_cache + slot * kv_dim + at - q_dim - kv_dim) = (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
        return;
    }
    const int i = (at % o.head_dim) / 2;
    const float freq = powf(o.theta, -2.0f * (float)i / (float)o.head_dim);
    float s, c;
    sincosf((float)position * freq, &s, &c);
    const u32 rotated = (u32)f32_to_bf16(a * c - b * s) | ((u32)f32_to_bf16(a * s + b * c) << 16);
    if (at < q_dim) {
        *(u32*)(o.q_out + (u64)t * q_dim + at) = rotated;
    } else {
        *(u32*)(o.k_cache + slot * kv_dim + at - q_dim) = rotated;
    }
}
__device__ __forceinline__ void rope_kv_pair(const RopeKvOut& o, int t, int at, float a, float b) {
    rope_kv_pair_at(o, t, (u64)o.slots[t], o.positions[t], at, a, b);
}
