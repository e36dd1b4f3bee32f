// FP4 weights (MXFP4, NVFP4): y[j, r] (+)= row_scale[r] * sum_c w[r, c] x[j, c]
// for n tokens, BF16 activations, f32 out (added to y with `accumulate`,
// for the residual stream). Built for decode (1 to 64 tokens). Weight-only
// quantization on Hopper: the E2M1 codes are dequantized in registers and
// multiplied on the BF16 tensor cores (mma.sync m16n8k16), so a step reads
// 4.25 (MX) or 4.5 (NV) bits per weight instead of 16.
//
// Layout (backend/src/compute/fp4.rs): codes row-major, two per byte, element
// 2i in the low nibble of byte i; one scale byte per 32 (MX, E8M0) or 16 (NV,
// E4M3) elements of a row; NV's fp32 tensor scale comes in row_scale (one per
// row, so that matrices quantized apart, Q, K and V say, run as one).
//
// A block of 8 warps takes 16 rows and NT * 8 tokens (blockIdx.y: rows,
// blockIdx.x: tokens, so that the blocks sharing a weight tile run together
// and read it from DRAM once); its warps split the columns in chunks of 128
// (warp w takes chunks w, w + 8, ...), UNROLL chunks in flight; a row's last
// chunk may be partial (cols a multiple of 32: a lane's 32 columns are all in
// or all out). (With 4
// warps the 384 blocks of an 8B model's qkv filled 0.48 waves of the H200's
// SMs: 11 warps an SM, 20% of DRAM bandwidth under ncu.) In a chunk
// lane (g = lane / 4, t = lane % 4) loads 16 bytes (32 codes) of rows g and
// g + 8 at columns 32t .. 32t + 31, and the same 32 columns of x for token g
// of each 8-token tile. The dot product does not care in which order the
// columns are summed, so mma step j (of 8) gives the A fragment's columns
// {2t, 2t+1, 2t+8, 2t+9} the codes {2h, 2h+4, 2h+1, 2h+5} of 32-bit word
// q = j / 2 (h = j % 2), and the B fragment the same columns of x: the two
// codes of a bf16x2 pair then sit at the same place in each 16-bit half, so
// one shift and mask places both. Partial sums meet in shared memory in a
// fixed order (deterministic).

// A pair of E2M1 codes as bf16x2 times 2^-126: the magnitude bits (e e m) go
// to bf16 bits 8..6 (exponent 0..3 with the top mantissa bit, subnormal at
// e = 0 exactly as E2M1 is), the sign to bit 15; `p` is the low code's bit
// position in `w` (the high code's is p + 16).
template <int P>
__device__ __forceinline__ u32 e2m1x2_bits(u32 w) {
    const u32 mag = P <= 6 ? (w << (6 - P)) : (w >> (P - 6));
    const u32 sign = P <= 12 ? (w << (12 - P)) : (w >> (P - 12));
    return (mag & 0x01c001c0u) | (sign & 0x80008000u);
}

// An E2M1 code's value.
__device__ __forceinline__ float e2m1_value(u32 code) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = mag[code & 7u];
    return code & 8u ? -v : v;
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The bits above are the E2M1 value times 2^-126. One multiply by the block's
// scale times 2^126 (folded in here, per block, not per weight) makes the
// weight; as that can pass bf16's range, the host picks a power of two
// 2^-shift to fold in as well and multiplies the sums back (out_pow2).

// An E8M0 scale code times 2^(126 - shift) as bf16 bits (a power of two:
// exact, or 0 below bf16's smallest subnormal).
__device__ __forceinline__ u32 e8m0_bf16(u32 e, int shift) {
    if (e == 255u) return 0x7fc0u;  // NaN
    const int k = (int)e - 1 - shift;  // 2^k, built exactly
    const float v = k >= -126 ? __int_as_float((k + 127) << 23) : (k >= -149 ? __int_as_float(1 << (k + 149)) : 0.0f);
    return f32_to_bf16(v);
}

// An E4M3 scale code times 2^118 as bf16 bits (exact: three mantissa bits;
// 448 * 2^118 is below 2^127). The host folds the missing 2^8 into out_pow2.
__device__ __forceinline__ u32 e4m3_bf16(u32 c) {
    const u32 sign = (c & 0x80u) << 24, e = (c >> 3) & 0xfu, m = c & 7u;
    if (e == 0xfu && m == 7u) return 0x7fc0u;  // NaN
    // value * 2^118: normal 2^(e-7) (1 + m/8) -> exponent e - 7 + 118 + 127;
    // subnormal m * 2^-9 -> m * 2^109.
    const float v = e == 0u ? (float)m * 6.49037107e32f : __uint_as_float(((e + 238u) << 23) | (m << 20));
    return (sign | __float_as_uint(v)) >> 16;
}

__device__ __forceinline__ void mma_bf16_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 word(uint4 v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

// One mma step (j = 2q + h) of a 16-row tile, codes of rows g and g + 8 in
// words wa and wb, their scales (bf16x2) sa and sb, x's words xa (columns
// 8q + 2h, +1) and xb (8q + 2h + 4, +5).
template <int H>
__device__ __forceinline__ void fp4_step(float* c, u32 wa, u32 wb, u32 sa, u32 sb, u32 xa, u32 xb) {
    const u32 a0 = mul_bf16x2(e2m1x2_bits<8 * H>(wa), sa);
    const u32 a1 = mul_bf16x2(e2m1x2_bits<8 * H>(wb), sb);
    const u32 a2 = mul_bf16x2(e2m1x2_bits<8 * H + 4>(wa), sa);
    const u32 a3 = mul_bf16x2(e2m1x2_bits<8 * H + 4>(wb), sb);
    mma_bf16_16816(c, a0, a1, a2, a3, __byte_perm(xa, xb, 0x5410), __byte_perm(xa, xb, 0x7632));
}

template <bool NV, int NT, int UNROLL, int WARPS>
__device__ __forceinline__ void fp4_gemv(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
                                         const float* __restrict__ row_scale, const bf16* __restrict__ x,
                                         float* __restrict__ y, int n, int rows, int cols, float out_pow2, int shift,
                                         int accumulate) {
    __shared__ float partial[WARPS][NT][32][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.y * 16, ra = row0 + g, rb = row0 + g + 8;
    const int tok0 = blockIdx.x * NT * 8;
    x += (u64)tok0 * cols;
    y += (u64)tok0 * rows;
    n -= tok0;
    const int chunks = (cols + 127) >> 7, per_row_scales = cols / (NV ? 16 : 32);
    const u64 row_bytes = (u64)cols >> 1;
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    for (int c0 = warp; c0 < chunks; c0 += WARPS * UNROLL) {
        uint4 wa[UNROLL], wb[UNROLL];
        u32 sa[UNROLL], sb[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + WARPS * u, k = (c << 7) + 32 * t;
            const bool in = c < chunks && k < cols;
            wa[u] = in && ra < rows ? __ldg((const uint4*)(codes + ra * row_bytes + (k >> 1))) : make_uint4(0, 0, 0, 0);
            wb[u] = in && rb < rows ? __ldg((const uint4*)(codes + rb * row_bytes + (k >> 1))) : make_uint4(0, 0, 0, 0);
            if (NV) {
                sa[u] = in && ra < rows ? __ldg((const unsigned short*)(scales + (u64)ra * per_row_scales + (k >> 4))) : 0u;
                sb[u] = in && rb < rows ? __ldg((const unsigned short*)(scales + (u64)rb * per_row_scales + (k >> 4))) : 0u;
            } else {
                sa[u] = in && ra < rows ? __ldg(scales + (u64)ra * per_row_scales + (k >> 5)) : 0u;
                sb[u] = in && rb < rows ? __ldg(scales + (u64)rb * per_row_scales + (k >> 5)) : 0u;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + WARPS * u, k = (c << 7) + 32 * t;
            if (c >= chunks) break;
            // Scales as bf16x2: NV has one per 16 columns (words 0-1, 2-3).
            u32 sa_lo, sa_hi, sb_lo, sb_hi;
            if (NV) {
                u32 v = e4m3_bf16(sa[u] & 0xffu);
                sa_lo = v | (v << 16);
                v = e4m3_bf16(sa[u] >> 8);
                sa_hi = v | (v << 16);
                v = e4m3_bf16(sb[u] & 0xffu);
                sb_lo = v | (v << 16);
                v = e4m3_bf16(sb[u] >> 8);
                sb_hi = v | (v << 16);
            } else {
                u32 v = e8m0_bf16(sa[u], shift);
                sa_lo = sa_hi = v | (v << 16);
                v = e8m0_bf16(sb[u], shift);
                sb_lo = sb_hi = v | (v << 16);
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int j = nt * 8 + g;
                uint4 xv[4];
#pragma unroll
                for (int i = 0; i < 4; i++)
                    xv[i] = j < n && k < cols ? __ldg((const uint4*)(x + (u64)j * cols + k + 8 * i)) : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const u32 wqa = word(wa[u], q), wqb = word(wb[u], q);
                    const u32 s_a = q < 2 ? sa_lo : sa_hi, s_b = q < 2 ? sb_lo : sb_hi;
                    // x words of columns 8q + 0..7: word(xv[q], 0..3).
                    fp4_step<0>(acc[nt], wqa, wqb, s_a, s_b, word(xv[q], 0), word(xv[q], 2));
                    fp4_step<1>(acc[nt], wqa, wqb, s_a, s_b, word(xv[q], 1), word(xv[q], 3));
                }
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) partial[warp][nt][lane][i] = acc[nt][i];
    __syncthreads();
    if (warp == 0) {  // the fixed order of the sum keeps it deterministic
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8.
                const int row = i < 2 ? ra : rb, j = nt * 8 + 2 * t + (i & 1);
                float s = 0.0f;
#pragma unroll
                for (int w = 0; w < WARPS; w++) s += partial[w][nt][lane][i];
                if (row < rows && j < n) {
                    const float v = s * out_pow2 * row_scale[row];
                    float* out = y + (u64)j * rows + row;
                    *out = accumulate ? *out + v : v;
                }
            }
    }
}

// cols a multiple of 32; 8 (n8) to 64 (n64) tokens a block: the block
// dequantizes its weights once for all of them. (Blocks of 16 tokens side by
// side, each dequantizing the same tile, ran batch 64 at a third of the rate.)
#define FP4_ARGS const unsigned char *__restrict__ codes, const unsigned char *__restrict__ scales, \
                 const float *__restrict__ row_scale, const bf16 *__restrict__ x, float *__restrict__ y, int n, \
                 int rows, int cols, float out_pow2, int shift, int accumulate
#define FP4_PASS codes, scales, row_scale, x, y, n, rows, cols, out_pow2, shift, accumulate
// 256 threads a block (FP4_WARPS in fp4.rs).
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_mx_n8(FP4_ARGS) { fp4_gemv<false, 1, 4, 8>(FP4_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_mx_n16(FP4_ARGS) { fp4_gemv<false, 2, 4, 8>(FP4_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_nv_n8(FP4_ARGS) { fp4_gemv<true, 1, 4, 8>(FP4_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_nv_n16(FP4_ARGS) { fp4_gemv<true, 2, 4, 8>(FP4_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_mx_n32(FP4_ARGS) { fp4_gemv<false, 4, 2, 8>(FP4_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_nv_n32(FP4_ARGS) { fp4_gemv<true, 4, 2, 8>(FP4_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_mx_n64(FP4_ARGS) { fp4_gemv<false, 8, 2, 8>(FP4_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemv_nv_n64(FP4_ARGS) { fp4_gemv<true, 8, 2, 8>(FP4_PASS); }

// The weights as BF16 (for the GEMMs of many tokens): out[r, c] =
// E2M1 * scale * row_scale[r], with the scales' true values (no 2^126 trick).
extern "C" __global__ void fp4_to_bf16(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
                                       const float* __restrict__ row_scale, bf16* __restrict__ out, int rows, int cols,
                                       int nv) {
    const u64 pairs = (u64)rows * cols / 2;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < pairs; i += (u64)gridDim.x * blockDim.x) {
        const u64 e = 2 * i, r = e / cols;
        const u32 byte = codes[i];
        const u32 sc = scales[e / (nv ? 16 : 32)];
        float scale;
        if (nv) {
            const u32 ex = (sc >> 3) & 0xfu, m = sc & 7u;
            scale = ex == 0u ? (float)m * 0.001953125f : __uint_as_float(((ex + 120u) << 23) | (m << 20));
            if (sc & 0x80u) scale = -scale;
            if (ex == 0xfu && m == 7u) scale = __int_as_float(0x7fc00000);
        } else {
            scale = sc == 255u ? __int_as_float(0x7fc00000) : (sc == 0u ? __int_as_float(0x00400000) : __uint_as_float(sc << 23));
        }
        scale *= row_scale[r];
        out[e] = f32_to_bf16(e2m1_value(byte & 15u) * scale);
        out[e + 1] = f32_to_bf16(e2m1_value(byte >> 4) * scale);
    }
}
