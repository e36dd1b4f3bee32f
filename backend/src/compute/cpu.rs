//! CPU kernels for the Llama forward pass: matrix products, RMSNorm, RoPE, SiLU.

use rayon::prelude::*;

/// A row-major f32 matrix of `rows` outputs by `cols` inputs (a linear layer's
/// weight, `y = W x`).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// True when the CPU has AVX2 and FMA: the kernels below are then compiled for
/// them (checked once, at run time; the binary itself targets baseline x86-64).
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `$name(args) -> f32`, running `$body` compiled for AVX2+FMA when the
/// CPU has them and for the baseline otherwise.
macro_rules! dispatch {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        dispatch!($(#[$doc])* fn $name($($arg: $ty),*) -> f32 $body);
    };
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: the CPU has AVX2 and FMA (checked at run time).
                return unsafe { avx2($($arg),*) };
            }
            body($($arg),*)
        }
    };
}

dispatch! {
    /// Dot product with eight accumulators, so the compiler vectorizes it.
    fn dot(a: &[f32], b: &[f32]) {
        dot_body(a, b)
    }
}

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

dispatch! {
    /// One row of Q4_1 blocks times `x`: `scales`, `mins` and `qs` (16 bytes of
    /// nibbles per block: low nibbles are weights 0-15, high 16-31) of the row,
    /// `x_sums` the sum of each 32-block of `x`. w = q * scale + min.
    fn dot_q4_1(scales: &[f32], mins: &[f32], qs: &[u8], x: &[f32], x_sums: &[f32]) {
        let mut acc = [0.0f32; 16];
        let mut from_mins = 0.0f32;
        for (b, (&d, &m)) in scales.iter().zip(mins).enumerate() {
            let q = &qs[b * 16..b * 16 + 16];
            let xb = &x[b * 32..b * 32 + 32];
            for j in 0..16 {
                let lo = f32::from(q[j] & 0x0f);
                let hi = f32::from(q[j] >> 4);
                acc[j] += (lo * xb[j] + hi * xb[j + 16]) * d;
            }
            from_mins += m * x_sums[b];
        }
        acc.iter().sum::<f32>() + from_mins
    }
}

dispatch! {
    /// One row of Q8_0 blocks times `x`: w = q * scale, 32 signed bytes per block.
    fn dot_q8_0(scales: &[f32], qs: &[i8], x: &[f32]) {
        let mut acc = [0.0f32; 32];
        for (b, &d) in scales.iter().enumerate() {
            let q = &qs[b * 32..b * 32 + 32];
            let xb = &x[b * 32..b * 32 + 32];
            for j in 0..32 {
                acc[j] += f32::from(q[j]) * xb[j] * d;
            }
        }
        acc.iter().sum::<f32>()
    }
}

dispatch! {
    /// Dequantizes Q4_1 blocks into `out` (32 weights per block).
    fn dequant_q4_1(scales: &[f32], mins: &[f32], qs: &[u8], out: &mut [f32]) -> () {
        for (b, (&d, &m)) in scales.iter().zip(mins).enumerate() {
            let q = &qs[b * 16..b * 16 + 16];
            let o = &mut out[b * 32..b * 32 + 32];
            for j in 0..16 {
                o[j] = f32::from(q[j] & 0x0f) * d + m;
                o[j + 16] = f32::from(q[j] >> 4) * d + m;
            }
        }
    }
}

dispatch! {
    /// Dequantizes Q8_0 blocks into `out` (32 weights per block).
    fn dequant_q8_0(scales: &[f32], qs: &[i8], out: &mut [f32]) -> () {
        for (b, &d) in scales.iter().enumerate() {
            let q = &qs[b * 32..b * 32 + 32];
            let o = &mut out[b * 32..b * 32 + 32];
            for j in 0..32 {
                o[j] = f32::from(q[j]) * d;
            }
        }
    }
}

/// A quantized weight kept in blocks of 32 (scales converted to f32 at load).
#[derive(Clone, Debug, PartialEq)]
pub enum Quant {
    /// 16 bytes of nibbles per block, a scale and a min.
    Q4_1 {
        scales: Vec<f32>,
        mins: Vec<f32>,
        qs: Vec<u8>,
    },
    /// 32 signed bytes per block and a scale.
    Q8_0 { scales: Vec<f32>, qs: Vec<i8> },
}

/// A linear layer's weight, `rows` outputs by `cols` inputs: f32, or quantized
/// blocks dequantized block by block inside the dot product.
#[derive(Clone, Debug, PartialEq)]
pub enum Weight {
    F32(Matrix),
    Quant {
        rows: usize,
        cols: usize,
        quant: Quant,
    },
    /// MXFP4 or NVFP4, dequantized row by row (the reference, not fast).
    Fp4(super::fp4::Fp4Matrix),
}

impl Weight {
    /// From GGUF block bytes (Q4_1: f16 d, f16 m, 16 bytes; Q8_0: f16 d, 32 i8).
    pub fn from_blocks(
        rows: usize,
        cols: usize,
        q4_1: bool,
        bytes: &[u8],
    ) -> Result<Weight, String> {
        if !cols.is_multiple_of(32) {
            return Err(format!("{cols} columns are not whole blocks of 32"));
        }
        let blocks = rows * cols / 32;
        let half = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let (block_bytes, quant) = if q4_1 {
            let mut scales = Vec::with_capacity(blocks);
            let mut mins = Vec::with_capacity(blocks);
            let mut qs = Vec::with_capacity(blocks * 16);
            for b in bytes.chunks_exact(20) {
                scales.push(half(&b[0..2]));
                mins.push(half(&b[2..4]));
                qs.extend_from_slice(&b[4..20]);
            }
            (20, Quant::Q4_1 { scales, mins, qs })
        } else {
            let mut scales = Vec::with_capacity(blocks);
            let mut qs = Vec::with_capacity(blocks * 32);
            for b in bytes.chunks_exact(34) {
                scales.push(half(&b[0..2]));
                qs.extend(b[2..34].iter().map(|&q| q as i8));
            }
            (34, Quant::Q8_0 { scales, qs })
        };
        if bytes.len() != blocks * block_bytes {
            return Err(format!("{} bytes for {blocks} blocks", bytes.len()));
        }
        Ok(Weight::Quant { rows, cols, quant })
    }

    pub fn rows(&self) -> usize {
        match self {
            Weight::F32(m) => m.rows,
            Weight::Quant { rows, .. } => *rows,
            Weight::Fp4(m) => m.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Weight::F32(m) => m.cols,
            Weight::Quant { cols, .. } => *cols,
            Weight::Fp4(m) => m.cols,
        }
    }

    /// Row `r`, dequantized (an embedding lookup).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.cols());
        self.row_into(r, &mut out);
        out
    }

    /// Row `r`, dequantized into `out` (resized to the row).
    pub fn row_into(&self, r: usize, out: &mut Vec<f32>) {
        match self {
            Weight::F32(m) => {
                out.clear();
                out.extend_from_slice(m.row(r));
            }
            Weight::Fp4(m) => {
                out.resize(m.cols, 0.0);
                m.dequantize_row(r, out);
            }
            Weight::Quant { cols, quant, .. } => {
                out.resize(*cols, 0.0);
                let nb = cols / 32;
                let blocks = r * nb..(r + 1) * nb;
                match quant {
                    Quant::Q4_1 { scales, mins, qs } => dequant_q4_1(
                        &scales[blocks.clone()],
                        &mins[blocks.clone()],
                        &qs[blocks.start * 16..blocks.end * 16],
                        out,
                    ),
                    Quant::Q8_0 { scales, qs } => dequant_q8_0(
                        &scales[blocks.clone()],
                        &qs[blocks.start * 32..blocks.end * 32],
                        out,
                    ),
                }
            }
        }
    }

    /// Row `r` times one input `x` (`x_sums`: per-32-block sums of `x`).
    fn row_dot(&self, r: usize, x: &[f32], x_sums: &[f32]) -> f32 {
        match self {
            Weight::F32(m) => dot(m.row(r), x),
            Weight::Fp4(_) => dot(&self.row_f32(r), x),
            Weight::Quant { cols, quant, .. } => {
                let nb = cols / 32;
                let blocks = r * nb..(r + 1) * nb;
                match quant {
                    Quant::Q4_1 { scales, mins, qs } => dot_q4_1(
                        &scales[blocks.clone()],
                        &mins[blocks.clone()],
                        &qs[blocks.start * 16..blocks.end * 16],
                        x,
                        x_sums,
                    ),
                    Quant::Q8_0 { scales, qs } => dot_q8_0(
                        &scales[blocks.clone()],
                        &qs[blocks.start * 32..blocks.end * 32],
                        x,
                    ),
                }
            }
        }
    }

    /// `x` holds `n` inputs of `cols`; returns `n` outputs of `rows`. Threads
    /// split the weight rows, so each weight is read once for all `n` inputs.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let (rows, cols) = (self.rows(), self.cols());
        assert_eq!(x.len(), n * cols, "matmul input");
        // Per-input sums of each 32-block (Q4_1's mins need them).
        let sums_per_input = cols.div_ceil(32);
        let x_sums: Vec<f32> = x
            .chunks(cols.max(1))
            .flat_map(|input| input.chunks(32).map(|c| c.iter().sum::<f32>()))
            .collect();
        let mut out_t = vec![0.0f32; rows * n];
        const ROWS_PER_TASK: usize = 16;
        out_t
            .par_chunks_mut(ROWS_PER_TASK * n)
            .enumerate()
            .for_each(|(chunk, out)| {
                let first = chunk * ROWS_PER_TASK;
                let mut row = Vec::new();
                for (i, out_row) in out.chunks_mut(n).enumerate() {
                    // Several inputs: dequantize the row once, then plain dots.
                    if n > 2 && !matches!(self, Weight::F32(_)) {
                        self.row_into(first + i, &mut row);
                        for (t, o) in out_row.iter_mut().enumerate() {
                            *o = dot(&row, &x[t * cols..(t + 1) * cols]);
                        }
                        continue;
                    }
                    for (t, o) in out_row.iter_mut().enumerate() {
                        *o = self.row_dot(
                            first + i,
                            &x[t * cols..(t + 1) * cols],
                            &x_sums[t * sums_per_input..(t + 1) * sums_per_input],
                        );
                    }
                }
            });
        if n == 1 {
            return out_t;
        }
        let mut out = vec![0.0f32; n * rows];
        for r in 0..rows {
            for t in 0..n {
                out[t * rows + r] = out_t[r * n + t];
            }
        }
        out
    }
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data");
        Self { rows, cols, data }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// RMSNorm of each `weight.len()`-sized row of `x`, scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let mean_sq = dot(row, row) / d as f32;
        let scale = 1.0 / (mean_sq + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(v, w)| v * scale * w));
    }
    out
}

/// Cosines and sines of RoPE for one position: `head_dim / 2` pairs.
pub fn rope_table(pos: usize, head_dim: usize, theta: f32) -> Vec<(f32, f32)> {
    (0..head_dim / 2)
        .map(|i| {
            let freq = theta.powf(-2.0 * i as f32 / head_dim as f32);
            let angle = pos as f32 * freq;
            (angle.cos(), angle.sin())
        })
        .collect()
}

/// Rotates adjacent pairs `(2i, 2i + 1)` of every head in `x` (GGUF's Llama
/// layout: the converter reorders Q and K rows so that pairs are adjacent).
pub fn rope(x: &mut [f32], head_dim: usize, table: &[(f32, f32)]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, &(cos, sin)) in head.chunks_exact_mut(2).zip(table) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos - b * sin;
            pair[1] = a * sin + b * cos;
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_matmul_equals_the_dequantized_one() {
        use half::f16;
        // Two rows of two blocks each, in GGUF byte layout.
        let mut q4 = Vec::new();
        let mut q8 = Vec::new();
        for b in 0..4u8 {
            q4.extend(f16::from_f32(0.5 + f32::from(b)).to_le_bytes());
            q4.extend(f16::from_f32(-1.0).to_le_bytes());
            q4.extend((0..16u8).map(|i| i.wrapping_mul(7 + b)));
            q8.extend(f16::from_f32(0.25 * f32::from(b + 1)).to_le_bytes());
            q8.extend((0..32u8).map(|i| (i as i8 - 16 + b as i8) as u8));
        }
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37) % 11) as f32 * 0.1 - 0.5)
            .collect();
        for (q4_1, bytes) in [(true, &q4), (false, &q8)] {
            let w = Weight::from_blocks(2, 64, q4_1, bytes).unwrap();
            let dense = Weight::F32(Matrix::new(2, 64, [w.row_f32(0), w.row_f32(1)].concat()));
            let (a, b) = (w.matmul(&x, 2), dense.matmul(&x, 2));
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() < 1e-4, "{a:?} vs {b:?}");
            }
        }
        let q4_1 = Weight::from_blocks(2, 64, true, &q4).unwrap();
        let gguf = crate::model::gguf::dequantize(crate::model::gguf::TensorType::Q4_1, &q4);
        assert_eq!([q4_1.row_f32(0), q4_1.row_f32(1)].concat(), gguf);
        assert!(Weight::from_blocks(2, 64, true, &q4[..40]).is_err());
    }

    #[test]
    fn matmul_matches_the_definition_for_one_and_many_inputs() {
        let m = Matrix::new(3, 20, (0..60).map(|i| (i % 7) as f32 - 3.0).collect());
        let w = Weight::F32(m.clone());
        let x: Vec<f32> = (0..40).map(|i| (i % 5) as f32 * 0.5).collect();
        let out = w.matmul(&x, 2);
        for t in 0..2 {
            for r in 0..3 {
                let want: f32 = (0..20).map(|c| m.row(r)[c] * x[t * 20 + c]).sum();
                assert!((out[t * 3 + r] - want).abs() < 1e-4);
            }
        }
        assert_eq!(w.matmul(&x[..20], 1), out[..3].to_vec());
    }

    #[test]
    fn rms_norm_and_softmax() {
        let y = rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0);
        let rms = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / rms).abs() < 1e-6 && (y[1] - 8.0 / rms).abs() < 1e-6);
        let mut p = vec![1.0, 2.0, 3.0];
        softmax(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6 && p[2] > p[1]);
    }

    #[test]
    fn rope_rotates_pairs_and_is_identity_at_zero() {
        let mut x = vec![1.0, 0.0, 0.0, 1.0];
        rope(&mut x, 4, &rope_table(0, 4, 10_000.0));
        assert_eq!(x, vec![1.0, 0.0, 0.0, 1.0]);
        let mut x = vec![1.0, 0.0];
        rope(&mut x, 2, &rope_table(1, 2, 10_000.0)); // angle 1 rad for pair 0
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
    }
}
