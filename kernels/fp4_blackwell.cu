// FP4 on Blackwell (sm_100a, sm_103a: B200, B300): block-scaled MMA through
// tcgen05, both operands FP4. COMPILE-CHECKED ONLY: CI compiles this file for
// both targets with NVRTC and ptxas, but no Blackwell GPU has run it (our
// measurements are on H200, where the engine takes fp4.cu's mma.sync path).
// nvrtc.rs builds it for the Blackwell targets alone.
//
// The weights are the same files as on Hopper (codes in the file's order,
// element 2i in the low nibble of byte i; one scale byte per 32 (MXFP4,
// E8M0) or 16 (NVFP4, E4M3) elements of a row; NVFP4's fp32 tensor scale per
// row). What differs is the activations: the tensor cores take E2M1 on both
// sides, so x is quantized first (fp4.cu's fp4_quantize_act_*: per token, in
// the weights' format, with the CPU quantizer's rules; tested on the H200),
// and the product is W4A4 where Hopper's is W4A16.
//
// fp4_tc05_gemm_*: a block of 4 warps takes 128 weight rows (the MMA's M,
// one TMEM lane each) and 64 tokens (N: the accumulator is 64 f32 columns of
// tensor memory). K goes 256 columns a step: codes of both operands
// (cp.async into shared memory in the canonical K-major layout without
// swizzle: 8-row x 16-byte core matrices, SBO = 128 bytes between row
// groups, LBO = a 16-byte column of core matrices), and the scale bytes
// in 128-row x 4-byte atoms (row r at (r % 32) * 16 + (r / 32) * 4), which
// tcgen05.cp copies into tensor memory (32x128b, replicated to the four lane
// quarters). Thread 0 issues the copies and four MMAs of K = 64 and commits
// them to the step's mbarrier; two stages, so the next step's loads run
// while the tensor cores work on this one. The epilogue reads the
// accumulator lane by lane (tcgen05.ld 32x32b) and applies the tensor scales.
// cols a multiple of 256. The descriptors, operand order and barriers were
// checked against the PTX ISA's tables; the scale factors' place in tensor
// memory (row r in lane r % 32, column r / 32) follows CUTLASS, not PTX
// text: if a Blackwell run ever gets rows 32-127 or tokens 32-63 wrong, look
// there first.

#define TC05_ROWS 128
#define TC05_TOKENS 64
#define TC05_KSTEP 256                          // columns a step: 128 bytes a row
#define TC05_A_BYTES (TC05_ROWS * 128)           // 16 KB
#define TC05_B_BYTES (TC05_TOKENS * 128)         // 8 KB
#define TC05_ATOM 512                            // 128 rows x 4 scale bytes
#define TC05_STAGE_BYTES (TC05_A_BYTES + TC05_B_BYTES + 8 * TC05_ATOM)
#define TC05_TMEM_COLS 128                       // 64 accumulator + 2 stages x 32 scale columns

// A shared-memory matrix descriptor (sm_100): start address, leading
// (K-direction) and stride (row-group) byte offsets, all >> 4; bits 46-47 =
// 1 (the Blackwell descriptor version); layout 0 = no swizzle.
__device__ __forceinline__ u64 tc05_desc(const void* p, u32 lbo, u32 sbo) {
    return (u64)((smem_u32(p) >> 4) & 0x3fffu) | ((u64)((lbo >> 4) & 0x3fffu) << 16) |
           ((u64)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 46);
}

// The instruction descriptor of a block-scaled MMA, M = 128, N = 64, both
// operands E2M1 (code 1) and K-major: scale format UE4M3 (NV) or UE8M0 (MX),
// and the byte of each scale column the MMA starts at (sf_id).
template <bool NV>
__device__ __forceinline__ u32 tc05_idesc(u32 sf_id) {
    return (1u << 7) | (1u << 10) | ((u32)(TC05_TOKENS >> 3) << 17) | ((NV ? 0u : 1u) << 23) |
           ((u32)(TC05_ROWS >> 4) << 24) | (sf_id << 29) | (sf_id << 4);
}

// Waits until the mbarrier's phase of the given parity has completed.
__device__ __forceinline__ void tc05_wait(u32 mbar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(mbar), "r"(parity)
            : "memory");
}

// ROWS rows of codes (first .. first + ROWS - 1, zeros past `limit`), 128
// bytes each from byte `kbyte` of the row, in the K-major layout without
// swizzle: 16-byte chunk c of row r at c * LBO + (r / 8) * 128 + (r % 8) * 16,
// LBO = ROWS * 16 (the whole column of core matrices).
template <int ROWS>
__device__ __forceinline__ void tc05_load_codes(unsigned char* dst, const unsigned char* __restrict__ src, int first,
                                                int limit, u64 row_bytes, u64 kbyte) {
#pragma unroll
    for (int i = threadIdx.x; i < ROWS * 8; i += 128) {
        const int r = i >> 3, c = i & 7;
        const bool in = first + r < limit;
        cp_async16(dst + c * ROWS * 16 + (r >> 3) * 128 + (r & 7) * 16,
                   in ? src + (u64)(first + r) * row_bytes + kbyte + c * 16 : src, in ? 16 : 0);
    }
}

// One K step into stage `st`: the weights' 128 rows and the tokens' 64 rows
// of codes, and their scale atoms (NV: 4, one per MMA of 64 columns; MX: 2,
// one per two MMAs).
template <bool NV>
__device__ __forceinline__ void tc05_load(unsigned char* stage, const unsigned char* __restrict__ wcodes,
                                          const unsigned char* __restrict__ wscales,
                                          const unsigned char* __restrict__ xcodes,
                                          const unsigned char* __restrict__ xscales, int row0, int tok0, int rows,
                                          int n, int cols, int step) {
    constexpr int BLOCK = NV ? 16 : 32, ATOMS = NV ? 4 : 2;
    const u64 row_bytes = (u64)cols >> 1, row_scales = (u64)cols / BLOCK;
    const int tid = threadIdx.x;
    unsigned char* a = stage;
    unsigned char* b = a + TC05_A_BYTES;
    unsigned char* sfa = b + TC05_B_BYTES;
    unsigned char* sfb = sfa + 4 * TC05_ATOM;
    const u64 kbyte = (u64)step * 128;
    tc05_load_codes<TC05_ROWS>(a, wcodes, row0, rows, row_bytes, kbyte);
    tc05_load_codes<TC05_TOKENS>(b, xcodes, tok0, n, row_bytes, kbyte);
    // Thread t takes row t of every atom: 4 scale bytes (NV: 64 columns; MX: 128).
    const u64 s0 = (u64)step * (TC05_KSTEP / BLOCK);
    const int at = (tid & 31) * 16 + (tid >> 5) * 4;
    const bool win = row0 + tid < rows, xin = tid < TC05_TOKENS && tok0 + tid < n;
#pragma unroll
    for (int q = 0; q < ATOMS; q++) {
        cp_async4(sfa + q * TC05_ATOM + at, win ? wscales + (u64)(row0 + tid) * row_scales + s0 + 4 * q : wscales,
                  win ? 4 : 0);
        cp_async4(sfb + q * TC05_ATOM + at, xin ? xscales + (u64)(tok0 + tid) * row_scales + s0 + 4 * q : xscales,
                  xin ? 4 : 0);
    }
}

template <bool NV>
__device__ __forceinline__ void fp4_tc05_gemm(const unsigned char* __restrict__ wcodes,
                                              const unsigned char* __restrict__ wscales,
                                              const float* __restrict__ row_scale,
                                              const unsigned char* __restrict__ xcodes,
                                              const unsigned char* __restrict__ xscales,
                                              const float* __restrict__ act_scale, float* __restrict__ y, int n,
                                              int rows, int cols, int accumulate) {
    constexpr int ATOMS = NV ? 4 : 2;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 mbar[2];
    __shared__ u32 tmem_base;
    const int tid = threadIdx.x, warp = tid >> 5;
    const int row0 = blockIdx.y * TC05_ROWS, tok0 = blockIdx.x * TC05_TOKENS;
    const int steps = cols / TC05_KSTEP;

    if (warp == 0) {
        asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;" ::"r"(smem_u32(&tmem_base)),
                     "r"(TC05_TMEM_COLS));
        asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;");
    }
    if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&mbar[0])));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&mbar[1])));
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    asm volatile("tcgen05.fence::before_thread_sync;");
    __syncthreads();
    asm volatile("tcgen05.fence::after_thread_sync;");
    const u32 tmem = tmem_base;  // accumulator: columns 0-63; scales from column 64

    tc05_load<NV>(smem, wcodes, wscales, xcodes, xscales, row0, tok0, rows, n, cols, 0);
    asm volatile("cp.async.commit_group;");
    for (int it = 0; it < steps; it++) {
        const int st = it & 1;
        if (it + 1 < steps) {
            // The other stage was last read by step it - 1's MMAs and copies.
            if (it >= 1) tc05_wait(smem_u32(&mbar[st ^ 1]), ((it - 1) >> 1) & 1);
            tc05_load<NV>(smem + (st ^ 1) * TC05_STAGE_BYTES, wcodes, wscales, xcodes, xscales, row0, tok0, rows, n,
                          cols, it + 1);
        }
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group 1;");
        // This thread's copies are in; make them visible to the tensor
        // cores (the async proxy), then to thread 0.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (tid == 0) {
            asm volatile("tcgen05.fence::after_thread_sync;");
            const unsigned char* stage = smem + st * TC05_STAGE_BYTES;
            const unsigned char* a = stage;
            const unsigned char* b = a + TC05_A_BYTES;
            const unsigned char* sfa = b + TC05_B_BYTES;
            const unsigned char* sfb = sfa + 4 * TC05_ATOM;
            const u32 sf_cols = tmem + 64 + st * 32;  // SFA: 4 columns an atom; SFB 16 columns on
#pragma unroll
            for (int q = 0; q < ATOMS; q++) {
                asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;" ::"r"(sf_cols + 4 * q),
                             "l"(tc05_desc(sfa + q * TC05_ATOM, TC05_ATOM, 128)));
                asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;" ::"r"(sf_cols + 16 + 4 * q),
                             "l"(tc05_desc(sfb + q * TC05_ATOM, TC05_ATOM, 128)));
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                // MMA k: columns 64k .. 64k + 63 of the step, code columns 2k
                // and 2k + 1 of 16 bytes.
                const u64 ad = tc05_desc(a + 2 * k * (TC05_A_BYTES / 8), TC05_A_BYTES / 8, 128);
                const u64 bd = tc05_desc(b + 2 * k * (TC05_B_BYTES / 8), TC05_B_BYTES / 8, 128);
                const int q = NV ? k : k >> 1;
                const u32 id = tc05_idesc<NV>(NV ? 0u : 2u * (k & 1));
                const u32 sfa_at = sf_cols + 4 * q, sfb_at = sf_cols + 16 + 4 * q, acc = (it > 0 || k > 0) ? 1u : 0u;
                if (NV)
                    asm volatile(
                        "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %6, 0;\n\t"
                        "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X [%0], %1, %2, %3, [%4], "
                        "[%5], p;\n\t}" ::"r"(tmem),
                        "l"(ad), "l"(bd), "r"(id), "r"(sfa_at), "r"(sfb_at), "r"(acc));
                else
                    asm volatile(
                        "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %6, 0;\n\t"
                        "tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X [%0], %1, %2, %3, [%4], [%5], "
                        "p;\n\t}" ::"r"(tmem),
                        "l"(ad), "l"(bd), "r"(id), "r"(sfa_at), "r"(sfb_at), "r"(acc));
            }
            asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" ::"r"(
                smem_u32(&mbar[st])));
        }
    }
    tc05_wait(smem_u32(&mbar[(steps - 1) & 1]), ((steps - 1) >> 1) & 1);
    asm volatile("tcgen05.fence::after_thread_sync;");

    // Warp w reads lanes 32w .. 32w + 31 (rows), 16 token columns at a time.
    const int row = row0 + tid;
    const float rs = row < rows ? row_scale[row] : 0.0f;
#pragma unroll
    for (int c0 = 0; c0 < TC05_TOKENS; c0 += 16) {
        u32 v[16];
        asm volatile(
            "tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
            "%14, %15}, [%16];"
            : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]), "=r"(v[4]), "=r"(v[5]), "=r"(v[6]), "=r"(v[7]),
              "=r"(v[8]), "=r"(v[9]), "=r"(v[10]), "=r"(v[11]), "=r"(v[12]), "=r"(v[13]), "=r"(v[14]), "=r"(v[15])
            : "r"(tmem + ((u32)(warp * 32) << 16) + c0));
        asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int tok = tok0 + c0 + j;
            if (row < rows && tok < n) {
                const float r = __uint_as_float(v[j]) * rs * act_scale[tok];
                float* out = y + (u64)tok * rows + row;
                *out = accumulate ? *out + r : r;
            }
        }
    }
    asm volatile("tcgen05.fence::before_thread_sync;");
    __syncthreads();
    if (warp == 0)
        asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;" ::"r"(tmem), "r"(TC05_TMEM_COLS));
}

#define TC05_ARGS const unsigned char *__restrict__ wcodes, const unsigned char *__restrict__ wscales, \
                  const float *__restrict__ row_scale, const unsigned char *__restrict__ xcodes, \
                  const unsigned char *__restrict__ xscales, const float *__restrict__ act_scale, \
                  float *__restrict__ y, int n, int rows, int cols, int accumulate
#define TC05_PASS wcodes, wscales, row_scale, xcodes, xscales, act_scale, y, n, rows, cols, accumulate
// Grid (tokens / 64, rows / 128), 128 threads, 2 * TC05_STAGE_BYTES of
// dynamic shared memory (fp4_blackwell.rs).
extern "C" __global__ void __launch_bounds__(128) fp4_tc05_gemm_mx(TC05_ARGS) { wait_for_previous_kernels(); fp4_tc05_gemm<false>(TC05_PASS); }
extern "C" __global__ void __launch_bounds__(128) fp4_tc05_gemm_nv(TC05_ARGS) { wait_for_previous_kernels(); fp4_tc05_gemm<true>(TC05_PASS); }
