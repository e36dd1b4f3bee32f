//! `sluice bench fp4 --gemv`: the Hopper FP4 kernels on one GPU. Decode
//! regime: FP4 bytes read per second by the GEMV (1 to 16 tokens), the
//! tiled GEMM (64) and the fused one-token kernels batch 1 runs, on a Llama
//! shape's matrices copied past the L2. Prefill
//! regime: TFLOP/s at `prefill_tokens` rows, each way the model can run it,
//! next to cuBLAS on BF16 weights of the same shape.

use serde_json::{Map, Value, json};
use sluice_backend::compute::cuda::fp4::Fp4Figure;
use sluice_backend::compute::cuda::{
    FP4_SWEEP_TOKENS, Fp4PrefillFigure, Gpu, fp4_prefill_sweep, fp4_sweep,
};
use sluice_backend::model::LlamaConfig;

/// Runs both sweeps, printing JSON lines through `emit`; returns the summary.
pub fn run_fp4_gpu_bench(
    shape: &str,
    prefill_tokens: usize,
    mut emit: impl FnMut(&Value),
) -> anyhow::Result<Value> {
    let config = LlamaConfig::preset(shape).ok_or_else(|| {
        anyhow::anyhow!(
            "unknown shape {shape:?}: {}",
            LlamaConfig::PRESETS.join(", ")
        )
    })?;
    let gpu = Gpu::open(0)?;
    let figures = fp4_sweep(&gpu, &config, 512 << 20)?;
    let mut summary = Map::new();
    for f in &figures {
        let mut line = serde_json::to_value(f)?;
        line["bench"] = json!("fp4-gemv");
        emit(&line);
        summary.insert(
            format!("{}_{}{}_n{}", f.format, f.matrix, key_mark(f), f.tokens),
            json!(f.gb_s),
        );
    }
    // A decode step's four matrices per layer, bytes over time: the plain
    // kernels at each token count, and the fused ones batch 1 runs.
    for format in ["mxfp4", "nvfp4"] {
        let plain = FP4_SWEEP_TOKENS.map(|tokens| (tokens, ""));
        for (tokens, mark) in plain.into_iter().chain([(1, "_fused")]) {
            let of = || {
                figures.iter().filter(move |f| {
                    f.format == format && f.tokens == tokens && key_mark(f) == mark
                })
            };
            let bytes: f64 = of().map(|f| f.gb_s * f.us * 1e3).sum();
            let us: f64 = of().map(|f| f.us).sum();
            summary.insert(
                format!("{format}_layer_gb_s{mark}_n{tokens}"),
                json!(bytes / us / 1e3),
            );
        }
    }
    if prefill_tokens > 0 {
        let prefill = fp4_prefill_sweep(&gpu, &config, prefill_tokens)?;
        for f in &prefill {
            let mut line = serde_json::to_value(f)?;
            line["bench"] = json!("fp4-prefill");
            emit(&line);
        }
        // A layer's four matrices: FLOPs over time, per way.
        for format in ["mxfp4", "nvfp4"] {
            let of = || prefill.iter().filter(move |f| f.format == format);
            let flop = |f: &Fp4PrefillFigure| 2.0 * (f.rows * f.cols * f.tokens) as f64;
            let total: f64 = of().map(flop).sum();
            let rate = |tflops: fn(&Fp4PrefillFigure) -> f64| {
                total / of().map(|f| flop(f) / tflops(f)).sum::<f64>()
            };
            summary.insert(
                format!("{format}_prefill_gemm_tflops"),
                json!(rate(|f| f.gemm_tflops)),
            );
            summary.insert(
                format!("{format}_prefill_dequant_cublas_tflops"),
                json!(rate(|f| f.dequant_cublas_tflops)),
            );
            summary.insert(
                format!("{format}_prefill_cublas_bf16_tflops"),
                json!(rate(|f| f.cublas_bf16_tflops)),
            );
        }
        summary.insert("prefill_tokens".into(), json!(prefill_tokens));
    }
    summary.insert("bench".into(), json!("fp4-gemv"));
    summary.insert("device".into(), json!(gpu.name));
    summary.insert("shape".into(), json!(shape));
    summary.insert("summary".into(), json!(true));
    Ok(Value::Object(summary))
}

/// What a figure's summary keys carry after the matrix or "layer_gb_s":
/// "_fused" for the fused one-token kernels, nothing for the plain ones.
fn key_mark(f: &Fp4Figure) -> &'static str {
    if f.kernel == "fused" { "_fused" } else { "" }
}
