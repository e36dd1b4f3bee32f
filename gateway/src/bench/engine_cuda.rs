//! `sluice bench engine --device cuda`: decode tokens/s at several batch sizes
//! (1k context) and prefill tokens/s at 1k and 8k prompts on one GPU, each as
//! a percentage of its roofline (BENCHMARKS.md), for the real SmolLM2 or a
//! synthetic Llama shape; with `--vs-torch`, PyTorch + transformers on the
//! same synthetic shape in the same run (bench/torch_llama.py, run first in
//! its own process so that each has the whole GPU). Also the decode GEMM and
//! decode attention sweeps, and both numerics.

use std::path::PathBuf;

use serde_json::{Value, json};
use sluice_backend::compute::cuda::bench::{
    attention_sweep, ceilings, decode, gemv_sweep, prefill,
};
use sluice_backend::compute::cuda::{CudaExecutor, CudaLlama, Gpu, Numerics};
use sluice_backend::model::{LlamaConfig, WeightFormat};

#[derive(Clone, Debug)]
pub struct CudaEngineBenchOptions {
    /// A GGUF model; `None` with `synthetic` set.
    pub model: Option<PathBuf>,
    /// A `LlamaConfig::preset` name (generated weights).
    pub synthetic: Option<String>,
    pub ordinal: usize,
    pub batches: Vec<usize>,
    pub context: usize,
    pub steps: usize,
    pub prompts: Vec<usize>,
    /// bench/torch_llama.py, to run the PyTorch peer.
    pub torch_script: Option<PathBuf>,
    /// The linear layers' format.
    pub weights: WeightFormat,
    /// Run the decode GEMM and decode attention sweeps before the steps.
    pub sweeps: bool,
}

/// Runs the benchmark, printing JSON lines through `emit`; returns the summary.
pub fn run_cuda_engine_bench(
    options: &CudaEngineBenchOptions,
    mut emit: impl FnMut(&Value),
) -> anyhow::Result<Value> {
    let mut summary = serde_json::Map::new();
    let shape_name = options
        .synthetic
        .clone()
        .unwrap_or_else(|| "gguf".to_string());
    if let (Some(script), Some(_)) = (&options.torch_script, &options.synthetic) {
        run_torch_peer(options, script, &shape_name, &mut summary, &mut emit);
    }
    let gpu = Gpu::open(options.ordinal)?;
    let (model, shape) = match (&options.synthetic, &options.model) {
        (Some(name), _) => {
            let config = LlamaConfig::preset(name).ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown shape {name:?}: {}",
                    LlamaConfig::PRESETS.join(", ")
                )
            })?;
            (
                CudaLlama::synthetic(gpu.clone(), config, 0x5eed, options.weights)?,
                name.clone(),
            )
        }
        (None, Some(path)) => {
            let loaded = sluice_backend::model::load(path)?;
            let llama = loaded
                .llama
                .with_linear_weights(options.weights)
                .map_err(anyhow::Error::msg)?;
            (CudaLlama::from_host(gpu.clone(), &llama)?, loaded.name)
        }
        (None, None) => anyhow::bail!("give --model or --synthetic-model"),
    };
    let block_size = 16;
    let warmup = 3;
    let largest_batch = options.batches.iter().copied().max().unwrap_or(1);
    let per_seq = (options.context + options.steps + warmup + 1).div_ceil(block_size);
    let longest_prompt = options.prompts.iter().copied().max().unwrap_or(0);
    let pages = (largest_batch * per_seq).max(longest_prompt.div_ceil(block_size));
    let weight_gb = model.weight_bytes() as f64 / 1e9;
    let mut ex = CudaExecutor::new(model, pages, block_size)?;
    let kv_gb = (pages * block_size * ex.kv.bytes_per_token()) as f64 / 1e9;
    let roof = ceilings(&gpu.name);
    emit(
        &json!({"bench": "setup", "gpu": gpu.name, "arch": gpu.arch, "shape": shape,
                 "weights": options.weights.to_string(), "weights_gb": weight_gb,
                 "kv_cache_gb": kv_gb, "roofline_hbm_tb_s": roof.hbm_bytes_per_s / 1e12,
                 "roofline_bf16_tflops": roof.bf16_flops / 1e12, "roofline_source": roof.source}),
    );
    if options.sweeps {
        for f in gemv_sweep(&ex)? {
            let mut line = serde_json::to_value(&f)?;
            line["bench"] = json!("gemv");
            emit(&line);
        }
        for &batch in &options.batches {
            for f in attention_sweep(&mut ex, batch, options.context)? {
                let mut line = serde_json::to_value(&f)?;
                line["bench"] = json!("attention");
                emit(&line);
            }
        }
    }
    // Each batch in both numerics (batch-invariant first, the default), and
    // batch 1 also without CUDA graphs. Keys of the summary get `suffix`.
    let mut decode_line =
        |ex: &mut CudaExecutor, batch: usize, suffix: &str, tag: Value| -> anyhow::Result<()> {
            let f = decode(ex, batch, options.context, options.steps, warmup)?;
            let mut line = serde_json::to_value(&f)?;
            line["bench"] = json!("decode");
            line["engine"] = json!("sluice");
            for (k, v) in tag.as_object().into_iter().flatten() {
                line[k] = v.clone();
            }
            emit(&line);
            summary.insert(
                format!("decode_tok_s_b{batch}{suffix}"),
                json!(f.tokens_per_s),
            );
            summary.insert(
                format!("decode_roofline_pct_b{batch}{suffix}"),
                json!(f.percent_of_roofline),
            );
            Ok(())
        };
    for &batch in &options.batches {
        decode_line(&mut ex, batch, "", json!({}))?;
    }
    if options.batches.contains(&1) {
        ex.set_graphs(false);
        decode_line(&mut ex, 1, "_no_graphs", json!({"cuda_graphs": false}))?;
        ex.set_graphs(true);
    }
    ex.set_numerics(Numerics::Fast);
    for &batch in &options.batches {
        decode_line(&mut ex, batch, "_fast", json!({"numerics": "fast"}))?;
    }
    ex.set_numerics(Numerics::BatchInvariant);
    for &prompt in &options.prompts {
        let f = prefill(&mut ex, prompt, 3)?;
        let mut line = serde_json::to_value(&f)?;
        line["bench"] = json!("prefill");
        line["engine"] = json!("sluice");
        emit(&line);
        summary.insert(format!("prefill_tok_s_{prompt}"), json!(f.tokens_per_s));
        summary.insert(
            format!("prefill_roofline_pct_{prompt}"),
            json!(f.percent_of_roofline),
        );
    }
    summary.insert("gpu".into(), json!(gpu.name));
    summary.insert("shape".into(), json!(shape));
    summary.insert("weights".into(), json!(options.weights.to_string()));
    summary.insert("summary".into(), json!(true));
    Ok(Value::Object(summary))
}

/// PyTorch + transformers on the same shape (bench/torch_llama.py), run before
/// sluice loads anything so that each has the whole GPU.
fn run_torch_peer(
    options: &CudaEngineBenchOptions,
    script: &std::path::Path,
    shape: &str,
    summary: &mut serde_json::Map<String, Value>,
    emit: &mut impl FnMut(&Value),
) {
    let batches: Vec<String> = options.batches.iter().map(|b| b.to_string()).collect();
    let prompts: Vec<String> = options.prompts.iter().map(|p| p.to_string()).collect();
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(["--shape", shape, "--batches", &batches.join(",")])
        .args(["--context", &options.context.to_string()])
        .args([
            "--steps",
            &options.steps.to_string(),
            "--prompts",
            &prompts.join(","),
        ])
        .env("CUDA_VISIBLE_DEVICES", options.ordinal.to_string())
        .output();
    match out {
        Ok(out) if out.status.success() => {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let Ok(v) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                if v.get("summary").is_some() {
                    for (k, val) in v.as_object().into_iter().flatten() {
                        if k.starts_with("decode_tok_s") || k.starts_with("prefill_tok_s") {
                            summary.insert(format!("torch_{k}"), val.clone());
                        }
                    }
                } else {
                    emit(&v);
                }
            }
        }
        Ok(out) => {
            let err = String::from_utf8_lossy(&out.stderr);
            emit(&json!({"bench": "peer", "engine": "pytorch+transformers",
                             "skipped": err.lines().rev().take(5).collect::<Vec<_>>()}));
        }
        Err(e) => emit(&json!({"bench": "peer", "skipped": e.to_string()})),
    }
}
