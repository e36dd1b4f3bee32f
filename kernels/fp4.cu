// FP4 weights (MXFP4, NVFP4): y[j, r] (+)= row_scale[r] * sum_c w[r, c] x[j, c]
// for n tokens, BF16 activations, f32 out (added to y with `accumulate`,
// for the residual stream). A GEMV for up to 16 tokens a block, a tiled
// GEMM for more (below). Weight-only quantization on Hopper: the E2M1 codes are dequantized in registers and
// multiplied on the BF16 tensor cores (mma.sync m16n8k16), so a step reads
// 4.25 (MX) or 4.5 (NV) bits per weight instead of 16.
//
// Layout: codes row-major, 32 bits a group of 8 columns, encoded so that
// column pair p (columns 2p, 2p + 1) becomes a bf16x2 word (m0 e0 e1 at bits
// 6-8, s at 15; the high column 16 up) in one or two instructions, without
// the shifts of one pair serving another (fp4_pair_bits): pair 0 is the word
// masked, pair 1 the word shifted left by 6, pair 2 rotated left by 12, pair
// 3 the word shifted left by 2 XOR right by 6, each masked. No placement of
// the 32 code bits lets four shifts each place a pair (the shifted masks do
// not tile 32 bits), so pair 3's bits are stored XORed with bits of the
// other pairs: the decoding is linear over GF(2) and invertible, and
// Fp4Weights::stack writes each word as its inverse of the file's order
// (element 2i in the low nibble of byte i, backend/src/compute/fp4.rs). Four
// shifts and four AND/XORs (LOP3) a word; two of the shifts (the left ones)
// can run on the FMA pipe as IMAD.SHL. One scale byte
// per 32 (MX, E8M0) or 16 (NV, E4M3) elements of a row; NV's fp32 tensor
// scale comes in row_scale (one per row, so that matrices quantized apart,
// Q, K and V say, run as one).
//
// A block of 8 warps takes 16-row tiles (blockIdx.y, + gridDim.y, ...: the
// grid is as many blocks as the GPU holds at once; at 16 tokens groups of
// two or three tiles, TILES in fp4_gemv) and NT * 8 tokens
// (blockIdx.x); its warps split a tile's columns in chunks of 128 (warp w
// takes chunks w, w + 8, ...), each one contiguous KB of codes in the tiled
// layout (below), copying the next chunk while multiplying this one (the
// pipeline below); a row's last chunk may be partial (cols a multiple of 32:
// a lane's 32 columns are all in or all out). Each chunk is dequantized once
// for all the block's tokens.
// (With 4 warps the 384 blocks of an 8B model's qkv filled 0.48 waves of the
// H200's SMs: 11 warps an SM, 20% of DRAM bandwidth under ncu.) In a chunk
// lane (g = lane / 4, t = lane % 4) loads 16 bytes (32 codes) of rows g and
// g + 8 at columns 32t .. 32t + 31, and the same 32 columns of x for token g
// of each 8-token tile (the 1- and 8-token kernels from shared memory,
// copied with the chunk: X_SMEM in fp4_gemv). The dot product does not care
// in which order the columns are summed, so mma step j (of 8) gives the A
// fragment's columns {2t, 2t+1} and {2t+8, 2t+9} the column pairs 2h and
// 2h + 1 of word q = j / 2 (h = j % 2), and the B fragment x's words 2h and
// 2h + 1 of the same 8 columns as they are (x needs no reordering). (With
// the file order, codes (q, q + 4) made a pair: x took two byte permutes an
// mma, and each pair two shifts and two masks; now x none, and a pair one
// shift and one mask on average.)
// Partial sums meet in shared memory in a fixed order (deterministic).

// Column pair P of a 32-bit word of codes (Layout above) as bf16x2 times
// 2^-126: the magnitude bits (e1 e0 m0) at bf16 bits 8..6 (exponent 0..3
// with the top mantissa bit, subnormal at e = 0 exactly as E2M1 is), the
// sign at bit 15; the high column the same 16 bits up.
template <int P>
__device__ __forceinline__ u32 fp4_pair_bits(u32 w) {
    constexpr u32 pair = 0x81c081c0u;
    if (P == 0) return w & pair;
    if (P == 1) return (w << 6) & pair;
    if (P == 2) return __funnelshift_l(w, w, 12) & pair;  // rotate left
    return ((w << 2) ^ (w >> 6)) & pair;
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
    const int k = (int)e - 1 - shift;  // 2^k, built exactly:
    if (k >= -126) return (u32)(k + 127) << 7;  // normal (k < 128 by the host's shift)
    return k >= -133 ? 1u << (k + 133) : 0u;  // subnormal, or 0 below bf16's smallest
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

// Every scale code's bf16x2 word (the scale in both halves: e4m3_bf16 for
// NV, e8m0_bf16 with the call's shift for MX), in shared memory: a kernel's
// block fills it first (fp4_fill_scale_table), and a lane's block scales a
// chunk are then two or four shared loads instead of ~20-30 instructions.
__shared__ u32 fp4_scale_table[256];
template <bool NV>
__device__ __forceinline__ void fp4_fill_scale_table(int shift) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        const u32 v = NV ? e4m3_bf16(i) : e8m0_bf16(i, shift);
        fp4_scale_table[i] = v | (v << 16);
    }
    __syncthreads();
}

__device__ __forceinline__ u32 word(uint4 v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

// A lane's block scales as bf16x2 words {rows g: columns 0-15, 16-31; rows
// g + 8: the same} (NV has one per 16 columns; MX one per 32).
template <bool NV>
__device__ __forceinline__ void fp4_scale_words(u32 (&s)[4], u32 sa, u32 sb) {
    if (NV) {
        s[0] = fp4_scale_table[sa & 0xffu];
        s[1] = fp4_scale_table[sa >> 8];
        s[2] = fp4_scale_table[sb & 0xffu];
        s[3] = fp4_scale_table[sb >> 8];
    } else {
        s[0] = s[1] = fp4_scale_table[sa];
        s[2] = s[3] = fp4_scale_table[sb];
    }
}

// Mma step j = 2q + h's A fragment: column pairs 2h and 2h + 1 of word q of
// rows g (f[0], f[2]) and g + 8 (f[1], f[3]), times their block's scale.
template <int H>
__device__ __forceinline__ void fp4_frag(u32 (&f)[4], uint4 wa, uint4 wb, const u32 (&s)[4], int q) {
    const u32 qa = word(wa, q), qb = word(wb, q), s_a = s[q >> 1], s_b = s[2 + (q >> 1)];
    f[0] = mul_bf16x2(fp4_pair_bits<2 * H>(qa), s_a);
    f[1] = mul_bf16x2(fp4_pair_bits<2 * H>(qb), s_b);
    f[2] = mul_bf16x2(fp4_pair_bits<2 * H + 1>(qa), s_a);
    f[3] = mul_bf16x2(fp4_pair_bits<2 * H + 1>(qb), s_b);
}

// Mma step 2q + h for one 8-token tile: x's words 2h and 2h + 1 of xq
// (columns 32t + 8q + 4h .. + 3 of the lane's token g).
__device__ __forceinline__ void fp4_mma(float* c, const u32 (&f)[4], uint4 xq, int h) {
    mma_bf16_16816(c, f[0], f[1], f[2], f[3], word(xq, 2 * h), word(xq, 2 * h + 1));
}

// A chunk's A fragments for all 8 steps, dequantized once for every token
// tile (8 x 4 registers).
template <bool NV>
__device__ __forceinline__ void fp4_dequant(u32 (&a)[8][4], uint4 wa, uint4 wb, u32 sa, u32 sb) {
    u32 s[4];
    fp4_scale_words<NV>(s, sa, sb);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        fp4_frag<0>(a[2 * q], wa, wb, s, q);
        fp4_frag<1>(a[2 * q + 1], wa, wb, s, q);
    }
}

// The chunk's 8 mma steps for one 8-token tile, from dequantized fragments.
__device__ __forceinline__ void fp4_mma_chunk(float* c, const u32 (&a)[8][4], const uint4 (&xv)[4]) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
        fp4_mma(c, a[2 * q], xv[q], 0);
        fp4_mma(c, a[2 * q + 1], xv[q], 1);
    }
}

// A chunk's 8 mma steps for every token tile, each step's fragment made just
// before its mmas (fewer live registers than dequantizing the chunk first,
// as the GEMM does).
template <bool NV, int NT>
__device__ __forceinline__ void fp4_chunk_mma(float (&acc)[NT][4], uint4 wa, uint4 wb, u32 sa, u32 sb,
                                              const uint4 (&xv)[NT][4]) {
    u32 s[4];
    fp4_scale_words<NV>(s, sa, sb);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        u32 f[4];
        fp4_frag<0>(f, wa, wb, s, q);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) fp4_mma(acc[nt], f, xv[nt][q], 0);
        fp4_frag<1>(f, wa, wb, s, q);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) fp4_mma(acc[nt], f, xv[nt][q], 1);
    }
}

// cp.async of BYTES (4, 8 or 16) by the lanes whose `copy` is non-zero: a
// predicate, not a branch (the warp stays together). The GEMVs' scale rows.
template <int BYTES>
__device__ __forceinline__ void cp_async_if(u32 copy, u32 dst, const void* src) {
    asm volatile("{.reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.ca.shared.global [%0], [%1], %3;}" ::"r"(dst),
                 "l"(src), "r"(copy), "n"(BYTES));
}

// The same, 16 bytes of which `bytes` (16 or 0: zeros) are read, by the
// lanes whose `copy` is non-zero.
__device__ __forceinline__ void cp_async16_ca_if(u32 copy, u32 dst, const void* src, int bytes) {
    asm volatile("{.reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.ca.shared.global [%0], [%1], 16, %3;}" ::"r"(dst),
                 "l"(src), "r"(copy), "r"(bytes));
}

// A chunk's x for each token tile: lane (g, t)'s 32 columns (4 x 16 bytes)
// from `x_tok[nt] + xo`.
template <int NT>
__device__ __forceinline__ void fp4_load_x(uint4 (&xv)[NT][4], const bf16* const (&x_tok)[NT], int xo) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) xv[nt][i] = __ldg((const uint4*)(x_tok[nt] + xo + 8 * i));
}

// Thread (lane, i) of an 8-token tile's accumulators: row g (i < 2) or g + 8,
// token 2t + (i & 1).
__device__ __forceinline__ void fp4_store(float* __restrict__ y, float row_scale, float s, int row, int j, int n,
                                          int rows, float out_pow2, int accumulate) {
    if (row < rows && j < n) {
        // Rounded steps (no fused multiply-add), as in fp4_splitk_sum: the
        // GEMV and the GEMM in GEMV order must agree to the bit.
        const float v = __fmul_rn(__fmul_rn(s, out_pow2), row_scale);
        float* out = y + (u64)j * rows + row;
        *out = accumulate ? __fadd_rn(*out, v) : v;
    }
}

// What a one-token GEMV does with its sums besides storing them: the
// fused batch-1 path of the fast numerics (model.rs), the FP4 kin of
// gemv.cu's fused kernels. A lane holds both sums of what it writes: its
// rows g and g + 8 of a tile are rows (2i, 2i + 1) under NORM_ROPE (the pair
// RoPE rotates together), and gate row i and its up row under NORM_SWIGLU
// (whose weights come with gate and up rows in alternate runs of 8, so a
// tile is 8 of each and reads as one piece: model.rs, GATE_UP_RUN; against
// a tile taking its gate and up rows from the two halves of the stacked
// matrix, no change was measured: the fused kernel runs 3-4 us slower than
// the plain GEMV under ncu either way).
//  - NORM_ROPE / NORM_SWIGLU: x is the residual times the norm's weights g
//    as BF16 (the output projection before wrote it, or the embedding); the
//    sums are scaled by 1 / rms of the f32 residual, from `sumsq_tiles`, the
//    sums of its squares by 16 elements that the same writer left (loaded by
//    each block as it starts, added in a fixed order after its first tile). Then
//    RoPE with the KV write (rope_kv_pair), or silu(gate) * up to `out`.
//  - RESIDUAL: y += W x (accumulate), and bf16(y * g_next) to `out` and each
//    16-row tile's sum of y^2 to `sumsq_tiles` for the input projection
//    after (skipped where `out` is null).
// (Each block summing the whole f32 residual's squares itself, 16 KB of L2
// read by every block at once, read 409-412 tok/s at batch 1 against this
// form's 414-419 on other leases; BENCHMARKS.md.)
// FP4 codes cannot take the norm's weights folded in as BF16 matrices do
// (W g would need quantizing again), so they travel with x instead.
#define FP4_PLAIN 0
#define FP4_NORM_ROPE 1
#define FP4_NORM_SWIGLU 2
#define FP4_RESIDUAL 3
struct Fp4Epilogue {
    float* sumsq_tiles;
    float eps;
    bf16* out;
    const float* g_next;
    RopeKvOut rope;
};

// What a tile's end reads besides the sums: the row scales of rows a and b,
// and under RESIDUAL y and the next norm's weights there. Warp 0 loads them
// as the tile starts (ld_early: where written, not moved to the use) so that
// their trip to memory passes under the tile's chunks; loaded at the end,
// they held warp 0 up, and every warp with it at the next tile's barrier.
struct Fp4TileIn {
    float scale_a = 0.0f, scale_b = 0.0f, y_a = 0.0f, y_b = 0.0f, g_a = 0.0f, g_b = 0.0f;
};
template <typename T>
__device__ __forceinline__ T ld_early(const T* p) {
    static_assert(sizeof(T) == 4, "32-bit loads");
    u32 v;
    asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
    T r;
    memcpy(&r, &v, 4);
    return r;
}
template <int MODE>
__device__ __forceinline__ Fp4TileIn fp4_tile_in(const Fp4Epilogue& epi, const float* row_scale, const float* y,
                                                 int ra, int rb, int rows) {
    Fp4TileIn in;
    in.scale_a = ld_early(row_scale + min(ra, rows - 1));  // (rows past `rows` are never stored)
    in.scale_b = ld_early(row_scale + min(rb, rows - 1));
    if (MODE == FP4_RESIDUAL) {
        in.y_a = ld_early(y + ra);
        in.y_b = ld_early(y + rb);
        if (epi.out) {
            in.g_a = ld_early(epi.g_next + ra);
            in.g_b = ld_early(epi.g_next + rb);
        }
    }
    return in;
}

// Rows a and b (= a + b_rows) of lane row g in 16-row tile `tile` (MODE above).
template <int MODE>
__device__ __forceinline__ int fp4_tile_row(int tile, int g) {
    return MODE == FP4_NORM_ROPE ? tile * 16 + 2 * g : tile * 16 + g;
}
template <int MODE>
__device__ __forceinline__ int fp4_b_rows() {
    return MODE == FP4_NORM_ROPE ? 1 : 8;
}

// The tiled layout (Fp4Weights::stack, fp4.rs): a 16-row tile's 128-column
// chunk is one contiguous KB of codes, the tile's rows 64 bytes each in
// slot fp4_slot(r) (rows 2 and 3, 6 and 7, ... swapped, so that both maps of
// lanes to rows, g and g + 8 or 2g and 2g + 1, read a quarter-warp's 16-byte
// loads from 8 distinct bank groups); tile i's chunk c is at (i * chunks + c)
// KB. The scales likewise: a chunk's 16 rows of fp4_scale_row bytes (4 MX, 8
// NV) together, at (i * chunks + c) * 16 * fp4_scale_row. Rows are padded to
// 16 and columns to 128 with zeros (code 0 is +0), so every copy is whole;
// x's columns past `cols` read as zeros. (Row-major codes gave a chunk's
// copy half a 128-byte line a row, 8 rows an instruction: under ncu 12 L1
// wavefronts for an ideal 4, and the scales' 4-byte rows 16 for an ideal 1,
// the L1 the busiest unit at 72%.)
__device__ __forceinline__ int fp4_slot(int r) { return r ^ ((r >> 1) & 1); }
template <bool NV>
constexpr int fp4_scale_row() {
    return NV ? 8 : 4;
}

// The GEMV's pipeline: each warp copies its next chunk into shared memory
// with cp.async while it multiplies this one (the codes used to come
// straight into registers, four chunks a warp at a time, and a warp had
// nothing in flight while it multiplied). One chunk ahead is best: with
// row-major codes three ahead ran a layer's four matrices at 2.03-2.06 TB/s
// against 2.14-2.20, none at 1.78-1.81; with the tiled layout two ahead lost
// 3%, and bulk copies (cp.async.bulk by lane 0, an mbarrier a stage) lost 4%
// one ahead and 9% three ahead (BENCHMARKS.md). A warp's shared memory:
// GEMV_STAGES stages, each an item's KB of codes and its scale bytes as they
// lie in the tiled layout.
#define GEMV_STAGES 2
#define GEMV_STAGE_BYTES (1024 + 128)
#define GEMV_WARPS 8

// Where piece p (16 bytes, 8 columns) of a chunk's x sits in its stage of
// GEMV_X_STAGE bytes: pieces 8-15 one slot on, so that a quarter-warp's
// lanes t = 0..3 reading their pieces 4t + i hit four distinct bank groups
// (i, 4 + i, 1 + i, 5 + i; without the gap lanes 0 and 2 would share one).
__device__ __forceinline__ int gemv_x_slot(int p) { return p + (p >> 3); }
// A token row of x in a stage: 17 slots for one row; 18 where rows g and g + 1
// share a quarter-warp (18 slots = 2 bank groups on: disjoint groups).
template <int ROWS>
constexpr int gemv_x_row_bytes() {
    return ROWS == 1 ? 17 * 16 : 18 * 16;
}

// A warp's x stages (shared address) where the kernel copies ROWS token rows
// of x, else (ROWS = 0) nothing: the other kernels' shared memory stays as it
// was (16 bytes more of it, moving the stages off their 1 KB alignment, cost
// them 3-4% at batch 8).
template <int ROWS>
__device__ __forceinline__ u32 gemv_x_stages(int warp) {
    if constexpr (ROWS > 0) {
        __shared__ __align__(16) unsigned char x_stage[GEMV_WARPS][GEMV_STAGES][ROWS * gemv_x_row_bytes<ROWS>()];
        return smem_u32(x_stage[warp]);
    } else {
        return 0;
    }
}

template <bool B>
struct fp4_bool {
    static constexpr bool value = B;
};
// The same for a small int (the GEMV's copy parts).
template <int I>
struct fp4_int {
    static constexpr int value = I;
};

// The stage after stage s of a GEMV pipeline (of two: a flip, 4-5 SASS
// instructions a loop fewer than a compare and select).
static_assert(GEMV_STAGES == 2, "gemv_next_stage flips between two stages");
__device__ __forceinline__ int gemv_next_stage(int s) { return s ^ 1; }

// Lane row g's x for each token tile, from column `col`: token nt * 8 + g, or
// token n - 1 past the last (its sums are never stored; no predicate, no zeros).
template <int NT>
__device__ __forceinline__ void fp4_x_lanes(const bf16* (&x_tok)[NT], const bf16* x, int g, int n, int cols, int col) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) x_tok[nt] = opaque(x + (u64)min(nt * 8 + g, n - 1) * cols + col);
}

// The fused modes' end of a tile, by lane (g, t = 0) of warp 0, which holds
// token 0's sums of rows a (i = 0) and b (i = 2): the warps' parts added in
// warp order, as fp4_store scales them.
template <int MODE>
__device__ __forceinline__ void fp4_fused_store(const Fp4Epilogue& epi, float (*partial)[1][32][4], const float* sumsq,
                                                int lane, int ra, int rb, const Fp4TileIn& in, u64 rope_slot,
                                                int rope_pos, float* __restrict__ y, int cols, float out_pow2) {
    float sa = 0.0f, sb = 0.0f;
#pragma unroll
    for (int w = 0; w < GEMV_WARPS; w++) {
        sa += partial[w][0][lane][0];
        sb += partial[w][0][lane][2];
    }
    float norm = 1.0f;
    if (MODE == FP4_NORM_ROPE || MODE == FP4_NORM_SWIGLU) {
        float ss = 0.0f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; w++) ss += sumsq[w];
        norm = 1.0f / sqrtf(ss / (float)cols + epi.eps);
    }
    const float va = sa * out_pow2 * in.scale_a * norm, vb = sb * out_pow2 * in.scale_b * norm;
    if (MODE == FP4_NORM_ROPE) {
        rope_kv_pair_at(epi.rope, 0, rope_slot, rope_pos, ra, va, vb);
    } else if (MODE == FP4_NORM_SWIGLU) {
        epi.out[(ra >> 4) * 8 + (ra & 7)] = f32_to_bf16(silu_times(va, vb));
    } else {  // FP4_RESIDUAL
        const float ya = in.y_a + va, yb = in.y_b + vb;
        y[ra] = ya;
        y[rb] = yb;
        if (epi.out) {
            epi.out[ra] = f32_to_bf16(ya * in.g_a);
            epi.out[rb] = f32_to_bf16(yb * in.g_b);
            // The tile's 16 squares over the 8 lanes (g, 0) in a fixed order.
            float ss = ya * ya + yb * yb;
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) ss += __shfl_xor_sync(0x11111111u, ss, o);
            if (lane == 0) epi.sumsq_tiles[ra >> 4] = ss;
        }
    }
}

// A plain tile's sum i of lane `src` (row g or g + 8 of src's g, ra or rb;
// token nt * 8 + 2t + (i & 1) of src's t) from the warps' parts, added in
// the fixed warp order that keeps them deterministic, scaled and stored.
template <int NT>
__device__ __forceinline__ void fp4_add_and_store(const float (&part)[GEMV_WARPS][NT][32][4], int nt, int src, int i,
                                                  int ra, int rb, const Fp4TileIn& in, float* __restrict__ y, int n,
                                                  int rows, float out_pow2, int accumulate) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < GEMV_WARPS; w++) s += part[w][nt][src][i];
    fp4_store(y, i < 2 ? in.scale_a : in.scale_b, s, i < 2 ? ra : rb, nt * 8 + 2 * (src & 3) + (i & 1), n, rows,
              out_pow2, accumulate);
}

// TILES = 2 or 3 (the 16-token kernels; fp4.rs, gemv_tiles): a warp's item
// is the same chunk of TILES adjacent row tiles, multiplied with the same x,
// so x is loaded once for all. Each tile's sums are taken as with TILES = 1
// (the same bits). At 16 tokens x is 4 times the bytes of a chunk's codes,
// and with one tile an item its loads kept the L1 71-85% busy, the busiest of
// the SM's units; in pairs an 8B layer's GEMVs ran 1,198-1,206 -> 1,529-1,541
// GB/s on an H100, and threes read gate/up and qkv 8-10% faster again, but
// leave a third of the SMs idle on a 4,096-row matrix (at 8 tokens pairs
// lost 2-3%; four tiles spill; BENCHMARKS.md).
//
// ROTATE (the 16-token pairs' `_rot` kernels, fast numerics only: fp4.rs,
// gemv_rotates): block y takes its warps' chunks from item y mod
// per_tile on, wrapping, so that the blocks do not all read the same lines
// of x at once. Each warp's sums then come in another order, so these are
// not the GEMV's bits. With 14 items a warp (down, 14,336 columns) x's L2
// lines were a hot spot: down read 12-13% faster at 16 tokens on an H200
// rotated (9-10% on an H100); with 4 items a warp only 4 orders exist and
// qkv, o and gate/up read 1-9% slower (an H100; BENCHMARKS.md).
template <bool NV, int NT, int MODE = FP4_PLAIN, int TILES = 1, bool ROTATE = false>
__device__ __forceinline__ void fp4_gemv(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
                                         const float* __restrict__ row_scale, const bf16* __restrict__ x,
                                         float* __restrict__ y, int n, int rows, int cols, float out_pow2, int shift,
                                         int accumulate, const Fp4Epilogue& epi = Fp4Epilogue{}) {
    static_assert(MODE == FP4_PLAIN || NT == 1, "the fused epilogues take one token");
    static_assert(TILES == 1 || (TILES <= 3 && MODE == FP4_PLAIN), "groups of tiles in the plain kernels only");
    static_assert(!ROTATE || (MODE == FP4_PLAIN && NT == 2 && TILES == 2), "rotated orders: the 16-token pairs");
    constexpr u32 STAGE_BYTES = TILES * GEMV_STAGE_BYTES;  // a warp's stage: the tiles' chunks one after another
    constexpr bool NORM = MODE == FP4_NORM_ROPE || MODE == FP4_NORM_SWIGLU;
    constexpr bool SPREAD_END = MODE == FP4_PLAIN && TILES == 1;  // every warp adds up a tile's end (finish_tile)
    constexpr int SCALE_ROW = fp4_scale_row<NV>();
    constexpr u32 ITEM_SCALES = 16 * SCALE_ROW;  // a chunk's scale bytes
    extern __shared__ __align__(16) unsigned char smem[];
    // The warps' partial sums: two tiles' (alternate halves, TILES = 1) or
    // a group's (TILES = 2, 3), one slice a tile.
    __shared__ float partial[TILES > 2 ? TILES : 2][GEMV_WARPS][NT][32][4];
    __shared__ float sumsq[GEMV_WARPS];
    // The fused (one-token) kernels copy x's 256 bytes of a chunk into an x
    // stage beside the chunk's (same index, same copy group), piece p (8
    // columns) at gemv_x_slot(p), so that x arrives with the weights instead
    // of from L2 in the loop: under ncu its loads were the largest stall
    // (long scoreboard 2.2-2.5 a issued instruction for QKV and O, halved
    // this way; BENCHMARKS.md). The 8-token kernel stages its 8 token rows
    // the same way (batch 8: 2,455 -> 2,690 tok/s); the 16-token one, whose
    // 16 rows would pass the 48 KB of static shared memory, loads x straight
    // into registers, once for two or three row tiles (TILES above; 16 rows
    // staged in dynamic shared memory gave nothing: the L1 then carries the
    // copy and the reads, BENCHMARKS.md).
    constexpr int X_ROWS = MODE != FP4_PLAIN ? 1 : NT == 1 ? 8 : 0;
    constexpr bool X_SMEM = X_ROWS > 0;
    constexpr int X_ROW = gemv_x_row_bytes<X_ROWS>(), X_STAGE = X_ROWS * X_ROW;
    fp4_fill_scale_table<NV>(shift);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tok0 = blockIdx.x * NT * 8;
    x += (u64)tok0 * cols;
    y += (u64)tok0 * rows;
    n -= tok0;
    const int chunks = (cols + 127) >> 7, tiles = (rows + 15) >> 4;
    // This warp's chunks of a tile (warp, warp + 8, ...) and this block's
    // groups of TILES tiles (group blockIdx.y, + gridDim.y, ...: tiles
    // TILES * group ..); item i is chunk i % per_tile of the block's group i
    // / per_tile.
    const int per_tile = warp < chunks ? (chunks - warp + GEMV_WARPS - 1) / GEMV_WARPS : 0;
    const int groups = (tiles + TILES - 1) / TILES;
    const int my_groups = (int)blockIdx.y < groups ? (groups - (int)blockIdx.y + (int)gridDim.y - 1) / (int)gridDim.y : 0;
    const int items = per_tile * my_groups;
    // This lane's places in its warp's stage 0 (shared addresses): the 16
    // bytes it copies of an item's codes (and 512 on), and of its scales
    // (1024 on, lanes under ITEM_SCALES / 16); the codes and scale bytes it
    // reads of its rows a and b. (Opaque: the compiler would recompute them
    // from threadIdx every chunk.)
    const u32 warp_smem = smem_u32(smem) + warp * GEMV_STAGES * STAGE_BYTES;
    const int la = fp4_tile_row<MODE>(0, g), lb = la + fp4_b_rows<MODE>();
    const u32 copy_at = opaque(warp_smem + 16 * lane);
    const u32 codes_a = opaque(warp_smem + 64 * fp4_slot(la) + 16 * t);
    const u32 codes_b = MODE == FP4_NORM_ROPE ? opaque(warp_smem + 64 * fp4_slot(lb) + 16 * t) : codes_a + 512;
    const u32 scales_a = opaque(warp_smem + 1024 + SCALE_ROW * la + (NV ? 2 : 1) * t);
    // X_SMEM: lanes 16-31 copy x's pieces lane - 16 of an item; lane (g, t)
    // reads pieces 4t .. 4t + 3. With 8 rows (the 8-token kernel) lane copies
    // piece lane % 16 of rows lane / 16 + 2k (k < 4, those under n), and
    // reads row g (row n - 1 past n: its sums are never stored).
    const u32 x_warp = gemv_x_stages<X_ROWS>(warp);
    const u32 x_copy_at =
        X_SMEM ? opaque(x_warp + 16 * gemv_x_slot(lane & 15) + (X_ROWS > 1 ? (lane >> 4) * X_ROW : 0)) : 0;
    const u32 x_read_at =
        X_SMEM ? opaque(x_warp + 16 * gemv_x_slot(4 * t) + (X_ROWS > 1 ? min(g, n - 1) * X_ROW : 0)) : 0;
    const u32 scales_b = scales_a + SCALE_ROW * fp4_b_rows<MODE>();

    const int sumsq_count = NORM ? cols / 16 : 0;
    float sumsq_first = 0.0f;
    u64 rope_slot = 0;
    int rope_pos = 0;

    // All of this lane's sums of a plain tile (a group's tile ends, below).
    auto add_and_store = [&](const float (&part)[GEMV_WARPS][NT][32][4], int ra, int rb, const Fp4TileIn& in) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                fp4_add_and_store<NT>(part, nt, lane, i, ra, rb, in, y, n, rows, out_pow2, accumulate);
    };

    // A tile's end (TILES = 1; a group of tiles ends in `run` below): the
    // warps' partial sums added in a fixed order. Partial sums of alternate
    // tiles in alternate halves, so one barrier a tile suffices (warp 0 reads
    // half tl & 1 before any warp can pass the next tile's barrier and write
    // it again). (Named barriers that kept only warp 0 waiting read the
    // same, BENCHMARKS.md.)
    auto finish_tile = [&](int tl, int ra, int rb, const Fp4TileIn& in, const float (&acc)[NT][4]) {
        const int half = tl & 1;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) partial[half][warp][nt][lane][i] = acc[nt][i];
        if (NORM && tl == 0) {  // the block's sum of the residual's squares, by warp
            float ss = sumsq_first;
            for (int i = threadIdx.x + GEMV_WARPS * 32; i < sumsq_count; i += GEMV_WARPS * 32) ss += epi.sumsq_tiles[i];
            ss = warp_sum(ss);
            if (lane == 0) sumsq[warp] = ss;
        }
        __syncthreads();
        if constexpr (MODE == FP4_PLAIN) {
            // Spread over the warps (SPREAD_END): warp w's lanes 0-15 add up
            // the 16 sums of the lanes whose g is w (rows ra, rb), the same
            // bits as one warp adding all 128. (Warp 0 adding them all kept
            // the other warps waiting at the next tile's barrier: batch 8
            // 0.9% / 1.5% faster spread, MXFP4 / NVFP4 on an H100,
            // BENCHMARKS.md.)
            const int src = 4 * warp + (lane >> 2);
            if (lane < 16)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    fp4_add_and_store<NT>(partial[half], nt, src, lane & 3, ra, rb, in, y, n, rows, out_pow2,
                                          accumulate);
        } else if (warp == 0 && t == 0) {
            fp4_fused_store<MODE>(epi, partial[half], sumsq, lane, ra, rb, in, rope_slot, rope_pos, y, cols, out_pow2);
        }
    };

    // The next item to copy: how many were, how many of its group are left,
    // where this lane copies from (32-bit offsets: a matrix's codes stay
    // under 4 GB, fp4.rs checks) and, with groups of tiles, how many of its
    // group's tiles there are (a tile past the last copies the first's chunk
    // again, its sums never stored). Lanes past the scales' bytes copy none:
    // a predicate, not a branch that splits the warp.
    const unsigned char* src_c = codes;
    const unsigned char* src_s = scales;
    int issued = 0, tile_left = 0, next_group = blockIdx.y, write_stage = 0, read_stage = 0;
    const int rotation = ROTATE && per_tile > 0 ? (int)blockIdx.y % per_tile : 0;
    int group_tiles = 1;
    const u32 copies_scales = opaque((u32)(lane < ITEM_SCALES / 16));
    // (bit k: this lane copies its row lane / 16 + 2k; one row: lanes 16-31)
    u32 rows_under_n = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) rows_under_n |= (u32)((lane >> 4) + 2 * k < n) << k;
    const u32 copies_x = X_ROWS == 1 ? opaque((u32)(lane >= 16)) : X_ROWS > 1 ? opaque(rows_under_n) : 0;
    const bf16* src_x = x;
    int x_col_copy = 0;
    // Copies the next item into its stage (and commits a group, an empty one
    // past the last item, so that the wait below always counts the same).
    // PART 0 the whole item; 1 its weights only (copied before the wait for
    // the kernel ahead, below: no kernel writes the weights); 2 the rest (x,
    // which the kernel ahead wrote, and the commit).
    auto issue = [&](auto part) {
        constexpr int PART = decltype(part)::value;
        if (issued < items && PART != 2) {
            if (tile_left == 0) {
                const u32 item = (u32)(next_group * TILES) * (u32)chunks + warp + GEMV_WARPS * rotation;
                src_c = codes + item * 1024u + 16 * lane;
                src_s = scales + item * ITEM_SCALES + 16 * lane;
                x_col_copy = warp * 128 + 8 * (lane & 15);
                src_x = x + x_col_copy + (X_ROWS > 1 ? (u64)(lane >> 4) * cols : 0);
                if (TILES > 1) group_tiles = min(TILES, tiles - next_group * TILES);
                tile_left = per_tile;
                next_group += gridDim.y;
            }
            const u32 at = copy_at + write_stage * STAGE_BYTES;
            cp_async16_shared(at, src_c, 16);
            cp_async16_shared(at + 512, src_c + 512, 16);
            cp_async_if<16>(copies_scales, at + 1024, src_s);
#pragma unroll
            for (int k = 1; k < TILES; k++) {  // tile k of the group, chunks apart
                const u32 next = (u32)(k < group_tiles ? k : 0) * (u32)chunks;
                const unsigned char* ck = src_c + next * 1024u;
                cp_async16_shared(at + k * GEMV_STAGE_BYTES, ck, 16);
                cp_async16_shared(at + k * GEMV_STAGE_BYTES + 512, ck + 512, 16);
                cp_async_if<16>(copies_scales, at + k * GEMV_STAGE_BYTES + 1024, src_s + next * ITEM_SCALES);
            }
        }
        if (issued < items && PART != 1) {
            if (X_SMEM) {  // x's columns past cols (a partial last chunk) as zeros
                const bool in = x_col_copy < cols;  // (and a source inside x either way)
                const u32 x_at = x_copy_at + write_stage * X_STAGE;
#pragma unroll
                for (int k = 0; k < (X_ROWS > 1 ? 4 : 1); k++)
                    cp_async16_ca_if(copies_x & (1u << k), x_at + 2 * k * X_ROW, in ? src_x + (u64)2 * k * cols : x,
                                     in ? 16 : 0);
                src_x += GEMV_WARPS * 128;
                x_col_copy += GEMV_WARPS * 128;
            }
            write_stage = gemv_next_stage(write_stage);
            src_c += GEMV_WARPS * 1024;
            src_s += GEMV_WARPS * ITEM_SCALES;
            if (ROTATE && tile_left == rotation + 1) {  // past the tile's last: its first
                src_c -= per_tile * GEMV_WARPS * 1024;
                src_s -= per_tile * GEMV_WARPS * ITEM_SCALES;
            }
            issued++;
            tile_left--;
        }
        if (PART != 1) asm volatile("cp.async.commit_group;");
    };
    using Whole = fp4_int<0>;
    if constexpr (MODE != FP4_PLAIN || NT == 2) {
        // The fused and the 16-token kernels wait here, not first
        // (common.cuh): nothing above reads memory another kernel writes (the
        // scale table is built from the call's arguments), and their first
        // item's codes and scales, which no kernel writes, are copied before
        // the wait, under the tail of the kernel ahead (launched early,
        // Gpu::launch_early); x, which that kernel wrote, after it. (On an
        // H100 batch 1 4-5% faster, batches 9-16 3%; the 8-token kernel so,
        // 1.8% slower at batch 8: it waits first. BENCHMARKS.md.)
        static_assert(GEMV_STAGES == 2, "one item ahead");
        issue(fp4_int<1>{});
        wait_for_previous_kernels();
        issue(fp4_int<2>{});
    } else {
#pragma unroll
        for (int s = 0; s < GEMV_STAGES - 1; s++) issue(Whole{});
    }
    // The residual's sums of squares: this thread's first one loaded now,
    // used at the end of the block's first tile, so that no one waits for it.
    if (NORM && (int)threadIdx.x < sumsq_count) sumsq_first = epi.sumsq_tiles[threadIdx.x];
    // NORM_ROPE's one token's cache slot and position, for warp 0's tile ends.
    if (MODE == FP4_NORM_ROPE && warp == 0) {
        rope_slot = (u64)ld_early(epi.rope.slots);
        rope_pos = ld_early(epi.rope.positions);
    }
    const int x_col = (warp << 7) + 32 * t;
    const bf16* x_tok[NT] = {};
    if constexpr (!X_SMEM) fp4_x_lanes<NT>(x_tok, x, g, n, cols, x_col);

    // The tiles, with x's loads bounded where the last chunk is partial.
    auto run = [&](auto whole_chunks) {
        [[maybe_unused]] constexpr bool WHOLE = decltype(whole_chunks)::value;  // (unused with X_SMEM)
        for (int tl = 0; tl < my_groups; tl++) {
            const int tile = ((int)blockIdx.y + tl * (int)gridDim.y) * TILES;
            // The rows this warp ends and their inputs (Fp4TileIn), loaded
            // now so that the trip passes under the chunks: every warp its
            // rows w and w + 8 of the tile (SPREAD_END), warp 0 the tile's
            // (the fused kernels), warp k < TILES tile k of the group (2
            // registers a warp where warp 0 used to hold the group's 6, which
            // made the NVFP4 threes spill).
            const int ends = TILES == 1 ? 0 : warp;
            const int ra = fp4_tile_row<MODE>(tile + ends, SPREAD_END ? warp : g), rb = ra + fp4_b_rows<MODE>();
            const Fp4TileIn in = (SPREAD_END || (TILES == 1 ? warp == 0 : warp < TILES))
                                     ? fp4_tile_in<MODE>(epi, row_scale, y, ra, rb, rows)
                                     : Fp4TileIn{};
            float acc[TILES][NT][4] = {};
            for (int j = 0, xo = GEMV_WARPS * 128 * rotation; j < per_tile; j++, xo += GEMV_WARPS * 128) {
                if (ROTATE && j == per_tile - rotation) xo = 0;
                uint4 xv[NT][4];
                if constexpr (X_SMEM) {
                    // read from the stage below, once it is in
                } else if (WHOLE || x_col + xo < cols) {
                    fp4_load_x<NT>(xv, x_tok, xo);
                } else {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int i = 0; i < 4; i++) xv[nt][i] = make_uint4(0, 0, 0, 0);
                }
                issue(Whole{});
                const u32 stage = read_stage * STAGE_BYTES;
                asm volatile("cp.async.wait_group %0;" ::"n"(GEMV_STAGES - 1));
                __syncwarp();  // the item is in, the scales copied by other lanes too
                if constexpr (TILES <= 2) {
                    uint4 wa[TILES], wb[TILES];
                    u32 sa[TILES], sb[TILES];
#pragma unroll
                    for (int k = 0; k < TILES; k++) {
                        const u32 at = stage + k * GEMV_STAGE_BYTES;
                        wa[k] = lds128(codes_a + at);
                        wb[k] = lds128(codes_b + at);
                        sa[k] = NV ? lds_u16(scales_a + at) : lds_u8(scales_a + at);
                        sb[k] = NV ? lds_u16(scales_b + at) : lds_u8(scales_b + at);
                    }
                    if (X_SMEM) {
                        const u32 xs = x_read_at + read_stage * X_STAGE;
#pragma unroll
                        for (int i = 0; i < 4; i++) xv[0][i] = lds128(xs + 16 * i);
                    }
                    read_stage = gemv_next_stage(read_stage);
                    __syncwarp();  // every lane has read the stage before the next issue refills it
#pragma unroll
                    for (int k = 0; k < TILES; k++) fp4_chunk_mma<NV, NT>(acc[k], wa[k], wb[k], sa[k], sb[k], xv);
                } else {
                    // Three tiles: each tile's codes read just before its
                    // mmas (read all first, they and the sums spill past 128
                    // registers).
#pragma unroll
                    for (int k = 0; k < TILES; k++) {
                        const u32 at = stage + k * GEMV_STAGE_BYTES;
                        const u32 sa = NV ? lds_u16(scales_a + at) : lds_u8(scales_a + at);
                        const u32 sb = NV ? lds_u16(scales_b + at) : lds_u8(scales_b + at);
                        fp4_chunk_mma<NV, NT>(acc[k], lds128(codes_a + at), lds128(codes_b + at), sa, sb, xv);
                    }
                    read_stage = gemv_next_stage(read_stage);
                    __syncwarp();  // every lane has read the stage before the next issue refills it
                }
            }
            if constexpr (TILES == 1) {
                finish_tile(tl, ra, rb, in, acc[0]);
            } else {
                // The group's end: every warp's sums of all its tiles in
                // shared memory, one barrier, then warp k adds up tile k in
                // the fixed warp order (the same bits as finish_tile), the
                // adders side by side while the other warps go on to the next
                // group. (One barrier and warp 0 adding a tile, TILES times
                // over, kept every warp waiting at the second and third
                // barrier: an 8B layer at 16 tokens 1,634 -> 1,762 GB/s
                // MXFP4, 1,648 -> 1,822 NVFP4 this way, on an H100,
                // BENCHMARKS.md.) The barrier before: the last group's
                // adders are done reading.
                if (tl > 0) __syncthreads();
#pragma unroll
                for (int k = 0; k < TILES; k++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int i = 0; i < 4; i++) partial[k][warp][nt][lane][i] = acc[k][nt][i];
                __syncthreads();
                if (warp < TILES && (warp == 0 || tile + warp < tiles)) add_and_store(partial[warp], ra, rb, in);
            }
        }
    };
    if ((cols & 127) == 0)
        run(fp4_bool<true>{});
    else
        run(fp4_bool<false>{});
    asm volatile("cp.async.wait_group 0;");
}

// cols a multiple of 32; 8 (n8) or 16 (n16) tokens a block (blockIdx.x), a
// grid of as many blocks as an SM holds at once over the row tiles (groups
// of 2 at 16 tokens, 3 in the `_t3` kernels; blockIdx.y), TILES *
// GEMV_WARPS * GEMV_STAGES * GEMV_STAGE_BYTES of dynamic shared memory
// (fp4.rs).
#define FP4_ARGS const unsigned char *__restrict__ codes, const unsigned char *__restrict__ scales, \
                 const float *__restrict__ row_scale, const bf16 *__restrict__ x, float *__restrict__ y, int n, \
                 int rows, int cols, float out_pow2, int shift, int accumulate
#define FP4_PASS codes, scales, row_scale, x, y, n, rows, cols, out_pow2, shift, accumulate
// Blocks an SM (fp4.rs asks the driver how many fit and launches as many):
// 3, at up to 80 registers (at 64, for 4, the second token tile's
// accumulators and x spill, and the 8-token kernel recomputes more); the
// 16-token kernels, with two or three row tiles' sums, 2 (115-123 registers).
#define FP4_GEMV_N8 __launch_bounds__(GEMV_WARPS * 32, 3)
#define FP4_GEMV_N16 __launch_bounds__(GEMV_WARPS * 32, 2)
// The norm + SwiGLU kernel (gate/up: 1,792 row tiles for an 8B model, more
// than the blocks that fit, so a block takes 4 or 5 at 3 an SM, 3 or 4 at 4)
// fits 64 registers without spilling and runs 4 an SM: batch 1 +1.4-1.7%
// (BENCHMARKS.md). At 5 (48 registers) it spills and loses 9%.
#define FP4_GEMV_SWIGLU __launch_bounds__(GEMV_WARPS * 32, 4)
extern "C" __global__ void FP4_GEMV_N8 fp4_gemv_mx_n8(FP4_ARGS) {
    wait_for_previous_kernels();
    fp4_gemv<false, 1>(FP4_PASS);
}
extern "C" __global__ void FP4_GEMV_N16 fp4_gemv_mx_n16(FP4_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<false, 2, FP4_PLAIN, 2>(FP4_PASS);
}
extern "C" __global__ void FP4_GEMV_N16 fp4_gemv_mx_n16_t3(FP4_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<false, 2, FP4_PLAIN, 3>(FP4_PASS);
}
extern "C" __global__ void FP4_GEMV_N16 fp4_gemv_mx_n16_rot(FP4_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<false, 2, FP4_PLAIN, 2, true>(FP4_PASS);
}
extern "C" __global__ void FP4_GEMV_N16 fp4_gemv_nv_n16_rot(FP4_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<true, 2, FP4_PLAIN, 2, true>(FP4_PASS);
}
extern "C" __global__ void FP4_GEMV_N8 fp4_gemv_nv_n8(FP4_ARGS) {
    wait_for_previous_kernels();
    fp4_gemv<true, 1>(FP4_PASS);
}
extern "C" __global__ void FP4_GEMV_N16 fp4_gemv_nv_n16(FP4_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<true, 2, FP4_PLAIN, 2>(FP4_PASS);
}
extern "C" __global__ void FP4_GEMV_N16 fp4_gemv_nv_n16_t3(FP4_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<true, 2, FP4_PLAIN, 3>(FP4_PASS);
}

// The fused one-token kernels (FP4_NORM_ROPE and kin above): the GEMV's
// arguments, then the epilogue's (those a mode does not use may be null).
#define FP4_FUSED_ARGS FP4_ARGS, float *__restrict__ sumsq_tiles, float eps, bf16 *__restrict__ out, \
                       const float *__restrict__ g_next, const int *__restrict__ positions, \
                       const int *__restrict__ slots, bf16 *__restrict__ q_out, bf16 *__restrict__ k_cache, \
                       bf16 *__restrict__ v_cache, int n_heads, int n_kv_heads, int head_dim, float theta
#define FP4_EPILOGUE \
    Fp4Epilogue { sumsq_tiles, eps, out, g_next, {positions, slots, q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim, theta}, }
extern "C" __global__ void FP4_GEMV_N8 fp4_gemv_mx_norm_rope_n1(FP4_FUSED_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<false, 1, FP4_NORM_ROPE>(FP4_PASS, FP4_EPILOGUE);
}
extern "C" __global__ void FP4_GEMV_N8 fp4_gemv_nv_norm_rope_n1(FP4_FUSED_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<true, 1, FP4_NORM_ROPE>(FP4_PASS, FP4_EPILOGUE);
}
extern "C" __global__ void FP4_GEMV_SWIGLU fp4_gemv_mx_norm_swiglu_n1(FP4_FUSED_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<false, 1, FP4_NORM_SWIGLU>(FP4_PASS, FP4_EPILOGUE);
}
extern "C" __global__ void FP4_GEMV_SWIGLU fp4_gemv_nv_norm_swiglu_n1(FP4_FUSED_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<true, 1, FP4_NORM_SWIGLU>(FP4_PASS, FP4_EPILOGUE);
}
extern "C" __global__ void FP4_GEMV_N8 fp4_gemv_mx_residual_n1(FP4_FUSED_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<false, 1, FP4_RESIDUAL>(FP4_PASS, FP4_EPILOGUE);
}
extern "C" __global__ void FP4_GEMV_N8 fp4_gemv_nv_residual_n1(FP4_FUSED_ARGS) {
    // waits in fp4_gemv, after copying its first weights
    fp4_gemv<true, 1, FP4_RESIDUAL>(FP4_PASS, FP4_EPILOGUE);
}

// --- The tiled GEMM: more than 16 tokens ---
//
// In the GEMV each 16-row block reads all of x again: at 64 tokens x's bytes
// (2 a value) are 16 times the weights' (half a byte), and x's traffic from
// L2 bounds it (batch 64 ran at 0.3 TB/s of weights). Here a block takes 128
// rows (a 16-row tile per warp) and 64 tokens. Each 128-column chunk's x
// (64 x 128), codes (128 rows x 64 bytes) and scales are copied to shared
// memory by cp.async, GEMM_STAGES chunks in flight, then multiplied: x is
// read from L2 once per 128 rows, and the loads run ahead of the math
// without registers. blockIdx.z splits the columns so that matrices of few
// row tiles still fill the GPU: split z takes chunks z * per_split, + 1, ...
// (step 1), or z, z + step, ... (step > 1). With step 8 = WARPS and 8 splits a
// token's sums are the GEMV's to the bit: the same chunks in the same order
// per split as per GEMV warp, the splits added in the same order. With more
// than one split the partial sums go to `part` ([split][token][row]) and
// fp4_splitk_sum adds them in split order. cols a multiple of 32: a partial
// last chunk reads x's columns past cols as zeros (and the tiled layout's
// padding, zero codes), so its sums are the GEMV's too.

#define GEMM_TOKENS 64
#define GEMM_STAGES 4
// A token's row of x in shared memory: 16 units of 16 bytes (8 columns) and 2
// of padding, unit u stored at u ^ (u >> 3 & 1). A warp's 16-byte loads
// (lane g, t reads unit 4t + i of token row g) then hit 8 distinct bank
// groups in each quarter-warp: units i, 4+i, 8+i, 12+i of a row land on
// groups {i, i+4, i^1, (i+4)^1} (mod 8), and the next row, 18 units on, on the
// other four. (Unswizzled, lanes t and t + 2 shared a group: 2-way conflicts,
// shared memory 77% busy under ncu at 0.47 TB/s of weights.)
#define GEMM_XS (18 * 8)
__device__ __forceinline__ int gemm_unit(int u) { return u ^ ((u >> 3) & 1); }

// One stage: x, then the codes (the block's 8 tiles' KB of the chunk as the
// tiled layout has them), then the scales (the same tiles' scale bytes).
#define GEMM_X_BYTES (GEMM_TOKENS * GEMM_XS * 2)
#define GEMM_STAGE_BYTES (GEMM_X_BYTES + 128 * 64 + 128 * 8)

// The block's 256 threads' copies of a chunk into a stage: x's 128 columns
// of the block's `here` tokens (rows GEMM_XS apart, units at gemm_unit;
// zeros past `here` and `cols`), then the codes (the block's 8 tiles' KB, as
// the tiled layout has them) and scale bytes (tiles past the last as zeros).
// Each thread's sources and places are the same in every chunk but for the
// chunk's offset, so they are worked out once (worked out for every piece
// and chunk, they made the loops 683 SASS instructions a warp and chunk in
// fp4_gemm_wg, now 330, and 766 in fp4_gemm, now 448).
template <bool NV>
struct GemmCopier {
    static constexpr int SCALE_ROW = fp4_scale_row<NV>();
    static constexpr int X_PIECES = GEMM_TOKENS * 16 / 256;  // a thread's 16-byte pieces of x (4)
    const bf16* x;                                           // token threadIdx.x / 16's unit threadIdx.x % 16
    const unsigned char* codes;                              // tile tile0 + threadIdx.x / 64's piece threadIdx.x % 64
    const unsigned char* scales;                             // (threads under 8 * SCALE_ROW)
    u32 x_in;                                                // bit k: token threadIdx.x / 16 + 16k is under `here`
    int col, cols, codes_in, scales_in, x_step;

    __device__ GemmCopier(const bf16* __restrict__ xb, int here, int cols_, const unsigned char* __restrict__ codes_,
                          const unsigned char* __restrict__ scales_, int tile0, int tiles, int chunks)
        : cols(cols_) {
        const int tok = threadIdx.x >> 4, unit = threadIdx.x & 15;
        x = xb + (u64)tok * cols + unit * 8;
        col = unit * 8;
        x_step = 16 * cols;
        x_in = 0;
#pragma unroll
        for (int k = 0; k < X_PIECES; k++) x_in |= (u32)(tok + 16 * k < here) << k;
        // The codes' threads: 256 a pass, 2 passes (tiles + 0..3, + 4..7).
        const int tile = tile0 + (threadIdx.x >> 6);
        codes = codes_ + (u64)tile * chunks * 1024 + 16 * (threadIdx.x & 63);
        codes_in = (tile < tiles) | (tile + 4 < tiles) << 1;
        const int stile = tile0 + threadIdx.x / SCALE_ROW;
        scales = scales_ + (u64)stile * chunks * 16 * SCALE_ROW + 16 * (threadIdx.x % SCALE_ROW);
        scales_in = threadIdx.x < 8 * SCALE_ROW && stile < tiles;
    }

    // Chunk c into the stage at `base` (a tile's chunks are 1 KB apart); a
    // zero-filled piece names the start of its matrix (`x0`, `codes0`,
    // `scales0`: the kernel's arguments), never an address past its end.
    __device__ __forceinline__ void copy(unsigned char* base, int c, int chunks, const bf16* x0,
                                         const unsigned char* codes0, const unsigned char* scales0) const {
        const u32 st = smem_u32(base);
        const bool cols_in = (c << 7) + col < cols;
        const u32 x_at = st + ((threadIdx.x >> 4) * GEMM_XS + gemm_unit(threadIdx.x & 15) * 8) * 2;
#pragma unroll
        for (int k = 0; k < X_PIECES; k++) {
            const bool in = cols_in && (x_in >> k & 1);
            cp_async16_shared(x_at + k * 16 * GEMM_XS * 2, in ? x + (c << 7) + (u64)k * x_step : x0, in ? 16 : 0);
        }
        const u32 cs = st + GEMM_X_BYTES + 16 * threadIdx.x;
        const unsigned char* src = codes + (u64)c * 1024;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const bool in = codes_in >> k & 1;
            cp_async16_shared(cs + k * 4096, in ? src + (u64)k * 4 * chunks * 1024 : codes0, in ? 16 : 0);
        }
        if (threadIdx.x < 8 * SCALE_ROW)
            cp_async16_shared(st + GEMM_X_BYTES + 128 * 64 + 16 * threadIdx.x,
                              scales_in ? scales + (u64)c * 16 * SCALE_ROW : scales0, scales_in ? 16 : 0);
    }
};

// A warp's 16 rows (ra, rb = ra + 8) of a 64-token block's sums, token tile
// nt's in acc[nt] (the mma's C layout: j0 = the block's first token + 2t):
// scaled to y, or (split columns) to `part` for fp4_splitk_sum.
__device__ __forceinline__ void gemm_store(const float (&acc)[GEMM_TOKENS / 8][4], float* __restrict__ y,
                                           float* __restrict__ part, const float* __restrict__ row_scale, int ra,
                                           int rb, int j0, int n, int rows, float out_pow2, int accumulate) {
#pragma unroll
    for (int nt = 0; nt < GEMM_TOKENS / 8; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = i < 2 ? ra : rb, j = j0 + nt * 8 + (i & 1);
            if (gridDim.z == 1)
                fp4_store(y, row < rows ? row_scale[row] : 0.0f, acc[nt][i], row, j, n, rows, out_pow2, accumulate);
            else if (row < rows && j < n)
                part[((u64)blockIdx.z * n + j) * rows + row] = acc[nt][i];
        }
}

// Warp `warp`'s tile of the chunk at `cs` (GemmCopier's layout) as
// the 8 mma steps' A fragments.
template <bool NV>
__device__ __forceinline__ void gemm_dequant(u32 (&a)[8][4], const unsigned char* cs, int warp, int g, int t) {
    constexpr int SCALE_ROW = fp4_scale_row<NV>();
    const unsigned char* ss = cs + 128 * 64;
    const unsigned char* ca = cs + warp * 1024 + 64 * fp4_slot(g) + 16 * t;  // rows g + 8 512 on
    const uint4 wa = *(const uint4*)ca, wb = *(const uint4*)(ca + 512);
    const unsigned char* sr = ss + warp * 16 * SCALE_ROW + SCALE_ROW * g;  // rows g + 8 8 rows on
    u32 sa, sb;
    if (NV) {
        sa = *(const unsigned short*)(sr + 2 * t);
        sb = *(const unsigned short*)(sr + 8 * SCALE_ROW + 2 * t);
    } else {
        sa = sr[t];
        sb = sr[8 * SCALE_ROW + t];
    }
    fp4_dequant<NV>(a, wa, wb, sa, sb);
}

// A GEMM block's share: lane (g, t) of warp `warp` holds rows ra and rb =
// ra + 8 of tile tile0 + warp (of `tiles`), the block's tokens are tok0 ..
// (`here` of them, x's rows from xb) and its split's chunks first + step *
// i for i < count (of the row's `chunks`).
struct GemmBlock {
    int warp, g, t, ra, rb, tile0, tiles, tok0, here, chunks, first, count;
    const bf16* xb;
    __device__ __forceinline__ GemmBlock(const bf16* x, int n, int rows, int cols, int per_split, int step) {
        warp = threadIdx.x >> 5;
        const int lane = threadIdx.x & 31;
        g = lane >> 2;
        t = lane & 3;
        ra = blockIdx.y * 128 + warp * 16 + g;
        rb = ra + 8;
        tile0 = blockIdx.y * 8;
        tiles = (rows + 15) >> 4;
        tok0 = blockIdx.x * GEMM_TOKENS;
        here = min(GEMM_TOKENS, n - tok0);
        chunks = (cols + 127) >> 7;
        const int z = blockIdx.z;
        first = step == 1 ? z * per_split : z;
        count = step == 1 ? max(0, min(chunks, first + per_split) - first) : max(0, (chunks - z + step - 1) / step);
        xb = x + (u64)tok0 * cols;
    }
};

// Zeroed sums, and the first STAGES - 1 chunks' copies (`load(stage,
// chunk)`) in flight. Every iteration after commits one group (empty past
// the end), so that "all but the newest STAGES - 2" always means "chunk
// `it` is in".
template <int STAGES, typename Load>
__device__ __forceinline__ void gemm_start(float (&acc)[GEMM_TOKENS / 8][4], const Load& load, int first, int count,
                                           int step) {
#pragma unroll
    for (int i = 0; i < GEMM_TOKENS / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < count) load(s, first + step * s);
        asm volatile("cp.async.commit_group;");
    }
}

// Chunk `it` in (waited for, then a barrier: every thread is past chunk
// `it - 1`), and chunk it + STAGES - 1's copies started (a group, empty past
// the end).
template <int STAGES, typename Load>
__device__ __forceinline__ void gemm_next(const Load& load, int it, int first, int count, int step) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
    __syncthreads();
    const int ahead = it + STAGES - 1;
    if (ahead < count) load(ahead % STAGES, first + step * ahead);
    asm volatile("cp.async.commit_group;");
}

template <bool NV>
__device__ __forceinline__ void fp4_gemm(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
                                         const float* __restrict__ row_scale, const bf16* __restrict__ x,
                                         float* __restrict__ y, float* __restrict__ part, int n, int rows, int cols,
                                         float out_pow2, int shift, int accumulate, int per_split, int step) {
    extern __shared__ __align__(16) unsigned char smem[];
    fp4_fill_scale_table<NV>(shift);
    const GemmBlock b(x, n, rows, cols, per_split, step);
    const int warp = b.warp, g = b.g, t = b.t, chunks = b.chunks, first = b.first, count = b.count;
    const GemmCopier<NV> copier(b.xb, b.here, cols, codes, scales, b.tile0, b.tiles, chunks);
    auto load = [&](int st, int c) { copier.copy(smem + st * GEMM_STAGE_BYTES, c, chunks, x, codes, scales); };

    float acc[GEMM_TOKENS / 8][4];
    gemm_start<GEMM_STAGES>(acc, load, first, count, step);
    for (int it = 0; it < count; it++) {
        gemm_next<GEMM_STAGES>(load, it, first, count, step);  // every warp is done with `it - 1`

        const unsigned char* base = smem + (it % GEMM_STAGES) * GEMM_STAGE_BYTES;
        u32 a[8][4];
        gemm_dequant<NV>(a, base + GEMM_X_BYTES, warp, g, t);
        const bf16* xs = (const bf16*)base;
#pragma unroll
        for (int nt = 0; nt < GEMM_TOKENS / 8; nt++) {
            uint4 xv[4];
            const bf16* row = xs + (nt * 8 + g) * GEMM_XS;
#pragma unroll
            for (int i = 0; i < 4; i++) xv[i] = *(const uint4*)(row + gemm_unit(4 * t + i) * 8);
            fp4_mma_chunk(acc[nt], a, xv);
        }
    }
    asm volatile("cp.async.wait_group 0;");
    gemm_store(acc, y, part, row_scale, b.ra, b.rb, b.tok0 + 2 * t, n, rows, out_pow2, accumulate);
}

#define FP4_GEMM_ARGS const unsigned char *__restrict__ codes, const unsigned char *__restrict__ scales, \
                      const float *__restrict__ row_scale, const bf16 *__restrict__ x, float *__restrict__ y, \
                      float *__restrict__ part, int n, int rows, int cols, float out_pow2, int shift, int accumulate, \
                      int per_split, int step
#define FP4_GEMM_PASS codes, scales, row_scale, x, y, part, n, rows, cols, out_pow2, shift, accumulate, per_split, step
extern "C" __global__ void __launch_bounds__(256) fp4_gemm_mx(FP4_GEMM_ARGS) { wait_for_previous_kernels(); fp4_gemm<false>(FP4_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256) fp4_gemm_nv(FP4_GEMM_ARGS) { wait_for_previous_kernels(); fp4_gemm<true>(FP4_GEMM_PASS); }

// The tiled GEMM on Hopper's warpgroup MMAs (sm_90a; the fast numerics,
// fp4.rs: SumOrder::Fastest): the same blocks, splits, copies and sums'
// layout as fp4_gemm, but each warpgroup (4 warps, 64 rows) multiplies a
// chunk with 8 `wgmma.mma_async.m64n64k16` whose A (the dequantized
// weights, the mma's A fragments as fp4_dequant makes them) comes from
// registers and whose B (x) the tensor cores read from shared memory
// themselves: fp4_gemm's warps each read the whole 64 x 128 x tile and issue
// 64 `mma.sync` a chunk (BENCHMARKS.md).
//
// B is K-major without swizzle: 8 x 8 core matrices (8 tokens x 16 bytes,
// 128 bytes each), core matrix (kb, nb) at (kb * 8 + nb) * 128, so a step's
// descriptor has its two K core matrices LBO = 1,024 bytes apart and its
// eight 8-token groups SBO = 128. Step j (= 2q + h) of a chunk multiplies
// lane t's column pairs 2h, 2h + 1 of word q (fp4_dequant's order), so its
// core matrix row kb = 2j + s holds, for t = 0..3, x's columns 32t + 8q + 4h
// + 2s and + 1: column cc of the chunk sits in row (cc % 32) / 2, word
// cc / 32. The chunk's x arrives with the weights as fp4_gemm has it
// (GEMM_STAGES - 1 chunks ahead, by cp.async) and each thread moves one
// token's 16 bytes of 4 column runs 32 apart (token thread % 64, q = thread
// / 64) into 4 rows of that layout, in a buffer of its own. (Loaded into
// registers one chunk ahead instead, x's latency showed: a layer at 64
// tokens 685 -> 640 GB/s on an H100.) 3 stages, for 2 blocks an SM.
#define WG_STAGES 3
#define WG_X_BYTES (GEMM_TOKENS * 128 * 2)

__device__ __forceinline__ unsigned long long wg_desc_kmajor(u32 addr, u32 lbo, u32 sbo) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}

// D (64 x 64 f32: acc[nt] is token tile nt, the mma's C layout) += A B.
__device__ __forceinline__ void wg_mma_m64n64k16(float (&d)[GEMM_TOKENS / 8][4], const u32 (&a)[4],
                                                 unsigned long long desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, 1, 1, 1, 0;"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
}

template <bool NV>
__device__ __forceinline__ void fp4_gemm_wg(const unsigned char* __restrict__ codes,
                                            const unsigned char* __restrict__ scales,
                                            const float* __restrict__ row_scale, const bf16* __restrict__ x,
                                            float* __restrict__ y, float* __restrict__ part, int n, int rows, int cols,
                                            float out_pow2, int shift, int accumulate, int per_split, int step) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char smem[];
    fp4_fill_scale_table<NV>(shift);
    const GemmBlock b(x, n, rows, cols, per_split, step);
    const int warp = b.warp, g = b.g, t = b.t, chunks = b.chunks, first = b.first, count = b.count;
    unsigned char* wg_x = smem + WG_STAGES * GEMM_STAGE_BYTES;
    // This thread's move: token `tok`'s units 4w + q (w = 0..3) to rows 4q ..
    // 4q + 3 of its 8-token group (1,024 bytes a row).
    const int tok = threadIdx.x & 63, q = threadIdx.x >> 6;
    const u32 x_to = smem_u32(wg_x) + (u32)((4 * q * 8 + (tok >> 3)) * 128 + (tok & 7) * 16);
    const int x_from = tok * GEMM_XS * 2;
    const GemmCopier<NV> copier(b.xb, b.here, cols, codes, scales, b.tile0, b.tiles, chunks);
    auto load = [&](int st, int c) { copier.copy(smem + st * GEMM_STAGE_BYTES, c, chunks, x, codes, scales); };

    float acc[GEMM_TOKENS / 8][4];
    gemm_start<WG_STAGES>(acc, load, first, count, step);
    for (int it = 0; it < count; it++) {
        gemm_next<WG_STAGES>(load, it, first, count, step);  // every warpgroup's wgmmas of `it - 1` are done

        unsigned char* base = smem + (it % WG_STAGES) * GEMM_STAGE_BYTES;
        uint4 xr[4];
#pragma unroll
        for (int w = 0; w < 4; w++) xr[w] = lds128(smem_u32(base) + x_from + gemm_unit(4 * w + q) * 16);
#pragma unroll
        for (int r = 0; r < 4; r++)  // row kb = 4q + r: word r of each run
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(x_to + r * 1024), "r"(word(xr[0], r)),
                         "r"(word(xr[1], r)), "r"(word(xr[2], r)), "r"(word(xr[3], r)));
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // for the tensor cores' reads
        u32 a[8][4];
        gemm_dequant<NV>(a, base + GEMM_X_BYTES, warp, g, t);
        __syncthreads();  // the chunk's x in the wgmma layout
        const u32 xs = smem_u32(wg_x);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 8; j++) wg_mma_m64n64k16(acc, a[j], wg_desc_kmajor(xs + j * 2048, 1024, 128));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
    asm volatile("cp.async.wait_group 0;");
    gemm_store(acc, y, part, row_scale, b.ra, b.rb, b.tok0 + 2 * t, n, rows, out_pow2, accumulate);
#endif
}
extern "C" __global__ void __launch_bounds__(256) fp4_gemm_wg_mx(FP4_GEMM_ARGS) {
    wait_for_previous_kernels();
    fp4_gemm_wg<false>(FP4_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(256) fp4_gemm_wg_nv(FP4_GEMM_ARGS) {
    wait_for_previous_kernels();
    fp4_gemm_wg<true>(FP4_GEMM_PASS);
}

// y[j, r] (+)= row_scale[r] * out_pow2 * sum over splits of part[s, j, r].
extern "C" __global__ void fp4_splitk_sum(const float* __restrict__ part, int splits, const float* __restrict__ row_scale,
                                          float out_pow2, float* __restrict__ y, int n, int rows, int accumulate) {
    wait_for_previous_kernels();
    const u64 total = (u64)n * rows;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int z = 0; z < splits; z++) s += part[(u64)z * total + i];
        const float v = __fmul_rn(__fmul_rn(s, out_pow2), row_scale[i % rows]);
        y[i] = accumulate ? __fadd_rn(y[i], v) : v;
    }
}

// A scale byte's value: E4M3 (sign, 4 exponent bits of bias 7, 3 mantissa
// bits; 0x7f and 0xff NaN) and E8M0 (2^(e - 127); 0 is 2^-127, 255 NaN), as
// compute/fp4.rs decodes them.
__device__ __forceinline__ float e4m3_f32(u32 c) {
    const u32 e = (c >> 3) & 0xfu, m = c & 7u;
    float v = e == 0u ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    if (e == 0xfu && m == 7u) v = __int_as_float(0x7fc00000);
    return (c & 0x80u) ? -v : v;
}
__device__ __forceinline__ float e8m0_f32(u32 c) {
    return c == 255u ? __int_as_float(0x7fc00000) : c == 0u ? __int_as_float(0x00400000) : __uint_as_float(c << 23);
}

// The weights as BF16 (for the GEMMs of many tokens): out[r, c] =
// E2M1 * scale * row_scale[r], with the scales' true values (no 2^126 trick).
// A thread takes 32 weights (16 bytes of codes in the tiled layout, one
// row's block of 32): one 16-byte load, four 16-byte stores.
extern "C" __global__ void fp4_to_bf16(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
                                       const float* __restrict__ row_scale, bf16* __restrict__ out, int rows, int cols,
                                       int nv) {
    wait_for_previous_kernels();
    const u64 groups = (u64)rows * cols / 32;
    for (u64 gi = blockIdx.x * (u64)blockDim.x + threadIdx.x; gi < groups; gi += (u64)gridDim.x * blockDim.x) {
        const u64 e0 = gi * 32, r = e0 / cols;
        const int c0 = (int)(e0 % cols), lane_t = (c0 >> 5) & 3;
        const int scale_row = nv ? fp4_scale_row<true>() : fp4_scale_row<false>();
        const u64 item = (r >> 4) * (u64)((cols + 127) >> 7) + (c0 >> 7);  // the tile's chunk
        const float rs = row_scale[r];
        const unsigned char* sc_at = scales + item * 16 * scale_row + (r & 15) * scale_row;
        float s[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 sc = nv ? sc_at[2 * lane_t + h] : sc_at[lane_t];
            s[h] = (nv ? e4m3_f32(sc) : e8m0_f32(sc)) * rs;
        }
        const uint4 w = *(const uint4*)(codes + item * 1024 + 64 * fp4_slot((int)(r & 15)) + 16 * lane_t);
        u32 o[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            // Columns 2i, 2i + 1: pair i % 4 of word i / 4, the E2M1 values
            // times 2^-126 (exact), times 2^126 (exact) and the scale.
            const u32 q = word(w, i >> 2), scale_at = i >> 3;  // 16 weights a half
            const u32 bits = (i & 3) == 0   ? fp4_pair_bits<0>(q)
                             : (i & 3) == 1 ? fp4_pair_bits<1>(q)
                             : (i & 3) == 2 ? fp4_pair_bits<2>(q)
                                            : fp4_pair_bits<3>(q);
            const float lo = bf16_lo(bits) * 8.507059173023462e37f * s[scale_at];  // 2^126
            const float hi = bf16_hi(bits) * 8.507059173023462e37f * s[scale_at];
            o[i] = (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
        }
        uint4* dst = (uint4*)(out + e0);
#pragma unroll
        for (int i = 0; i < 4; i++) dst[i] = make_uint4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
    }
}

// --- The activations, quantized per token (for fp4_blackwell.cu's
// block-scaled MMA, which takes E2M1 on both sides) ---

// The E2M1 code of x: nearest, ties to the even code, saturating at 6, NaN
// and +-0 to code 0 (compute/fp4.rs's e2m1_encode, threshold for threshold;
// Blackwell's cvt.rn.satfinite.e2m1x2 would keep -0's sign and is not on
// Hopper, where this is tested).
__device__ __forceinline__ u32 e2m1_code(float x) {
    const float a = fabsf(x);
    const u32 c = !(a > 0.25f) ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u : a <= 2.5f ? 4u
                : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
    return c == 0u ? 0u : c | (__float_as_uint(x) >> 31 << 3);
}

// Two values as E2M1 codes in one byte: lo in bits 0-3, hi in 4-7.
__device__ __forceinline__ u32 e2m1x2(float lo, float hi) { return e2m1_code(lo) | (e2m1_code(hi) << 4); }

// x / step for 16 BF16 values (two 16-byte words) as 8 bytes of codes
// (all zero when step is 0, as on the CPU).
__device__ __forceinline__ uint2 e2m1_codes16(uint4 a, uint4 b, float step) {
    if (!(step > 0.0f)) return make_uint2(0, 0);
    const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    u32 out[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++)
        out[i >> 2] |= e2m1x2(__fdiv_rn(bf16_lo(w[i]), step), __fdiv_rn(bf16_hi(w[i]), step)) << (8 * (i & 3));
    return make_uint2(out[0], out[1]);
}

__device__ __forceinline__ float amax16(uint4 a, uint4 b) {
    const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) m = fmaxf(m, fmaxf(fabsf(bf16_lo(w[i])), fabsf(bf16_hi(w[i]))));
    return m;
}

// Token t's row of x (cols BF16) as FP4 codes (cols / 2 bytes, file order)
// and scales (cols / 16 E4M3 bytes: NV, with the tensor scale amax / (6 *
// 448) in act_scale[t]; cols / 32 E8M0 bytes: MX, act_scale 1). One block a
// token; cols a multiple of 32.
template <bool NV>
__device__ __forceinline__ void fp4_quantize_act(const bf16* __restrict__ x, int cols, unsigned char* __restrict__ codes,
                                                 unsigned char* __restrict__ scales, float* __restrict__ act_scale) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    const uint4* row = (const uint4*)(x + (u64)t * cols);  // 8 values a word
    uint2* out = (uint2*)(codes + (u64)t * (cols >> 1));    // 16 codes a word
    float tensor = 1.0f;
    if (NV) {
        float m = 0.0f;
        for (int i = threadIdx.x; i < cols / 16; i += blockDim.x) m = fmaxf(m, amax16(row[2 * i], row[2 * i + 1]));
        m = block_max(m, scratch);
        tensor = m > 0.0f ? m / (6.0f * 448.0f) : 1.0f;
        if (threadIdx.x == 0) act_scale[t] = tensor;
        for (int i = threadIdx.x; i < cols / 16; i += blockDim.x) {
            const uint4 a = row[2 * i], b = row[2 * i + 1];
            u32 code;
            // E4M3 of amax / 6 / tensor, nearest even, saturating at 448.
            asm("{\n\t.reg .b16 t;\n\tcvt.rn.satfinite.e4m3x2.f32 t, %1, %2;\n\tcvt.u32.u16 %0, t;\n\t}"
                : "=r"(code)
                : "f"(0.0f), "f"(amax16(a, b) / 6.0f / tensor));
            code &= 0xffu;
            scales[(u64)t * (cols / 16) + i] = (unsigned char)code;
            out[i] = e2m1_codes16(a, b, e4m3_f32(code) * tensor);
        }
    } else {
        if (threadIdx.x == 0) act_scale[t] = 1.0f;
        for (int i = threadIdx.x; i < cols / 32; i += blockDim.x) {
            const uint4 a = row[4 * i], b = row[4 * i + 1], c = row[4 * i + 2], d = row[4 * i + 3];
            const float m = fmaxf(amax16(a, b), amax16(c, d));
            // floor(log2(amax)) - 2 as a biased exponent, from amax's own
            // exponent bits (0 for zero and subnormal blocks, as on the CPU).
            const int e = (int)((__float_as_uint(m) >> 23) & 0xffu);
            const int code = e == 0 ? 0 : min(max(e - 2, 0), 254);
            scales[(u64)t * (cols / 32) + i] = (unsigned char)code;
            const float step = e8m0_f32((u32)code);
            out[2 * i] = e2m1_codes16(a, b, m > 0.0f ? step : 0.0f);
            out[2 * i + 1] = e2m1_codes16(c, d, m > 0.0f ? step : 0.0f);
        }
    }
}

#define QUANT_ARGS const bf16 *__restrict__ x, int cols, unsigned char *__restrict__ codes, \
                   unsigned char *__restrict__ scales, float *__restrict__ act_scale
extern "C" __global__ void fp4_quantize_act_mx(QUANT_ARGS) { wait_for_previous_kernels(); fp4_quantize_act<false>(x, cols, codes, scales, act_scale); }
extern "C" __global__ void fp4_quantize_act_nv(QUANT_ARGS) { wait_for_previous_kernels(); fp4_quantize_act<true>(x, cols, codes, scales, act_scale); }
