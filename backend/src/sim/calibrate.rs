//! `sluice sim calibrate`: times the real CPU forward pass on a set of batch
//! shapes (decode batches at several contexts, prefill chunks at several
//! offsets) and fits the profile's constants to them by least squares, so
//! the `cpu-smollm2` profile stands for the real worker.

use std::time::Instant;

use super::profile::{Profile, StepShape};
use crate::engine::{Executor, ModelExecutor};
use crate::kv::KvStorage;
use crate::model::{Llama, Logits, SeqChunk};

/// One timed shape.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Point {
    pub label: String,
    pub tokens: f64,
    pub pairs: f64,
    pub kv_reads: f64,
    pub measured_s: f64,
    pub fitted_s: f64,
}

/// The fit and the points it came from.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Calibration {
    pub profile: Profile,
    pub points: Vec<Point>,
    /// Root-mean-square relative error of the fit over the points.
    pub rms_relative_error: f64,
}

/// A shape to time: `seqs` sequences of `chunk` tokens each, starting at `start`.
struct Shape {
    seqs: usize,
    chunk: usize,
    start: usize,
}

const SHAPES: &[Shape] = &[
    Shape {
        seqs: 1,
        chunk: 1,
        start: 16,
    },
    Shape {
        seqs: 1,
        chunk: 1,
        start: 1024,
    },
    Shape {
        seqs: 4,
        chunk: 1,
        start: 256,
    },
    Shape {
        seqs: 8,
        chunk: 1,
        start: 64,
    },
    Shape {
        seqs: 8,
        chunk: 1,
        start: 1024,
    },
    Shape {
        seqs: 16,
        chunk: 1,
        start: 512,
    },
    Shape {
        seqs: 1,
        chunk: 32,
        start: 0,
    },
    Shape {
        seqs: 1,
        chunk: 128,
        start: 0,
    },
    Shape {
        seqs: 1,
        chunk: 256,
        start: 0,
    },
    Shape {
        seqs: 1,
        chunk: 256,
        start: 1024,
    },
    Shape {
        seqs: 2,
        chunk: 128,
        start: 512,
    },
];

/// Times every shape (the median of `rounds`) and fits a profile named
/// `cpu-smollm2` with the CPU worker's limits.
pub fn calibrate(model: std::sync::Arc<Llama>, block_size: usize, rounds: usize) -> Calibration {
    let c = &model.config;
    let most_blocks = SHAPES
        .iter()
        .map(|s| s.seqs * (s.start + s.chunk).div_ceil(block_size))
        .max()
        .unwrap_or(1);
    let storage = KvStorage::new(c.n_layers, most_blocks, block_size, c.kv_dim());
    let mut executor = ModelExecutor { model, storage };
    let mut points = Vec::new();
    for shape in SHAPES {
        let per_seq = (shape.start + shape.chunk).div_ceil(block_size);
        let tables: Vec<Vec<u32>> = (0..shape.seqs)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let tokens: Vec<u32> = (0..shape.chunk as u32).map(|t| 100 + t % 1000).collect();
        let chunks: Vec<SeqChunk<'_>> = tables
            .iter()
            .map(|table| SeqChunk {
                tokens: &tokens,
                start: shape.start,
                block_table: table,
                logits: Logits::Last,
            })
            .collect();
        let mut times: Vec<f64> = (0..rounds.max(1))
            .map(|_| {
                let t = Instant::now();
                executor.run(&chunks);
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let s = StepShape::of(&chunks);
        points.push(Point {
            label: format!("{} x {} tokens at {}", shape.seqs, shape.chunk, shape.start),
            tokens: s.tokens,
            pairs: s.pairs,
            kv_reads: s.kv_reads,
            measured_s: times[times.len() / 2],
            fitted_s: 0.0,
        });
    }
    let [overhead, token, pair, kv] = fit(&points);
    let mut profile = Profile::cpu_smollm2();
    profile.overhead_s = overhead;
    profile.weight_s = 0.0;
    profile.token_s = token;
    profile.pair_s = pair;
    profile.kv_token_s = kv;
    let mut sum_sq = 0.0;
    for p in &mut points {
        p.fitted_s = profile.step_seconds(StepShape {
            tokens: p.tokens,
            pairs: p.pairs,
            kv_reads: p.kv_reads,
        });
        sum_sq += ((p.fitted_s - p.measured_s) / p.measured_s).powi(2);
    }
    let rms_relative_error = (sum_sq / points.len() as f64).sqrt();
    Calibration {
        profile,
        points,
        rms_relative_error,
    }
}

/// Least squares for `measured = a + b·tokens + c·pairs + d·kv_reads`, each
/// point weighted by 1/measured (relative error), with no coefficient below
/// zero: a negative one is dropped and the rest fitted again.
fn fit(points: &[Point]) -> [f64; 4] {
    let rows: Vec<([f64; 4], f64)> = points
        .iter()
        .map(|p| {
            let w = 1.0 / p.measured_s;
            (
                [w, p.tokens * w, p.pairs * w, p.kv_reads * w],
                p.measured_s * w,
            )
        })
        .collect();
    let mut active = [true; 4];
    loop {
        let coef = solve_normal(&rows, &active);
        match (0..4).find(|&i| active[i] && coef[i] < 0.0) {
            Some(i) => active[i] = false,
            None => return coef,
        }
    }
}

/// Solves the normal equations over the active columns (Gaussian
/// elimination with partial pivoting); inactive columns are 0.
fn solve_normal(rows: &[([f64; 4], f64)], active: &[bool; 4]) -> [f64; 4] {
    let cols: Vec<usize> = (0..4).filter(|&i| active[i]).collect();
    let n = cols.len();
    let mut m = vec![vec![0.0; n + 1]; n];
    for (x, y) in rows {
        for (r, &i) in cols.iter().enumerate() {
            for (c, &j) in cols.iter().enumerate() {
                m[r][c] += x[i] * x[j];
            }
            m[r][n] += x[i] * y;
        }
    }
    for k in 0..n {
        let pivot = (k..n)
            .max_by(|&a, &b| m[a][k].abs().total_cmp(&m[b][k].abs()))
            .unwrap_or(k);
        m.swap(k, pivot);
        if m[k][k].abs() < 1e-300 {
            continue;
        }
        let pivot_row = m[k].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != k {
                let f = row[k] / pivot_row[k];
                for (value, p) in row[k..].iter_mut().zip(&pivot_row[k..]) {
                    *value -= f * p;
                }
            }
        }
    }
    let mut out = [0.0; 4];
    for (r, &i) in cols.iter().enumerate() {
        out[i] = if m[r][r].abs() < 1e-300 {
            0.0
        } else {
            m[r][n] / m[r][r]
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(tokens: f64, pairs: f64, kv_reads: f64, measured_s: f64) -> Point {
        Point {
            label: String::new(),
            tokens,
            pairs,
            kv_reads,
            measured_s,
            fitted_s: 0.0,
        }
    }

    #[test]
    fn fit_recovers_known_constants() {
        let truth = |t: f64, p: f64, k: f64| 0.002 + 0.01 * t + 1e-6 * p + 2e-5 * k;
        let shapes = [
            (1.0, 0.0, 16.0),
            (8.0, 0.0, 8000.0),
            (16.0, 0.0, 500.0),
            (128.0, 8256.0, 0.0),
            (256.0, 300_000.0, 0.0),
        ];
        let points: Vec<Point> = shapes
            .iter()
            .map(|&(t, p, k)| point(t, p, k, truth(t, p, k)))
            .collect();
        let [a, b, c, d] = fit(&points);
        assert!((a - 0.002).abs() < 1e-9, "{a}");
        assert!((b - 0.01).abs() < 1e-9, "{b}");
        assert!((c - 1e-6).abs() < 1e-12, "{c}");
        assert!((d - 2e-5).abs() < 1e-10, "{d}");
    }

    #[test]
    fn fit_never_returns_a_negative_constant() {
        // Times that fall with context would need a negative kv constant.
        let points = [
            point(1.0, 0.0, 100.0, 0.020),
            point(1.0, 0.0, 1000.0, 0.019),
            point(4.0, 0.0, 400.0, 0.050),
            point(8.0, 0.0, 8000.0, 0.090),
        ];
        let coef = fit(&points);
        assert!(coef.iter().all(|&c| c >= 0.0), "{coef:?}");
    }
}
