//! Re-storing a loaded model's linear layers (Q, K, V, O, gate, up, down) in
//! another precision: BF16, MXFP4 or NVFP4 (`--weights`). Embeddings, the
//! output head and norms keep what the file had.

use rayon::prelude::*;

use super::llama::Llama;
use crate::compute::cpu::{Matrix, Weight};
use crate::compute::fp4::{Fp4Format, Fp4Matrix};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// As the model file stores them.
    #[default]
    AsLoaded,
    Bf16,
    Mxfp4,
    Nvfp4,
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<WeightFormat, String> {
        match s {
            "as-loaded" => Ok(WeightFormat::AsLoaded),
            "bf16" => Ok(WeightFormat::Bf16),
            "mxfp4" => Ok(WeightFormat::Mxfp4),
            "nvfp4" => Ok(WeightFormat::Nvfp4),
            _ => Err(format!(
                "unknown weight format {s:?}: as-loaded, bf16, mxfp4 or nvfp4"
            )),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightFormat::AsLoaded => "as-loaded",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Mxfp4 => "mxfp4",
            WeightFormat::Nvfp4 => "nvfp4",
        })
    }
}

/// `w` in `format`, from its f32 values.
fn convert(w: &Weight, format: WeightFormat) -> Result<Weight, String> {
    let (rows, cols) = (w.rows(), w.cols());
    let values: Vec<f32> = (0..rows).flat_map(|r| w.row_f32(r)).collect();
    Ok(match format {
        WeightFormat::AsLoaded => return Err("nothing to convert to".into()),
        WeightFormat::Bf16 => Weight::F32(Matrix::new(
            rows,
            cols,
            values
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect(),
        )),
        WeightFormat::Mxfp4 => {
            Weight::Fp4(Fp4Matrix::quantize(Fp4Format::Mxfp4, rows, cols, &values)?)
        }
        WeightFormat::Nvfp4 => {
            Weight::Fp4(Fp4Matrix::quantize(Fp4Format::Nvfp4, rows, cols, &values)?)
        }
    })
}

impl Llama {
    /// The model with every layer's linear weights in `format`.
    pub fn with_linear_weights(mut self, format: WeightFormat) -> Result<Llama, String> {
        if format == WeightFormat::AsLoaded {
            return Ok(self);
        }
        self.layers_mut().par_iter_mut().enumerate().try_for_each(
            |(i, l)| -> Result<(), String> {
                for w in [
                    &mut l.wq,
                    &mut l.wk,
                    &mut l.wv,
                    &mut l.wo,
                    &mut l.w_gate,
                    &mut l.w_up,
                    &mut l.w_down,
                ] {
                    *w = convert(w, format).map_err(|e| format!("layer {i}: {e}"))?;
                }
                Ok(())
            },
        )?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_print() {
        for f in ["as-loaded", "bf16", "mxfp4", "nvfp4"] {
            assert_eq!(f.parse::<WeightFormat>().unwrap().to_string(), f);
        }
        assert!("fp8".parse::<WeightFormat>().is_err());
    }

    #[test]
    fn conversion_keeps_values_close() {
        let m = Matrix::new(2, 32, (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect());
        let w = Weight::F32(m.clone());
        let bf16 = convert(&w, WeightFormat::Bf16).unwrap();
        for (a, b) in m
            .data
            .iter()
            .zip(bf16.row_f32(0).iter().chain(&bf16.row_f32(1)))
        {
            assert!((a - b).abs() <= a.abs() / 256.0);
        }
        for f in [WeightFormat::Mxfp4, WeightFormat::Nvfp4] {
            let q = convert(&w, f).unwrap();
            assert!(matches!(q, Weight::Fp4(_)));
            // The matmul of the FP4 weight equals the matmul of its values.
            let x: Vec<f32> = (0..32).map(|i| i as f32 / 32.0).collect();
            let deq = Weight::F32(Matrix::new(
                2,
                32,
                (0..2).flat_map(|r| q.row_f32(r)).collect(),
            ));
            assert_eq!(q.matmul(&x, 1), deq.matmul(&x, 1));
        }
    }
}
