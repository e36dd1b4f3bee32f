//! FP4 weights on the GPU, the Hopper path: an [`Fp4Matrix`] uploaded as it
//! is (codes and scale bytes; NVFP4's tensor scale is a kernel argument), and
//! the weight-only GEMV of `kernels/fp4.cu` for up to 16 tokens, which
//! dequantizes in registers and multiplies on the BF16 tensor cores.

use std::time::Instant;

use cudarc::driver::CudaSlice;
use serde::Serialize;

use super::device::{DevPtr, Gpu, GpuError, grid};
use crate::compute::fp4::{Fp4Format, Fp4Matrix};
use crate::model::LlamaConfig;

/// Columns per kernel chunk: a row must be whole chunks.
pub const FP4_COLS_MULTIPLE: usize = 128;

/// Warps per block of the kernels (`fp4.cu`'s WARPS).
const FP4_WARPS: u32 = 8;

/// One FP4 matrix on the device.
#[derive(Debug)]
pub struct Fp4Weights {
    pub rows: usize,
    pub cols: usize,
    pub format: Fp4Format,
    pub tensor_scale: f32,
    codes: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    /// MXFP4: the power of two taken out of every scale so that the largest
    /// times 2^126 stays within bf16 (`fp4.cu`); 0 for NVFP4.
    shift: i32,
}

impl Fp4Weights {
    pub fn upload(gpu: &Gpu, m: &Fp4Matrix) -> Result<Fp4Weights, GpuError> {
        if !m.cols.is_multiple_of(FP4_COLS_MULTIPLE) {
            return Err(GpuError::Other(format!(
                "the FP4 GEMV takes rows of whole {FP4_COLS_MULTIPLE}-column chunks; this matrix has {} columns",
                m.cols
            )));
        }
        // E8M0 code e is 2^(e - 127); the kernel multiplies by 2^(e - 1 -
        // shift), which must stay below 2^128 (NaN codes, 255, aside).
        let largest = m.scales.iter().filter(|&&e| e != 255).max().copied();
        let shift = match m.format {
            Fp4Format::Mxfp4 => largest.map_or(0, |e| (i32::from(e) - 128).max(0)),
            Fp4Format::Nvfp4 => 0,
        };
        Ok(Fp4Weights {
            rows: m.rows,
            cols: m.cols,
            format: m.format,
            tensor_scale: m.tensor_scale,
            codes: gpu.upload(&m.codes)?,
            scales: gpu.upload(&m.scales)?,
            shift,
        })
    }

    /// A second copy on the same device (for bandwidth sweeps larger than L2).
    pub fn duplicate(&self, gpu: &Gpu) -> Result<Fp4Weights, GpuError> {
        Ok(Fp4Weights {
            codes: gpu.stream.clone_dtod(&self.codes)?,
            scales: gpu.stream.clone_dtod(&self.scales)?,
            ..*self
        })
    }

    /// What the kernel multiplies its sums by: the tensor scale, and the
    /// power of two its scales left out (MX: 2^shift; NV: 2^8, see fp4.cu).
    fn out_scale(&self) -> f32 {
        let taken = match self.format {
            Fp4Format::Mxfp4 => self.shift,
            Fp4Format::Nvfp4 => 8,
        };
        self.tensor_scale * 2f32.powi(taken)
    }

    /// Bytes one call reads from the weights (codes and scales).
    pub fn bytes(&self) -> usize {
        self.rows * self.cols / 2 + self.rows * self.cols / self.format.block()
    }

    /// `y[j, r] = sum_c w[r, c] x[j, c]` for `j < n <= 16`: `x` is `n` rows
    /// of `cols` BF16 values, `y` `n` rows of `rows` f32.
    pub fn gemv(&self, gpu: &Gpu, x: DevPtr, y: DevPtr, n: usize) -> Result<(), GpuError> {
        let name = match (self.format, n) {
            (Fp4Format::Mxfp4, 1..=8) => "fp4_gemv_mx_n8",
            (Fp4Format::Mxfp4, 9..=16) => "fp4_gemv_mx_n16",
            (Fp4Format::Nvfp4, 1..=8) => "fp4_gemv_nv_n8",
            (Fp4Format::Nvfp4, 9..=16) => "fp4_gemv_nv_n16",
            _ => return Err(GpuError::Other(format!("FP4 GEMV of {n} tokens (1 to 16)"))),
        };
        // The kernel reads 16-byte groups of codes within each row (cols is a
        // multiple of 128), the scales of those columns, and x's rows j < n.
        gpu.launch(
            name,
            grid((self.rows.div_ceil(16) as u32, 1, 1), FP4_WARPS * 32, 0),
            &[
                &gpu.ptr(&self.codes, 0),
                &gpu.ptr(&self.scales, 0),
                &x,
                &y,
                &(n as i32),
                &(self.rows as i32),
                &(self.cols as i32),
                &self.out_scale(),
                &self.shift,
            ],
        )
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
    /// One matrix, median, every copy's launch replayed from one CUDA graph
    /// (as a decode step runs).
    pub us: f64,
    /// FP4 bytes (codes and scales) read per second, so.
    pub gb_s: f64,
    /// The same with a launch from the host per matrix.
    pub direct_gb_s: f64,
    /// The same matrix in BF16 at the measured 4.25 TB/s, for scale.
    pub bf16_roofline_us: f64,
}

/// The FP4 GEMV on a Llama shape's four matrices, each quantized from
/// made-up weights and copied until the copies fill `bytes_per_matrix`
/// bytes (several times the 60 MB L2), then every copy in turn.
pub fn fp4_sweep(
    gpu: &Gpu,
    config: &LlamaConfig,
    bytes_per_matrix: usize,
) -> Result<Vec<Fp4Figure>, GpuError> {
    gpu.bind()?;
    let (h, q, kv, ffn) = (config.hidden, config.q_dim(), config.kv_dim(), config.ffn);
    let shapes = [
        ("qkv", q + 2 * kv, h),
        ("o", h, q),
        ("gate_up", 2 * ffn, h),
        ("down", h, ffn),
    ];
    let widest = shapes.iter().map(|s| s.2).max().unwrap_or(0);
    let tallest = shapes.iter().map(|s| s.1).max().unwrap_or(0);
    let x = gpu.upload(&vec![0x3f80u16; 16 * widest])?; // 1.0 in BF16
    let y = gpu.alloc::<f32>(16 * tallest)?;
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
            for tokens in [1usize, 8, 16] {
                let launch_all = || -> Result<(), GpuError> {
                    for w in &all {
                        w.gemv(gpu, gpu.ptr(&x, 0), gpu.ptr(&y, 0), tokens)?;
                    }
                    Ok(())
                };
                gpu.stream.begin_capture(
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )?;
                let recorded = launch_all();
                let graph = gpu
                    .stream
                    .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))?;
                recorded?;
                let graph = graph.ok_or_else(|| GpuError::Other("empty CUDA graph".into()))?;
                let time = |graphed: bool| -> Result<f64, GpuError> {
                    let mut times = Vec::new();
                    for rep in 0..6 {
                        gpu.synchronize()?;
                        let started = Instant::now();
                        if graphed {
                            graph.launch()?;
                        } else {
                            launch_all()?;
                        }
                        gpu.synchronize()?;
                        if rep > 0 {
                            times.push(started.elapsed().as_secs_f64() / all.len() as f64);
                        }
                    }
                    times.sort_by(f64::total_cmp);
                    Ok(times[times.len() / 2])
                };
                let (t, direct) = (time(true)?, time(false)?);
                out.push(Fp4Figure {
                    matrix: name,
                    rows,
                    cols,
                    format: match format {
                        Fp4Format::Mxfp4 => "mxfp4",
                        Fp4Format::Nvfp4 => "nvfp4",
                    },
                    tokens,
                    us: t * 1e6,
                    gb_s: all[0].bytes() as f64 / t / 1e9,
                    direct_gb_s: all[0].bytes() as f64 / direct / 1e9,
                    bf16_roofline_us: (rows * cols * 2) as f64 / 4.25e12 * 1e6,
                });
            }
        }
    }
    Ok(out)
}
