//! FP4 weights on the GPU, the Hopper path: [`Fp4Matrix`]es uploaded in
//! the kernels' tiled layout (codes reordered within each 8 columns and
//! stored by 16-row x 128-column tiles, scale bytes likewise, and one f32
//! per row for NVFP4's tensor scale, so that matrices quantized apart run
//! fused), and the weight-only kernels
//! of `kernels/fp4.cu`, which dequantize in registers and multiply on the
//! BF16 tensor cores: a GEMV (up to 16 tokens a block), a tiled GEMM (more;
//! on warpgroup MMAs in the fast numerics on sm_90a),
//! and a dequantization to BF16 for cuBLAS; with their measurements
//! (`fp4_sweep`, `fp4_prefill_sweep`).

use cudarc::driver::CudaSlice;
use serde::Serialize;

use super::bench::median_secs;
use super::device::{DevPtr, Gpu, GpuError, KernelArg, elementwise, grid};
use super::fp4_blackwell::{BLOCKSCALED_COLS_MULTIPLE, blockscaled_path};
use crate::compute::fp4::{Fp4Format, Fp4Matrix};
use crate::model::LlamaConfig;

/// Columns a row must be a multiple of (a kernel lane's 32 columns are all
/// in the row or all out).
pub const FP4_COLS_MULTIPLE: usize = 32;

/// Rows the fused one-token GEMVs take a multiple of (whole 16-row tiles,
/// each of 8 RoPE pairs or 8 gate rows with their up rows).
pub const FP4_FUSED_ROWS_MULTIPLE: usize = 16;

/// Tokens a GEMV block takes for a call of `n`: 8 when that is all, else 16
/// (the `_n8` and `_n16` kernels; the fused one-token kernels are n8's).
fn gemv_tokens_per_block(n: usize) -> usize {
    if n <= 8 { 8 } else { 16 }
}

/// Row tiles a warp's item takes in the GEMV for blocks of `tokens` tokens
/// over a matrix of `row_tiles` 16-row tiles (`fp4.cu`'s TILES). One at 8
/// tokens (pairs read 2-3% slower there). At 16, where x is 4 times a
/// chunk's bytes, a group loads it once for all its tiles: two (an 8B
/// layer's GEMVs 1,198-1,206 -> 1,529-1,541 GB/s on an H100), or three (the
/// `_t3` kernels) where there are groups of three for nine SMs in ten at
/// least: on an H100 gate/up and qkv then read 8-10% faster, while o and down
/// (256 tiles, 86 groups of three for 132 SMs) read 10-13% slower
/// (BENCHMARKS.md).
fn gemv_tiles(tokens: usize, row_tiles: usize, sm_count: u32) -> u32 {
    match tokens {
        16 if 10 * row_tiles.div_ceil(3) >= 9 * sm_count as usize => 3,
        16 => 2,
        _ => 1,
    }
}

/// Whether the GEMV for blocks of `tokens` tokens in groups of `tiles` row
/// tiles over `cols` columns runs `fp4.cu`'s rotated chunk orders (the
/// `_rot` kernels): only for the fastest order (they are not the GEMV's
/// bits), at 16 tokens in pairs, and where a warp has 8 chunks of a tile or
/// more (8,192 columns: an 8B model's down projection). There all blocks
/// reading the same x at once made x's lines a hot spot (down 12-13% faster
/// rotated on an H200, 9-10% on an H100); with fewer chunks too few orders
/// exist, and the narrower matrices read slower (BENCHMARKS.md).
fn gemv_rotates(order: SumOrder, tokens: usize, tiles: u32, cols: usize) -> bool {
    order == SumOrder::Fastest
        && tokens == 16
        && tiles == 2
        && cols >= 8 * FP4_WARPS as usize * CHUNK_COLS
}

/// Warps per block of the kernels (`fp4.cu`'s GEMV_WARPS).
const FP4_WARPS: u32 = 8;

/// The GEMV's shared memory for its copy pipeline (`fp4.cu`: GEMV_WARPS x
/// GEMV_STAGES x GEMV_STAGE_BYTES, times the row tiles a warp's item takes).
const fn gemv_smem(tiles: u32) -> u32 {
    tiles * FP4_WARPS * 2 * (1024 + 128)
}

/// Tokens a GEMM block takes (`fp4.cu`'s GEMM_TOKENS) and rows (a 16-row
/// tile per warp).
const GEMM_TOKENS: usize = 64;
const GEMM_ROWS: usize = 16 * FP4_WARPS as usize;
/// A GEMM stage: x (64 tokens x 144 padded columns of BF16), codes (128
/// rows x 64 bytes) and scales (128 x 8 bytes); the GEMM's dynamic shared
/// memory holds GEMM_STAGES (4) of them.
const GEMM_STAGE: u32 = 64 * 144 * 2 + 128 * 64 + 128 * 8;
const GEMM_SMEM: u32 = 4 * GEMM_STAGE;
/// The warpgroup GEMM's (`fp4_gemm_wg_*`): 3 such stages and x in the
/// tensor cores' layout (64 tokens x 128 columns of BF16).
const GEMM_WG_SMEM: u32 = 3 * GEMM_STAGE + 64 * 128 * 2;

/// How the tiled GEMM splits a `rows x cols` matrix's columns for `n` tokens
/// on `sm_count` SMs: (splits, chunks per split, step), as `fp4.cu`'s
/// fp4_gemm reads them (split z takes chunks z * per_split .. with step 1,
/// z, z + step, .. otherwise).
fn gemm_splits(
    rows: usize,
    cols: usize,
    n: usize,
    sm_count: u32,
    order: SumOrder,
) -> (usize, usize, usize) {
    if order == SumOrder::AsGemv {
        // Split w takes the chunks GEMV warp w takes, in its order.
        return (FP4_WARPS as usize, 0, FP4_WARPS as usize);
    }
    // Enough blocks for two a SM, in runs of whole chunks.
    let chunks = cols.div_ceil(128);
    let blocks = rows.div_ceil(GEMM_ROWS) * n.div_ceil(GEMM_TOKENS);
    let wanted = (2 * sm_count as usize).div_ceil(blocks).clamp(1, chunks);
    let per_split = chunks.div_ceil(wanted);
    (chunks.div_ceil(per_split), per_split, 1)
}

/// Whether the tiled GEMM runs on Hopper's warpgroup MMAs (`fp4.cu`'s
/// `fp4_gemm_wg_*`: `wgmma` with x read by the tensor cores from shared
/// memory, against `mma.sync` with every warp reading all of x): on sm_90a,
/// in the fast numerics (the tensor cores' sums need not equal the GEMV's
/// there).
fn gemm_on_warpgroups(gpu: &Gpu, order: SumOrder) -> bool {
    order == SumOrder::Fastest && gpu.arch == "sm_90a"
}

/// The order in which the tiled GEMM sums a token's products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SumOrder {
    /// The GEMV's (batch-invariant numerics: the same bits whichever kernel
    /// a step's size picks).
    AsGemv,
    /// Whatever fills the GPU best.
    Fastest,
}

/// The bf16 bits a column pair decodes to: each column's magnitude (e1 e0
/// m0) at bits 8..6 and its sign at 15, the high column the same 16 up.
const PAIR_MASK: u32 = 0x81c0_81c0;

/// `fp4_pair_bits` of `fp4.cu`, transcribed (`fp4.cu`, Layout): column pair
/// p (columns 2p, 2p + 1) of a word in the kernels' order as bf16x2 bits
/// (the E2M1 values times 2^-126). Each pair is one mask of the word, a
/// shift or rotation of it, or of two shifts XORed.
fn pair_bits(w: u32, p: usize) -> u32 {
    match p {
        0 => w & PAIR_MASK,
        1 => (w << 6) & PAIR_MASK,
        2 => w.rotate_left(12) & PAIR_MASK,
        _ => ((w << 2) ^ (w >> 6)) & PAIR_MASK,
    }
}

/// Everything `pair_bits` gives out of a word, as eight codes in the file's
/// order: pair p's `PAIR_MASK` bits (6, 7, 8, 15, 22, 23, 24, 31) as byte
/// p's bits 0-7 (m0 e0 e1 s of column 2p, then of column 2p + 1). Linear
/// over GF(2).
fn decoded(w: u32) -> u32 {
    let mask_bits = || (0..32).filter(|b| (PAIR_MASK >> b) & 1 == 1);
    (0..4).fold(0, |out, p| {
        let bits = pair_bits(w, p);
        mask_bits()
            .enumerate()
            .fold(out, |out, (i, at)| out | ((bits >> at) & 1) << (8 * p + i))
    })
}

/// Eight codes (columns 0..7, column c in bits 4c..4c+3, the file order:
/// element 2i in the low nibble of byte i) in the kernels' order: the word
/// `decoded` takes back to them. `decoded` is linear and invertible, so the
/// word is the XOR of the words that decode to each of the file word's set
/// bits (found once, by Gauss-Jordan elimination over GF(2)), kept as one
/// table per file byte: four lookups a word while a model loads.
fn kernel_code_order(file: u32) -> u32 {
    static ENCODE: std::sync::OnceLock<[[u32; 256]; 4]> = std::sync::OnceLock::new();
    let encode = ENCODE.get_or_init(|| {
        // Rows pair a decoded word with the word that decodes to it; reduced
        // until row k decodes to bit k alone.
        let mut rows: [(u32, u32); 32] = std::array::from_fn(|i| (decoded(1 << i), 1 << i));
        for bit in 0..32 {
            let pivot = (bit..32)
                .find(|&r| (rows[r].0 >> bit) & 1 == 1)
                .expect("pair_bits loses no bit of the word");
            rows.swap(bit, pivot);
            let (out, word) = rows[bit];
            for (r, row) in rows.iter_mut().enumerate() {
                if r != bit && (row.0 >> bit) & 1 == 1 {
                    *row = (row.0 ^ out, row.1 ^ word);
                }
            }
        }
        std::array::from_fn(|byte| {
            std::array::from_fn(|value| {
                (0..8)
                    .filter(|i| (value >> i) & 1 == 1)
                    .fold(0, |w, i| w ^ rows[8 * byte + i].1)
            })
        })
    });
    file.to_le_bytes()
        .iter()
        .zip(encode)
        .fold(0, |w, (&byte, table)| w ^ table[byte as usize])
}

/// Rows of a tile and columns of a chunk in the kernels' tiled layout.
const TILE_ROWS: usize = 16;
const CHUNK_COLS: usize = 128;

/// Where tile row `r`'s 64 bytes of codes sit in its tile's 1 KB chunk (in
/// 64-byte slots): rows 2 and 3, 6 and 7, .. swapped, so that both of
/// `fp4.cu`'s lane-to-row maps (rows g and g + 8; 2g and 2g + 1) read a
/// quarter-warp's 16-byte loads from 8 distinct bank groups (`fp4_slot`).
fn tile_slot(r: usize) -> usize {
    r ^ ((r >> 1) & 1)
}

/// Row-major codes (in the kernels' order) and scale bytes of a `rows x
/// cols` matrix with a scale per `block` columns, in the Hopper kernels'
/// tiled layout (`fp4.cu`, "Tiled layout"): 16-row tile i's 128-column chunk
/// c is 1 KB of codes at (i x chunks + c) KB, row r's 64 bytes in slot
/// `tile_slot(r)`, and 16 rows of 128 / block scale bytes at (i x chunks +
/// c) x 16 x 128 / block; rows padded to 16 and columns to 128 with zeros.
fn tiled_layout(
    rows: usize,
    cols: usize,
    block: usize,
    codes: &[u8],
    scales: &[u8],
) -> (Vec<u8>, Vec<u8>) {
    let chunks = cols.div_ceil(CHUNK_COLS);
    let (chunk_codes, row_scales) = (CHUNK_COLS / 2, CHUNK_COLS / block);
    let (code_row, scale_row) = (cols / 2, cols / block);
    let (code_bytes, scale_bytes) = tiled_bytes(rows, cols, block);
    let mut tiled_codes = vec![0u8; code_bytes];
    let mut tiled_scales = vec![0u8; scale_bytes];
    for r in 0..rows {
        let (tile, in_tile) = (r / TILE_ROWS, r % TILE_ROWS);
        let codes = &codes[r * code_row..(r + 1) * code_row];
        let scales = &scales[r * scale_row..(r + 1) * scale_row];
        for (c, (codes, scales)) in codes
            .chunks(chunk_codes)
            .zip(scales.chunks(row_scales))
            .enumerate()
        {
            let item = tile * chunks + c;
            let at = (item * TILE_ROWS + tile_slot(in_tile)) * chunk_codes;
            tiled_codes[at..at + codes.len()].copy_from_slice(codes);
            let at = (item * TILE_ROWS + in_tile) * row_scales;
            tiled_scales[at..at + scales.len()].copy_from_slice(scales);
        }
    }
    (tiled_codes, tiled_scales)
}

/// Bytes of codes and of scales a `rows x cols` matrix takes in the tiled
/// layout.
fn tiled_bytes(rows: usize, cols: usize, block: usize) -> (usize, usize) {
    let cells = rows.div_ceil(TILE_ROWS) * TILE_ROWS * cols.div_ceil(CHUNK_COLS) * CHUNK_COLS;
    (cells / 2, cells / block)
}

/// One FP4 matrix (or several stacked by rows) on the device.
#[derive(Debug)]
pub struct Fp4Weights {
    pub rows: usize,
    pub cols: usize,
    pub format: Fp4Format,
    pub(super) codes: CudaSlice<u8>,
    pub(super) scales: CudaSlice<u8>,
    /// Each row's tensor scale (NVFP4; 1 for MXFP4).
    pub(super) row_scale: CudaSlice<f32>,
    /// MXFP4: the power of two taken out of every scale so that the largest
    /// times 2^126 stays within bf16 (`fp4.cu`); 0 for NVFP4.
    shift: i32,
    /// Codes in the file's order, for the Blackwell path
    /// (`fp4_blackwell::blockscaled_path`), not the Hopper kernels' order.
    pub(super) file_order: bool,
}

impl Fp4Weights {
    pub fn upload(gpu: &Gpu, m: &Fp4Matrix) -> Result<Fp4Weights, GpuError> {
        Self::stack(gpu, &[m])
    }

    /// `parts` one under the other, as one matrix (Q, K and V as one QKV):
    /// each keeps its own tensor scale. Codes go up in the kernels' order
    /// (`kernel_code_order`), codes and scales in the tiled layout
    /// (`tiled_layout`), or both as in the file for the Blackwell path.
    pub fn stack(gpu: &Gpu, parts: &[&Fp4Matrix]) -> Result<Fp4Weights, GpuError> {
        let first = parts
            .first()
            .ok_or_else(|| GpuError::Other("no FP4 matrix to stack".into()))?;
        let (format, cols) = (first.format, first.cols);
        if !cols.is_multiple_of(FP4_COLS_MULTIPLE) {
            return Err(GpuError::Other(format!(
                "the FP4 kernels take rows of whole {FP4_COLS_MULTIPLE}-column groups; this matrix has {cols} columns"
            )));
        }
        if let Some(odd) = parts.iter().find(|m| m.format != format || m.cols != cols) {
            return Err(GpuError::Other(format!(
                "stacking FP4 matrices of different kinds: {:?} x {} under {format:?} x {cols}",
                odd.format, odd.cols
            )));
        }
        let rows = parts.iter().map(|m| m.rows).sum();
        let mut codes: Vec<u8> = Vec::with_capacity(rows * cols / 2);
        let mut scales = Vec::with_capacity(rows * cols / format.block());
        let mut row_scale = Vec::with_capacity(rows);
        let file_order = blockscaled_path(gpu);
        if file_order && !cols.is_multiple_of(BLOCKSCALED_COLS_MULTIPLE) {
            return Err(GpuError::Other(format!(
                "the Blackwell FP4 path takes rows of whole {BLOCKSCALED_COLS_MULTIPLE}-column steps; this matrix has {cols} columns"
            )));
        }
        for m in parts {
            if file_order {
                codes.extend_from_slice(&m.codes);
            } else {
                codes.extend(m.codes.chunks_exact(4).flat_map(|w| {
                    kernel_code_order(u32::from_le_bytes([w[0], w[1], w[2], w[3]])).to_le_bytes()
                }));
            }
            scales.extend_from_slice(&m.scales);
            row_scale.extend(std::iter::repeat_n(m.tensor_scale, m.rows));
        }
        // E8M0 code e is 2^(e - 127); the kernel multiplies by 2^(e - 1 -
        // shift), which must stay below 2^128 (NaN codes, 255, aside).
        let largest = scales.iter().filter(|&&e| e != 255).max().copied();
        let shift = match format {
            Fp4Format::Mxfp4 => largest.map_or(0, |e| (i32::from(e) - 128).max(0)),
            Fp4Format::Nvfp4 => 0,
        };
        let (codes, scales) = if file_order {
            (codes, scales)
        } else {
            tiled_layout(rows, cols, format.block(), &codes, &scales)
        };
        Ok(Fp4Weights {
            rows,
            cols,
            format,
            codes: gpu.upload(&codes)?,
            scales: gpu.upload(&scales)?,
            row_scale: gpu.upload(&row_scale)?,
            shift,
            file_order,
        })
    }

    /// Generated weights (synthetic models): random E2M1 codes under one
    /// scale chosen so that the weights' RMS is about that of uniform values
    /// in [-1/sqrt(cols), 1/sqrt(cols)), as `fill_uniform_bf16` makes them.
    pub fn synthetic(
        gpu: &Gpu,
        format: Fp4Format,
        rows: usize,
        cols: usize,
        seed: u64,
    ) -> Result<Fp4Weights, GpuError> {
        let file_order = blockscaled_path(gpu);
        let multiple = if file_order {
            BLOCKSCALED_COLS_MULTIPLE
        } else {
            FP4_COLS_MULTIPLE
        };
        if !cols.is_multiple_of(multiple) || !(rows * cols).is_multiple_of(8) {
            return Err(GpuError::Other(format!(
                "a synthetic FP4 matrix of {rows} x {cols}"
            )));
        }
        // Uniform codes have an RMS of sqrt(68.5 / 8) = 2.93 times the scale.
        let target = 1.0 / (cols as f32).sqrt() / 3f32.sqrt() / 2.93;
        let (scale_code, tensor_scale) = match format {
            Fp4Format::Mxfp4 => (
                (target.log2().round() as i32 + 127).clamp(1, 254) as u8,
                1.0,
            ),
            // Block scales of 1.0 (E4M3 0x38), the rest in the tensor scale.
            Fp4Format::Nvfp4 => (0x38u8, target),
        };
        let (code_bytes, scale_bytes) = if file_order {
            (rows * cols / 2, rows * cols / format.block())
        } else {
            tiled_bytes(rows, cols, format.block())
        };
        let codes = gpu.alloc::<u8>(code_bytes)?;
        let words = (code_bytes / 4) as u64;
        // The only kernel that writes weights: the uploads below must follow
        // it on the stream, so that no GEMV that copies weights before it
        // waits for the kernel ahead (common.cuh) comes right after it.
        // SAFETY: `codes` holds code_bytes bytes, `words` u32s.
        gpu.launch(
            "fill_random_u32",
            elementwise(words as usize),
            &[&gpu.ptr(&codes, 0), &words, &seed],
        )?;
        Ok(Fp4Weights {
            rows,
            cols,
            format,
            codes,
            scales: gpu.upload(&vec![scale_code; scale_bytes])?,
            row_scale: gpu.upload(&vec![tensor_scale; rows])?,
            shift: 0,
            // Random codes: any order is the same distribution.
            file_order,
        })
    }

    /// A second copy on the same device (for bandwidth sweeps larger than L2).
    pub fn duplicate(&self, gpu: &Gpu) -> Result<Fp4Weights, GpuError> {
        Ok(Fp4Weights {
            codes: gpu.stream.clone_dtod(&self.codes)?,
            scales: gpu.stream.clone_dtod(&self.scales)?,
            row_scale: gpu.stream.clone_dtod(&self.row_scale)?,
            ..*self
        })
    }

    /// The power of two the kernel's scales left out, which it multiplies
    /// the sums by (MX: 2^shift; NV: 2^8, see fp4.cu).
    fn out_pow2(&self) -> f32 {
        let taken = match self.format {
            Fp4Format::Mxfp4 => self.shift,
            Fp4Format::Nvfp4 => 8,
        };
        2f32.powi(taken)
    }

    /// The Hopper kernels' check: codes in their order, not the file's.
    fn in_hopper_order(&self) -> Result<(), GpuError> {
        if self.file_order {
            return Err(GpuError::Other(
                "FP4 weights uploaded for the Blackwell path (SLUICE_FP4_TCGEN05=1) go through gemm_blockscaled".into(),
            ));
        }
        Ok(())
    }

    /// Bytes one call reads from the weights (codes and scales).
    pub fn bytes(&self) -> usize {
        self.rows * self.cols / 2 + self.rows * self.cols / self.format.block()
    }

    /// `y[j, r] (+)= sum_c w[r, c] x[j, c]` for `j < n`: `x` is `n` rows of
    /// `cols` BF16 values, `y` `n` rows of `rows` f32, added to with
    /// `accumulate`. In `SumOrder::AsGemv` each token's sums are taken in
    /// the same order whatever `n` is (batch-invariant); `Fastest` may take
    /// another (`gemv_rotates`).
    pub fn gemv(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        y: DevPtr,
        n: usize,
        accumulate: bool,
        order: SumOrder,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let tokens = gemv_tokens_per_block(n);
        let kernel = format!("n{tokens}");
        // The 16-token kernels copy their first weights before they wait (the
        // 8-token one, launched so, read 1.8% slower at batch 8: it waits
        // first; BENCHMARKS.md).
        self.launch_gemv(gpu, &kernel, x, y, n, accumulate, order, tokens == 16, &[])
    }

    /// One token's GEMV with a fused epilogue (`fp4.cu`'s FP4_NORM_ROPE and
    /// kin; `layers::fp4_gemv_norm_rope` and its kin say what each does):
    /// `kernel` names it ("norm_rope", "norm_swiglu", "residual"), `epilogue`
    /// is the kernel's parameters after the GEMV's (FP4_FUSED_ARGS).
    pub(super) fn gemv_one_token(
        &self,
        gpu: &Gpu,
        kernel: &str,
        x: DevPtr,
        y: DevPtr,
        accumulate: bool,
        epilogue: &[&dyn KernelArg],
    ) -> Result<(), GpuError> {
        if !self.rows.is_multiple_of(FP4_FUSED_ROWS_MULTIPLE) {
            return Err(GpuError::Other(format!(
                "the fused FP4 GEMVs take rows in whole {FP4_FUSED_ROWS_MULTIPLE}s, not {}",
                self.rows
            )));
        }
        // One order: the fused kernels have no rotated forms.
        let name = format!("{kernel}_n1");
        self.launch_gemv(
            gpu,
            &name,
            x,
            y,
            1,
            accumulate,
            SumOrder::AsGemv,
            true,
            epilogue,
        )
    }

    /// Launches `fp4_gemv_{mx|nv}_{kernel}` with the GEMV's parameters, then
    /// `extra`: as many blocks as the GPU holds at once, walking the row tiles
    /// in groups of `gemv_tiles` (the kernel's TILES), in rotated orders
    /// where `gemv_rotates`. `early`: a kernel that copies its first weights
    /// before it waits for the kernel ahead (the fused and 16-token ones),
    /// launched so (`Gpu::launch_early`) with its blocks spread evenly over
    /// the SMs.
    #[allow(clippy::too_many_arguments)]
    fn launch_gemv(
        &self,
        gpu: &Gpu,
        kernel: &str,
        x: DevPtr,
        y: DevPtr,
        n: usize,
        accumulate: bool,
        order: SumOrder,
        early: bool,
        extra: &[&dyn KernelArg],
    ) -> Result<(), GpuError> {
        self.in_hopper_order()?;
        let tokens = gemv_tokens_per_block(n);
        let token_blocks = n.div_ceil(tokens) as u32;
        let tiles = gemv_tiles(tokens, self.rows.div_ceil(16), gpu.sm_count);
        let format = match self.format {
            Fp4Format::Mxfp4 => "mx",
            Fp4Format::Nvfp4 => "nv",
        };
        let groups_of = match tiles {
            3 => "_t3",
            _ if gemv_rotates(order, tokens, tiles, self.cols) => "_rot",
            _ => "",
        };
        let name = format!("fp4_gemv_{format}_{kernel}{groups_of}");
        // The kernel addresses a matrix's codes with 32-bit offsets.
        if self.codes.len() > u32::MAX as usize {
            return Err(GpuError::Other(format!(
                "an FP4 matrix of {} x {} (the GEMV takes at most 4 GiB of codes)",
                self.rows, self.cols
            )));
        }
        let mut smem = gemv_smem(tiles);
        let resident = gpu.sm_count * gpu.blocks_per_sm(&name, FP4_WARPS * 32, smem)?;
        let groups = self.rows.div_ceil(16).div_ceil(tiles as usize) as u32;
        let row_blocks = groups.clamp(1, resident.max(1));
        if early && gpu.launches_early() {
            let share = (row_blocks * token_blocks).div_ceil(gpu.sm_count);
            smem = gpu.shared_for_at_most(&name, FP4_WARPS * 32, smem, share)?;
        }
        let (codes, scales, row_scale) = (
            gpu.ptr(&self.codes, 0),
            gpu.ptr(&self.scales, 0),
            gpu.ptr(&self.row_scale, 0),
        );
        let (n32, rows, cols) = (n as i32, self.rows as i32, self.cols as i32);
        let (out_pow2, accumulate) = (self.out_pow2(), i32::from(accumulate));
        let mut args: Vec<&dyn KernelArg> = vec![
            &codes,
            &scales,
            &row_scale,
            &x,
            &y,
            &n32,
            &rows,
            &cols,
            &out_pow2,
            &self.shift,
            &accumulate,
        ];
        args.extend_from_slice(extra);
        // SAFETY: the kernel reads the tiled codes and scales of every
        // (padded) tile and chunk, which `stack` and `synthetic` allocate, a
        // scale per row, x's columns < cols of rows j < n, and writes y's
        // rows j < n, columns < rows; `extra` is what the
        // fused kernels' callers vouch for (layers.rs).
        let config = grid((token_blocks, row_blocks, 1), FP4_WARPS * 32, smem);
        if early {
            gpu.launch_early(&name, config, &args)
        } else {
            gpu.launch(&name, config, &args)
        }
    }

    /// f32s of partial sums [`Fp4Weights::gemm`] needs for `n` tokens.
    pub fn gemm_scratch(&self, n: usize, sm_count: u32, order: SumOrder) -> usize {
        // The GEMV's order runs GEMM_TOKENS tokens a launch (`gemm`).
        let n = match order {
            SumOrder::AsGemv => n.min(GEMM_TOKENS),
            SumOrder::Fastest => n,
        };
        match gemm_splits(self.rows, self.cols, n, sm_count, order) {
            (1, ..) => 0,
            (splits, ..) => splits * n * self.rows,
        }
    }

    /// As [`Fp4Weights::gemv`], through the tiled GEMM (for more than 16
    /// tokens: x staged in shared memory once per 128 rows); `part` holds
    /// `gemm_scratch(n, order)` f32s. In `SumOrder::AsGemv` each token's
    /// results equal the GEMV's to the bit (a partial last chunk included:
    /// both read zeros past `cols`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        y: DevPtr,
        part: DevPtr,
        n: usize,
        accumulate: bool,
        order: SumOrder,
    ) -> Result<(), GpuError> {
        self.in_hopper_order()?;
        if n == 0 {
            return Ok(());
        }
        if order == SumOrder::AsGemv && n > GEMM_TOKENS {
            // GEMM_TOKENS tokens a launch, so that the partial sums (8 splits
            // of every token) stay within gemm_scratch's bound.
            for from in (0..n).step_by(GEMM_TOKENS) {
                let (xs, ys) = (
                    x + (from * self.cols * 2) as u64,
                    y + (from * self.rows * 4) as u64,
                );
                let m = GEMM_TOKENS.min(n - from);
                self.gemm(gpu, xs, ys, part, m, accumulate, order)?;
            }
            return Ok(());
        }
        let (splits, per_split, step) = gemm_splits(self.rows, self.cols, n, gpu.sm_count, order);
        let warpgroups = gemm_on_warpgroups(gpu, order);
        let name = match (self.format, warpgroups) {
            (Fp4Format::Mxfp4, false) => "fp4_gemm_mx",
            (Fp4Format::Nvfp4, false) => "fp4_gemm_nv",
            (Fp4Format::Mxfp4, true) => "fp4_gemm_wg_mx",
            (Fp4Format::Nvfp4, true) => "fp4_gemm_wg_nv",
        };
        let smem = if warpgroups { GEMM_WG_SMEM } else { GEMM_SMEM };
        let blocks = (
            n.div_ceil(GEMM_TOKENS) as u32,
            self.rows.div_ceil(GEMM_ROWS) as u32,
            splits as u32,
        );
        // SAFETY: as gemv; with splits > 1 the kernel writes splits * n *
        // rows f32s at `part` (the caller's gemm_scratch) and the sum reads
        // them back.
        gpu.launch(
            name,
            grid(blocks, FP4_WARPS * 32, smem),
            &[
                &gpu.ptr(&self.codes, 0),
                &gpu.ptr(&self.scales, 0),
                &gpu.ptr(&self.row_scale, 0),
                &x,
                &y,
                &part,
                &(n as i32),
                &(self.rows as i32),
                &(self.cols as i32),
                &self.out_pow2(),
                &self.shift,
                &i32::from(accumulate),
                &(per_split as i32),
                &(step as i32),
            ],
        )?;
        if splits > 1 {
            gpu.launch(
                "fp4_splitk_sum",
                elementwise(n * self.rows),
                &[
                    &part,
                    &(splits as i32),
                    &gpu.ptr(&self.row_scale, 0),
                    &self.out_pow2(),
                    &y,
                    &(n as i32),
                    &(self.rows as i32),
                    &i32::from(accumulate),
                ],
            )?;
        }
        Ok(())
    }

    /// Writes the weights as BF16 (rows x cols) at `out`.
    pub fn dequantize_into(&self, gpu: &Gpu, out: DevPtr) -> Result<(), GpuError> {
        self.in_hopper_order()?;
        // SAFETY: `out` has room for rows * cols BF16 values (the caller's).
        gpu.launch(
            "fp4_to_bf16",
            elementwise(self.rows * self.cols / 32),
            &[
                &gpu.ptr(&self.codes, 0),
                &gpu.ptr(&self.scales, 0),
                &gpu.ptr(&self.row_scale, 0),
                &out,
                &(self.rows as i32),
                &(self.cols as i32),
                &i32::from(self.format == Fp4Format::Nvfp4),
            ],
        )
    }
}

/// The token counts [`fp4_sweep`] measures (the GEMV up to
/// FP4_GEMV_MAX_TOKENS, the tiled GEMM past it).
pub const FP4_SWEEP_TOKENS: [usize; 4] = [1, 8, 16, 64];

/// Up to this many tokens a step multiplies FP4 weights with the GEMV, past
/// it with the tiled GEMM: in the fast numerics up to
/// [`fp4_fast_gemm_max_tokens`] (past that a BF16 copy and cuBLAS); in the
/// batch-invariant ones in the GEMV's order, FP4_GEMM_MAX_TOKENS tokens a
/// launch.
pub const FP4_GEMV_MAX_TOKENS: usize = 16;
/// Tokens a tiled GEMM block takes, and the fast numerics' limit for the
/// GEMM where it runs on `mma.sync`.
pub const FP4_GEMM_MAX_TOKENS: usize = GEMM_TOKENS;
/// The fast numerics' limit for the GEMM where it runs on warpgroup MMAs
/// (`fp4_gemm_wg_*`, several 64-token blocks a row block): there it beats
/// the BF16 copy and cuBLAS well past 64 tokens (an 8B model on an H100,
/// fast: batch 128 5,216 -> 8,682 tok/s, batch 256 7,973 -> 9,800;
/// BENCHMARKS.md), while a 1,024-token prefill stays with cuBLAS.
pub const FP4_WGMMA_GEMM_MAX_TOKENS: usize = 256;

/// Up to how many tokens the fast numerics take the tiled GEMM on `gpu`.
pub fn fp4_fast_gemm_max_tokens(gpu: &Gpu) -> usize {
    if gemm_on_warpgroups(gpu, SumOrder::Fastest) {
        FP4_WGMMA_GEMM_MAX_TOKENS
    } else {
        FP4_GEMM_MAX_TOKENS
    }
}

/// One line of [`fp4_sweep`].
#[derive(Clone, Debug, Serialize)]
pub struct Fp4Figure {
    pub matrix: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub format: &'static str,
    pub tokens: usize,
    /// "gemv" or "gemm".
    pub kernel: &'static str,
    /// One matrix, median, every copy's launch replayed from one CUDA graph
    /// (as a decode step runs).
    pub us: f64,
    /// FP4 bytes (codes and scales) read per second, so.
    pub gb_s: f64,
    /// The same with a launch from the host per matrix.
    pub direct_gb_s: f64,
    /// The same matrix in BF16 at the card's measured copy bandwidth
    /// (`bench::ceilings`), for scale.
    pub bf16_roofline_us: f64,
}

/// The FP4 GEMV on a Llama shape's four matrices, each quantized from
/// made-up weights and copied until the copies fill `bytes_per_matrix`
/// bytes (several times the 60 MB L2), then every copy in turn: the plain
/// GEMV or GEMM at each of [`FP4_SWEEP_TOKENS`], and at one token the fused
/// kernel a batch-1 decode step runs on that matrix (kernel "fused").
pub fn fp4_sweep(
    gpu: &Gpu,
    config: &LlamaConfig,
    bytes_per_matrix: usize,
) -> Result<Vec<Fp4Figure>, GpuError> {
    gpu.bind()?;
    let hbm = super::bench::ceilings(&gpu.name).hbm_bytes_per_s;
    let shapes = layer_shapes(config);
    let widest = shapes.iter().map(|s| s.2).max().unwrap_or(0);
    let tallest = shapes.iter().map(|s| s.1).max().unwrap_or(0);
    let x = gpu.upload(&vec![0x3f80u16; 64 * widest])?; // 1.0 in BF16
    let y = gpu.alloc::<f32>(64 * tallest)?;
    let fused = FusedEpilogues::new(gpu, config, gpu.ptr(&x, 0), gpu.ptr(&y, 0))?;
    let mut out = Vec::new();
    for format in [Fp4Format::Mxfp4, Fp4Format::Nvfp4] {
        for &(name, rows, cols) in &shapes {
            let data: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    let v = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
                    (v as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                })
                .collect();
            let m = Fp4Matrix::quantize(format, rows, cols, &data).map_err(GpuError::Other)?;
            let first = Fp4Weights::upload(gpu, &m)?;
            let copies = bytes_per_matrix.div_ceil(first.bytes()).max(1);
            let mut all = vec![first];
            for _ in 1..copies {
                all.push(all[0].duplicate(gpu)?);
            }
            let part = gpu.alloc::<f32>(
                all[0]
                    .gemm_scratch(64, gpu.sm_count, SumOrder::Fastest)
                    .max(1),
            )?;
            // Every copy in turn, from one graph and from the host.
            let time_copies =
                |tokens: usize,
                 kernel: &'static str,
                 launch: &dyn Fn(&Fp4Weights) -> Result<(), GpuError>| {
                    let launch_all = || all.iter().try_for_each(launch);
                    let graph = gpu.capture(launch_all)?;
                    let copies = all.len() as f64;
                    let t = median_secs(gpu, &mut || Ok(graph.launch()?))? / copies;
                    let direct = median_secs(gpu, &mut || launch_all())? / copies;
                    Ok::<_, GpuError>(Fp4Figure {
                        matrix: name,
                        rows,
                        cols,
                        format: format.name(),
                        tokens,
                        kernel,
                        us: t * 1e6,
                        gb_s: all[0].bytes() as f64 / t / 1e9,
                        direct_gb_s: all[0].bytes() as f64 / direct / 1e9,
                        bf16_roofline_us: (rows * cols * 2) as f64 / hbm * 1e6,
                    })
                };
            let (xp, yp) = (gpu.ptr(&x, 0), gpu.ptr(&y, 0));
            for tokens in FP4_SWEEP_TOKENS {
                out.push(if tokens <= FP4_GEMV_MAX_TOKENS {
                    time_copies(tokens, "gemv", &|w| {
                        w.gemv(gpu, xp, yp, tokens, false, SumOrder::Fastest)
                    })?
                } else {
                    let part = gpu.ptr(&part, 0);
                    time_copies(tokens, "gemm", &|w| {
                        w.gemm(gpu, xp, yp, part, tokens, false, SumOrder::Fastest)
                    })?
                });
            }
            out.push(time_copies(1, "fused", &|w| {
                fused.launch(gpu, config, name, w)
            })?);
        }
    }
    Ok(out)
}

/// What the fused one-token kernels write besides their sums, for
/// [`fp4_sweep`]'s timing of the kernels a batch-1 decode step runs (QKV
/// with the norm and RoPE, gate/up with the norm and SwiGLU, O and down
/// into the residual; `layers::fp4_gemv_norm_rope` and kin): one token at
/// position 0 in KV slot 0, x all ones, the residual's squares as if it
/// were ones too.
struct FusedEpilogues {
    x: DevPtr,
    y: DevPtr,
    sumsq_tiles: CudaSlice<f32>,
    /// Where O and down write the new residual's squares (apart, so that
    /// the norms keep reading ones).
    sumsq_written: CudaSlice<f32>,
    position_and_slot: CudaSlice<i32>,
    q_out: CudaSlice<u16>,
    k_cache: CudaSlice<u16>,
    v_cache: CudaSlice<u16>,
    act: CudaSlice<u16>,
    y_bf16: CudaSlice<u16>,
    g_next: CudaSlice<u16>,
}

impl FusedEpilogues {
    fn new(gpu: &Gpu, c: &LlamaConfig, x: DevPtr, y: DevPtr) -> Result<FusedEpilogues, GpuError> {
        Ok(FusedEpilogues {
            x,
            y,
            sumsq_tiles: gpu.upload(&vec![16.0f32; c.hidden.div_ceil(16)])?,
            sumsq_written: gpu.alloc::<f32>(c.hidden.div_ceil(16))?,
            position_and_slot: gpu.upload(&[0i32, 0])?,
            q_out: gpu.alloc::<u16>(c.q_dim())?,
            k_cache: gpu.alloc::<u16>(c.kv_dim())?,
            v_cache: gpu.alloc::<u16>(c.kv_dim())?,
            act: gpu.alloc::<u16>(c.ffn)?,
            y_bf16: gpu.alloc::<u16>(c.hidden)?,
            g_next: gpu.upload(&vec![0x3f80u16; c.hidden])?, // 1.0 in BF16
        })
    }

    /// The fused kernel that takes `matrix` (a [`layer_shapes`] name) at
    /// batch 1, on `w`.
    fn launch(
        &self,
        gpu: &Gpu,
        c: &LlamaConfig,
        matrix: &str,
        w: &Fp4Weights,
    ) -> Result<(), GpuError> {
        let sumsq = gpu.ptr(&self.sumsq_tiles, 0);
        match matrix {
            "qkv" => super::layers::fp4_gemv_norm_rope(
                gpu,
                c,
                w,
                self.x,
                sumsq,
                gpu.ptr(&self.position_and_slot, 0),
                gpu.ptr(&self.position_and_slot, 1),
                gpu.ptr(&self.q_out, 0),
                gpu.ptr(&self.k_cache, 0),
                gpu.ptr(&self.v_cache, 0),
            ),
            "gate_up" => {
                super::layers::fp4_gemv_norm_swiglu(gpu, c, w, self.x, sumsq, gpu.ptr(&self.act, 0))
            }
            _ => super::layers::fp4_gemv_residual(
                gpu,
                w,
                self.x,
                self.y,
                gpu.ptr(&self.y_bf16, 0),
                gpu.ptr(&self.g_next, 0),
                gpu.ptr(&self.sumsq_written, 0),
            ),
        }
    }
}

/// A Llama layer's four matrices as (name, rows, cols).
fn layer_shapes(config: &LlamaConfig) -> [(&'static str, usize, usize); 4] {
    let (h, q, kv, ffn) = (config.hidden, config.q_dim(), config.kv_dim(), config.ffn);
    [
        ("qkv", q + 2 * kv, h),
        ("o", h, q),
        ("gate_up", 2 * ffn, h),
        ("down", h, ffn),
    ]
}

/// One line of [`fp4_prefill_sweep`]: TFLOP/s (2 rows cols tokens / time).
#[derive(Clone, Debug, Serialize)]
pub struct Fp4PrefillFigure {
    pub matrix: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub format: &'static str,
    pub tokens: usize,
    /// Dequantized to a BF16 copy, then cuBLAS (the fast numerics' prefill).
    pub dequant_cublas_tflops: f64,
    /// The tiled FP4 GEMM in the GEMV's order (the batch-invariant
    /// numerics' prefill).
    pub gemm_tflops: f64,
    /// cuBLAS on BF16 weights of the same shape, for scale.
    pub cublas_bf16_tflops: f64,
}

/// The prefill regime: a Llama shape's four matrices (generated FP4
/// weights) times `tokens` BF16 rows, each way the model can run it.
pub fn fp4_prefill_sweep(
    gpu: &Gpu,
    config: &LlamaConfig,
    tokens: usize,
) -> Result<Vec<Fp4PrefillFigure>, GpuError> {
    gpu.bind()?;
    let shapes = layer_shapes(config);
    let widest = shapes.iter().map(|s| s.2).max().unwrap_or(0);
    let tallest = shapes.iter().map(|s| s.1).max().unwrap_or(0);
    let largest = shapes.iter().map(|s| s.1 * s.2).max().unwrap_or(0);
    let x = gpu.upload(&vec![0x3f80u16; tokens * widest])?; // 1.0 in BF16
    let y = gpu.alloc::<f32>(tokens * tallest)?;
    let bf16 = gpu.alloc::<u16>(largest)?;
    let (xp, yp, wp) = (gpu.ptr(&x, 0), gpu.ptr(&y, 0), gpu.ptr(&bf16, 0));
    let mut out = Vec::new();
    for format in [Fp4Format::Mxfp4, Fp4Format::Nvfp4] {
        for (i, &(name, rows, cols)) in shapes.iter().enumerate() {
            let w = Fp4Weights::synthetic(gpu, format, rows, cols, 77 + i as u64)?;
            let part = gpu.alloc::<f32>(
                w.gemm_scratch(tokens, gpu.sm_count, SumOrder::AsGemv)
                    .max(1),
            )?;
            let pp = gpu.ptr(&part, 0);
            let dequant_cublas = median_secs(gpu, &mut || {
                w.dequantize_into(gpu, wp)?;
                gpu.gemm_bf16_fast(wp, xp, yp, tokens, rows, cols, false)
            })?;
            let cublas = median_secs(gpu, &mut || {
                gpu.gemm_bf16_fast(wp, xp, yp, tokens, rows, cols, false)
            })?;
            let gemm = median_secs(gpu, &mut || {
                w.gemm(gpu, xp, yp, pp, tokens, false, SumOrder::AsGemv)
            })?;
            let flop = 2.0 * (rows * cols * tokens) as f64;
            out.push(Fp4PrefillFigure {
                matrix: name,
                rows,
                cols,
                format: format.name(),
                tokens,
                dequant_cublas_tflops: flop / dequant_cublas / 1e12,
                gemm_tflops: flop / gemm / 1e12,
                cublas_bf16_tflops: flop / cublas / 1e12,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the fastest order rotates, only the 16-token pairs, only on rows
    /// of 8,192 columns or more: the batch-invariant GEMV keeps its bits.
    #[test]
    fn only_the_fastest_16_token_pairs_over_long_rows_rotate() {
        use SumOrder::{AsGemv, Fastest};
        assert!(gemv_rotates(Fastest, 16, 2, 14_336));
        assert!(gemv_rotates(Fastest, 16, 2, 8_192));
        assert!(!gemv_rotates(Fastest, 16, 2, 8_160));
        assert!(!gemv_rotates(Fastest, 16, 3, 14_336));
        assert!(!gemv_rotates(Fastest, 8, 1, 14_336));
        for (tokens, tiles) in [(8, 1), (16, 2), (16, 3)] {
            assert!(!gemv_rotates(AsGemv, tokens, tiles, 14_336));
        }
    }

    /// Split z's chunks, as fp4_gemm computes them from (per_split, step).
    fn split_chunks(z: usize, chunks: usize, per_split: usize, step: usize) -> Vec<usize> {
        let first = if step == 1 { z * per_split } else { z };
        let count = if step == 1 {
            (first + per_split).min(chunks).saturating_sub(first)
        } else {
            (chunks + step - 1).saturating_sub(z) / step
        };
        (0..count).map(|i| first + step * i).collect()
    }

    #[test]
    fn codes_are_reordered_so_each_pair_decodes_in_place() {
        // Each pair decodes to its two columns' bf16 bits (magnitude at 8..6,
        // sign at 15), whatever the codes: every code alone in every column,
        // then random words.
        let check = |file: u32| {
            let w = kernel_code_order(file);
            for p in 0..4 {
                let bf16 = |c: u32| {
                    let code = (file >> (4 * c)) & 0xf;
                    (code & 7) << 6 | (code >> 3) << 15
                };
                let want = bf16(2 * p as u32) | bf16(2 * p as u32 + 1) << 16;
                assert_eq!(pair_bits(w, p), want, "{file:#010x} pair {p}");
            }
        };
        for column in 0..8 {
            (0..16).for_each(|code| check(code << (4 * column)));
        }
        let mut file = 0x9e37_79b9u32;
        for _ in 0..1000 {
            file = file.wrapping_mul(0x2c1b_3c6d).wrapping_add(0x297a_2d39);
            check(file);
        }
    }

    /// Every code and scale byte lands where `fp4.cu` reads it (tile i's
    /// chunk c at (i x chunks + c) KB, row r in slot r ^ (r >> 1 & 1), the
    /// scales 16 rows together), and the padding is zero, on shapes with a
    /// partial tile and a partial chunk.
    #[test]
    fn the_tiled_layout_puts_each_byte_where_the_kernels_read_it() {
        assert_eq!(
            (0..16).map(tile_slot).collect::<Vec<_>>(),
            [0, 1, 3, 2, 4, 5, 7, 6, 8, 9, 11, 10, 12, 13, 15, 14]
        );
        for (rows, cols, block) in [(20, 160, 32), (20, 160, 16), (32, 256, 32), (16, 96, 16)] {
            let (code_row, scale_row) = (cols / 2, cols / block);
            // Each byte its own tag: row and column (of byte or scale).
            let codes: Vec<u8> = (0..rows * code_row).map(|i| (i % 251 + 1) as u8).collect();
            let scales: Vec<u8> = (0..rows * scale_row).map(|i| (i % 241 + 1) as u8).collect();
            let (tiled_codes, tiled_scales) = tiled_layout(rows, cols, block, &codes, &scales);
            assert_eq!(
                (tiled_codes.len(), tiled_scales.len()),
                tiled_bytes(rows, cols, block)
            );
            let chunks = cols.div_ceil(128);
            let (mut seen_codes, mut seen_scales) = (0, 0);
            for r in 0..rows {
                let item = |b: usize| (r / 16) * chunks + b;
                for byte in 0..code_row {
                    let at = item(byte / 64) * 1024 + 64 * tile_slot(r % 16) + byte % 64;
                    assert_eq!(
                        tiled_codes[at],
                        codes[r * code_row + byte],
                        "{rows}x{cols}: code byte {r},{byte}"
                    );
                    seen_codes += 1;
                }
                let per_chunk = 128 / block;
                for sc in 0..scale_row {
                    let at = item(sc / per_chunk) * 16 * per_chunk
                        + (r % 16) * per_chunk
                        + sc % per_chunk;
                    assert_eq!(
                        tiled_scales[at],
                        scales[r * scale_row + sc],
                        "{rows}x{cols}: scale {r},{sc}"
                    );
                    seen_scales += 1;
                }
            }
            // Everything else is padding, and zero.
            assert_eq!(tiled_codes.iter().filter(|&&b| b != 0).count(), seen_codes);
            assert_eq!(
                tiled_scales.iter().filter(|&&b| b != 0).count(),
                seen_scales
            );
        }
    }

    /// Every chunk in exactly one split, whatever the shape; the fastest
    /// order fills the 132 SMs (1.5 blocks a SM or more) where the columns
    /// allow; the GEMV's order
    /// gives split w exactly GEMV warp w's chunks, ascending.
    #[test]
    fn gemm_splits_cover_every_chunk_once() {
        let shapes: [(usize, usize); 8] = [
            (6144, 4096),
            (4096, 4096),
            (28672, 4096),
            (4096, 14336),
            (40, 640),
            (16, 128),
            (576, 576),
            (24, 96),
        ];
        for (rows, cols) in shapes {
            let chunks = cols.div_ceil(128);
            for n in [1, 17, 40, 64, 100] {
                for order in [SumOrder::Fastest, SumOrder::AsGemv] {
                    let (splits, per_split, step) = gemm_splits(rows, cols, n, 132, order);
                    let mut seen: Vec<usize> = (0..splits)
                        .flat_map(|z| split_chunks(z, chunks, per_split, step))
                        .collect();
                    seen.sort_unstable();
                    assert_eq!(
                        seen,
                        (0..chunks).collect::<Vec<_>>(),
                        "{rows}x{cols} n={n} {order:?}"
                    );
                    if order == SumOrder::AsGemv {
                        for w in 0..splits {
                            let warp: Vec<usize> =
                                (w..chunks).step_by(FP4_WARPS as usize).collect();
                            assert_eq!(split_chunks(w, chunks, per_split, step), warp);
                        }
                    } else {
                        let blocks = rows.div_ceil(GEMM_ROWS) * n.div_ceil(GEMM_TOKENS) * splits;
                        // Two a SM asked; whole chunks a split may round it
                        // down, not below 1.5.
                        assert!(
                            blocks >= 198 || splits == chunks,
                            "{rows}x{cols} n={n}: {blocks} blocks in {splits} splits"
                        );
                    }
                }
            }
        }
    }
}
