//! FP4 weights on Blackwell (B200, B300): the block-scaled tcgen05 MMA of
//! `kernels/fp4_blackwell.cu`, both operands E2M1, after the activations are
//! quantized per token into the weights' format (`fp4_quantize_act_*` in
//! `kernels/fp4.cu`). Opt-in (`SLUICE_FP4_TCGEN05=1` on an sm_100a/sm_103a
//! GPU): the MMA kernels are compile-checked by CI for both targets but have
//! not run on a Blackwell GPU; the activation quantizer is tested against the
//! CPU quantizer on the H200. Without the switch, Blackwell runs the Hopper
//! kernels (`fp4`), which CI compiles for it too.

use super::device::{DevPtr, Gpu, GpuError, grid};
use super::fp4::Fp4Weights;
use super::nvrtc::TCGEN05_ARCHS;
use crate::compute::fp4::Fp4Format;

/// Columns a row must be a multiple of: the MMA kernel's K step.
pub const BLOCKSCALED_COLS_MULTIPLE: usize = 256;

/// The kernel's tile: weight rows (the MMA's M) and tokens (its N) a block.
const TILE_ROWS: usize = 128;
const TILE_TOKENS: usize = 64;
/// Its dynamic shared memory: two stages of codes (128 + 64 rows x 128
/// bytes) and scale atoms (8 x 512 bytes).
const SMEM: u32 = 2 * (128 * 128 + 64 * 128 + 8 * 512);

/// Whether FP4 layers take this path: a GPU with tcgen05 and
/// `SLUICE_FP4_TCGEN05=1`.
pub fn blockscaled_path(gpu: &Gpu) -> bool {
    TCGEN05_ARCHS.contains(&gpu.arch.as_str())
        && std::env::var("SLUICE_FP4_TCGEN05").as_deref() == Ok("1")
}

/// Where `quantize_activations` puts `n` tokens of `cols` values, as byte
/// offsets into a scratch buffer: each token's tensor scale (f32), its codes
/// (cols / 2 bytes) and its scale bytes (cols / block), each part 256-byte
/// aligned; `floats` is the scratch's size in f32s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationLayout {
    pub codes: usize,
    pub scales: usize,
    pub floats: usize,
}

impl ActivationLayout {
    pub fn new(format: Fp4Format, n: usize, cols: usize) -> ActivationLayout {
        let codes = (4 * n).next_multiple_of(256);
        let scales = (codes + n * cols / 2).next_multiple_of(256);
        let end = scales + n * cols / format.block();
        ActivationLayout {
            codes,
            scales,
            floats: end.div_ceil(4),
        }
    }
}

/// Quantizes `n` tokens of `x` (BF16 rows of `cols`) into `scratch`, laid out
/// as `ActivationLayout::new(format, n, cols)` says: MXFP4 with E8M0 scales a
/// block of 32 (tensor scale 1), or NVFP4 with E4M3 scales a block of 16 under
/// a tensor scale per token (amax / (6 x 448)); the CPU quantizer's rules
/// (`compute::fp4::Fp4Matrix::quantize` of the token's row alone). Returns
/// the layout.
pub fn quantize_activations(
    gpu: &Gpu,
    format: Fp4Format,
    x: DevPtr,
    n: usize,
    cols: usize,
    scratch: DevPtr,
) -> Result<ActivationLayout, GpuError> {
    let at = ActivationLayout::new(format, n, cols);
    if n == 0 {
        return Ok(at);
    }
    if !cols.is_multiple_of(32) {
        return Err(GpuError::Other(format!(
            "activations of {cols} columns are not whole blocks of 32"
        )));
    }
    let name = match format {
        Fp4Format::Mxfp4 => "fp4_quantize_act_mx",
        Fp4Format::Nvfp4 => "fp4_quantize_act_nv",
    };
    // SAFETY: the kernel reads n rows of cols BF16 at x and writes, per
    // token, one f32, cols / 2 code bytes and cols / block scale bytes, at
    // the layout's offsets within the caller's scratch of `at.floats` f32s.
    gpu.launch(
        name,
        grid((n as u32, 1, 1), 256, 0),
        &[
            &x,
            &(cols as i32),
            &(scratch + at.codes as u64),
            &(scratch + at.scales as u64),
            &scratch,
        ],
    )?;
    Ok(at)
}

impl Fp4Weights {
    /// f32s of scratch [`Fp4Weights::gemm_blockscaled`] needs for `n` tokens.
    pub fn blockscaled_scratch(&self, n: usize) -> usize {
        ActivationLayout::new(self.format, n, self.cols).floats
    }

    /// `y[j, r] (+)= sum_c w[r, c] x[j, c]` for `j < n`, as `gemv` and `gemm`,
    /// on Blackwell's tensor cores: x quantized into `scratch`
    /// (`blockscaled_scratch(n)` f32s), then the block-scaled MMA, 128 rows x
    /// 64 tokens a block. Weights uploaded for this path only.
    pub fn gemm_blockscaled(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        y: DevPtr,
        scratch: DevPtr,
        n: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        if !self.file_order {
            return Err(GpuError::Other(
                "FP4 weights in the Hopper kernels' order cannot take the Blackwell path".into(),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let at = quantize_activations(gpu, self.format, x, n, self.cols, scratch)?;
        let name = match self.format {
            Fp4Format::Mxfp4 => "fp4_tc05_gemm_mx",
            Fp4Format::Nvfp4 => "fp4_tc05_gemm_nv",
        };
        let blocks = (
            n.div_ceil(TILE_TOKENS) as u32,
            self.rows.div_ceil(TILE_ROWS) as u32,
            1,
        );
        // SAFETY: the kernel reads the weights' rows < rows and the tokens'
        // rows < n (cols a multiple of 256, checked at upload), zero-filling
        // past them, and writes y's rows j < n.
        gpu.launch(
            name,
            grid(blocks, 128, SMEM),
            &[
                &gpu.ptr(&self.codes, 0),
                &gpu.ptr(&self.scales, 0),
                &gpu.ptr(&self.row_scale, 0),
                &(scratch + at.codes as u64),
                &(scratch + at.scales as u64),
                &scratch,
                &y,
                &(n as i32),
                &(self.rows as i32),
                &(self.cols as i32),
                &i32::from(accumulate),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_parts_do_not_overlap_and_fit_the_scratch() {
        for format in [Fp4Format::Mxfp4, Fp4Format::Nvfp4] {
            for (n, cols) in [(1, 256), (3, 4096), (64, 14336)] {
                let at = ActivationLayout::new(format, n, cols);
                assert!(at.codes >= 4 * n, "{at:?}");
                assert!(at.scales >= at.codes + n * cols / 2, "{at:?}");
                assert!(4 * at.floats >= at.scales + n * cols / format.block());
                assert_eq!(at.codes % 256, 0);
                assert_eq!(at.scales % 256, 0);
            }
        }
    }
}
