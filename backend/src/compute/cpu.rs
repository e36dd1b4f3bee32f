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

/// Dot product with eight accumulators, so the compiler vectorizes it.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
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

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data");
        Self { rows, cols, data }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// `x` holds `n` inputs of `cols`; returns `n` outputs of `rows`. Threads
    /// split the weight rows, so each weight is read once for all `n` inputs.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "matmul input");
        let mut out_t = vec![0.0f32; self.rows * n];
        const ROWS_PER_TASK: usize = 16;
        out_t
            .par_chunks_mut(ROWS_PER_TASK * n)
            .enumerate()
            .for_each(|(chunk, out)| {
                let first = chunk * ROWS_PER_TASK;
                for (i, out_row) in out.chunks_mut(n).enumerate() {
                    let w = self.row(first + i);
                    for (t, o) in out_row.iter_mut().enumerate() {
                        *o = dot(w, &x[t * self.cols..(t + 1) * self.cols]);
                    }
                }
            });
        if n == 1 {
            return out_t;
        }
        let mut out = vec![0.0f32; n * self.rows];
        for r in 0..self.rows {
            for t in 0..n {
                out[t * self.rows + r] = out_t[r * n + t];
            }
        }
        out
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
    fn matmul_matches_the_definition_for_one_and_many_inputs() {
        let w = Matrix::new(3, 20, (0..60).map(|i| (i % 7) as f32 - 3.0).collect());
        let x: Vec<f32> = (0..40).map(|i| (i % 5) as f32 * 0.5).collect();
        let out = w.matmul(&x, 2);
        for t in 0..2 {
            for r in 0..3 {
                let want: f32 = (0..20).map(|c| w.row(r)[c] * x[t * 20 + c]).sum();
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
