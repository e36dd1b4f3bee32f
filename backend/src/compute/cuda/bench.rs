//! Measurements of the CUDA forward pass (`sluice bench engine --device
//! cuda`): decode steps at a fixed batch and context, and whole-prompt
//! prefill, each next to its roofline at the card's measured ceilings
//! (`ceilings`: the H200's from ../shared/GPU.md, the H100's copy from
//! BENCHMARKS.md). Times are wall-clock per step, the step including its
//! host work and the copy of the sampled tokens back (what the engine pays).

use std::time::Instant;

use serde::Serialize;

use super::device::{Gpu, GpuError};
use super::executor::CudaExecutor;
use super::model::StepOutput;
use crate::model::{Logits, SeqChunk};

/// The ceilings a roofline is taken at: a card's measured device-to-device
/// copy bandwidth (read + write counted) and dense BF16 GEMM rate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Ceilings {
    pub hbm_bytes_per_s: f64,
    pub bf16_flops: f64,
    /// Where the figures come from, printed with the bench's setup line.
    pub source: &'static str,
}

/// The H200's ceilings (../shared/GPU.md: copy 4.25-4.3 TB/s, cuBLAS BF16
/// 8192³ 770-800 TFLOP/s).
pub const H200: Ceilings = Ceilings {
    hbm_bytes_per_s: 4.25e12,
    bf16_flops: 790e12,
    source: "H200, measured (GPU.md)",
};

/// The ceilings for the card called `gpu_name`: the H200's measured ones;
/// on an H100, its own measured copy (3.00 TB/s, BENCHMARKS.md, 2026-12-05)
/// with the H200's GEMM rate (the same GH100 chip and clocks); any other
/// card is taken at the H200's, and `source` says so.
pub fn ceilings(gpu_name: &str) -> Ceilings {
    if gpu_name.contains("H200") {
        H200
    } else if gpu_name.contains("H100") {
        Ceilings {
            hbm_bytes_per_s: 3.00e12,
            bf16_flops: H200.bf16_flops,
            source: "H100, copy measured (BENCHMARKS.md), GEMM rate the H200's",
        }
    } else {
        Ceilings {
            source: "not measured on this card: the H200's",
            ..H200
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct DecodeFigure {
    pub batch: usize,
    pub context: usize,
    pub steps: usize,
    pub step_ms_median: f64,
    pub tokens_per_s: f64,
    /// Weights plus every sequence's KV read once per step, at HBM speed (or
    /// the GEMM FLOPs at the BF16 rate, if longer), at the card's `ceilings`.
    pub roofline_tokens_per_s: f64,
    pub percent_of_roofline: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PrefillFigure {
    pub prompt: usize,
    pub ms_median: f64,
    pub tokens_per_s: f64,
    /// GEMM and attention FLOPs at the BF16 rate (or the weights at HBM
    /// speed, if longer), at the card's `ceilings`.
    pub roofline_tokens_per_s: f64,
    pub percent_of_roofline: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct GemvFigure {
    pub matrix: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    /// Ours (`gemv_bf16_*`, up to 8 tokens; else 0) and cuBLAS, in GB/s of
    /// weights read.
    pub ours_gb_s: f64,
    pub cublas_gb_s: f64,
}

/// Weight-read bandwidth of the decode GEMMs: every layer's copy of each
/// matrix in turn (far more than L2), ours against cuBLAS, at 1 and 8 tokens.
pub fn gemv_sweep(ex: &CudaExecutor) -> Result<Vec<GemvFigure>, GpuError> {
    let gpu = &ex.model.gpu;
    gpu.bind()?;
    let c = &ex.model.config;
    let widest = c.hidden.max(c.ffn).max(c.q_dim());
    let tallest = (2 * c.ffn).max(c.q_dim() + 2 * c.kv_dim()).max(c.hidden);
    let x = gpu.alloc::<u16>(64 * widest)?;
    let y = gpu.alloc::<f32>(64 * tallest)?;
    let (xp, yp) = (gpu.ptr(&x, 0), gpu.ptr(&y, 0));
    let mut out = Vec::new();
    for (name, copies, rows, cols) in ex.model.layer_matrices() {
        for tokens in [1usize, 8, 64] {
            let rate = |cublas: bool| -> Result<f64, GpuError> {
                let s = median_secs(gpu, &mut || {
                    for &w in &copies {
                        if cublas {
                            gpu.cublas_gemm_bf16(w, xp, yp, tokens, rows, cols, false)?;
                        } else if tokens <= 8 {
                            gpu.gemv_bf16(w, xp, yp, tokens, rows, cols, false)?;
                        }
                    }
                    Ok(())
                })?;
                let bytes = (copies.len() * rows * cols * 2) as f64;
                Ok(bytes / s / 1e9)
            };
            let ours_gb_s = if tokens <= 8 { rate(false)? } else { 0.0 };
            let cublas_gb_s = rate(true)?;
            out.push(GemvFigure {
                matrix: name,
                rows,
                cols,
                tokens,
                ours_gb_s,
                cublas_gb_s,
            });
        }
    }
    Ok(out)
}

#[derive(Clone, Debug, Serialize)]
pub struct AttentionFigure {
    pub batch: usize,
    pub context: usize,
    pub numerics: &'static str,
    pub splits: usize,
    /// One layer's decode attention (and split combine), median.
    pub us_per_layer: f64,
    /// K and V bytes read per second.
    pub kv_gb_s: f64,
}

/// Decode attention alone: `batch` sequences at `context`, every layer's
/// cache in turn, with each numerics' split policy.
pub fn attention_sweep(
    ex: &mut CudaExecutor,
    batch: usize,
    context: usize,
) -> Result<Vec<AttentionFigure>, GpuError> {
    use super::model::{Numerics, launch_attention};
    use super::plan::{SplitPolicy, StepPlan};
    let gpu = ex.model.gpu.clone();
    gpu.bind()?;
    let c = ex.model.config.clone();
    let bs = ex.kv.block_size;
    let pages = (context + 1).div_ceil(bs);
    if batch * pages > ex.kv.n_blocks {
        return Err(GpuError::Other(
            "the KV cache is too small for the sweep".into(),
        ));
    }
    let tables: Vec<Vec<u32>> = (0..batch).map(|s| table(s, pages)).collect();
    let token = [1u32];
    let chunks: Vec<SeqChunk<'_>> = (0..batch)
        .map(|s| SeqChunk {
            tokens: &token,
            start: context,
            block_table: &tables[s],
            logits: Logits::Last,
        })
        .collect();
    let mut out = Vec::new();
    for (numerics, name) in [
        (Numerics::BatchInvariant, "batch-invariant"),
        (Numerics::Fast, "fast"),
    ] {
        let policy = SplitPolicy::for_numerics(numerics, &gpu, c.n_kv_heads);
        let plan = StepPlan::new(&chunks, bs, c.n_heads / c.n_kv_heads, policy);
        let ws = ex.workspace_mut();
        ws.reserve(&gpu, &c, batch, batch, plan.decode_splits)?;
        let mut meta_buf = gpu.alloc::<i32>(1)?;
        let meta = plan.upload(&gpu, &mut meta_buf)?;
        let ws = ex.workspace();
        let (q, attn) = (ws.q_ptr(&gpu), ws.attn_ptr(&gpu));
        let all_layers = median_secs(&gpu, &mut || {
            for layer in 0..c.n_layers {
                let (k, v) = ex.kv.layer(&gpu, layer);
                launch_attention(&gpu, &c, ws, &plan, &meta, q, k, v, attn)?;
            }
            Ok(())
        })?;
        let per_layer = all_layers / c.n_layers as f64;
        let bytes = (batch * (context + 1) * 2 * 2 * c.kv_dim()) as f64;
        out.push(AttentionFigure {
            batch,
            context,
            numerics: name,
            splits: plan.decode_splits,
            us_per_layer: per_layer * 1e6,
            kv_gb_s: bytes / per_layer / 1e9,
        });
    }
    Ok(out)
}

#[derive(Clone, Debug, Serialize)]
pub struct TransferFigure {
    pub pages: usize,
    /// Bytes of one page of one layer's K (or V).
    pub page_bytes: usize,
    pub layers: usize,
    /// Every page, every layer, K and V.
    pub bytes: usize,
    pub ms_median: f64,
    pub gb_s: f64,
}

/// `pages` scattered KV pages of the `config` shape from GPU `src` to GPU
/// `dst` with `transfer::copy_pages` (one launch): median of 5 after a warm-up.
pub fn peer_transfer(
    src: &std::sync::Arc<super::Gpu>,
    dst: &std::sync::Arc<super::Gpu>,
    config: &crate::model::LlamaConfig,
    pages: usize,
    block_size: usize,
) -> Result<TransferFigure, GpuError> {
    use super::model::CudaKvCache;
    use super::transfer::{copy_pages, enable_peer_access};
    enable_peer_access(dst, src)?;
    let src_cache = CudaKvCache::new(src, config, pages, block_size)?;
    let mut dst_cache = CudaKvCache::new(dst, config, pages, block_size)?;
    // Scattered: a page goes to another slot, in a shuffled order.
    let (from, to) = (shuffled(pages, 1), shuffled(pages, 2));
    let s = median_secs(dst, &mut || {
        copy_pages(dst, &mut dst_cache, &to, src, &src_cache, &from)
    })?;
    Ok(transfer_figure(config, pages, block_size, s))
}

/// The scattered page order the transfer benches use (a seeded shuffle).
fn shuffled(pages: usize, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..pages as u32).collect();
    let mut x = seed;
    for i in (1..v.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, (x >> 33) as usize % (i + 1));
    }
    v
}

fn transfer_figure(
    config: &crate::model::LlamaConfig,
    pages: usize,
    block_size: usize,
    s: f64,
) -> TransferFigure {
    let page_bytes = block_size * config.kv_dim() * 2;
    let bytes = pages * config.n_layers * 2 * page_bytes;
    TransferFigure {
        pages,
        page_bytes,
        layers: config.n_layers,
        bytes,
        ms_median: s * 1e3,
        gb_s: bytes as f64 / s / 1e9,
    }
}

/// `pages` scattered KV pages of the `config` shape from a cache on `src`
/// into the cache another process shared as `share` (CUDA IPC; made with
/// [`super::transfer::share_of`] over `pages` pages), as a prefill worker
/// writes a decode worker's pages: `PeerCaches::copy_into`, one launch and
/// its wait, median of 5 after a warm-up (the first maps the handles).
pub fn ipc_transfer(
    src: &Gpu,
    share: crate::transfer::KvShare,
    config: &crate::model::LlamaConfig,
    pages: usize,
    block_size: usize,
) -> Result<TransferFigure, GpuError> {
    use super::model::CudaKvCache;
    use super::transfer::PeerCaches;
    let src_cache = CudaKvCache::new(src, config, pages, block_size)?;
    let target = crate::transfer::DirectTarget {
        share,
        from_block: 0,
        pages: shuffled(pages, 2),
        expires_unix_ms: u64::MAX,
    };
    let from = shuffled(pages, 1);
    let mut peers = PeerCaches::default();
    let s = median_secs(src, &mut || {
        peers.copy_into(src, &src_cache, &target, 0, &from)
    })?;
    Ok(transfer_figure(config, pages, block_size, s))
}

/// The median wall time of `f` over 5 runs after one warm-up, `gpu`'s stream
/// synchronized before and after each.
pub(crate) fn median_secs(
    gpu: &Gpu,
    f: &mut dyn FnMut() -> Result<(), GpuError>,
) -> Result<f64, GpuError> {
    let mut times = Vec::new();
    for rep in 0..6 {
        gpu.synchronize()?;
        let started = Instant::now();
        f()?;
        gpu.synchronize()?;
        if rep > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// FLOPs of the matrix products for one token: 2 per weight (head included),
/// which is the byte count of BF16 weights.
fn gemm_flops_per_token(ex: &CudaExecutor) -> f64 {
    ex.model.weight_bytes() as f64
}

/// Block table of sequence `seq` when each takes `pages` pages in order.
fn table(seq: usize, pages: usize) -> Vec<u32> {
    (seq * pages..(seq + 1) * pages).map(|p| p as u32).collect()
}

/// Fills `batch` sequences with `context` tokens each (prefill in steps of at
/// most `step_tokens`), so that decode can start at position `context`.
fn prefill_sequences(
    ex: &mut CudaExecutor,
    batch: usize,
    context: usize,
    pages: usize,
    step_tokens: usize,
) -> Result<(), GpuError> {
    let vocab = ex.model.config.vocab as u32;
    let tables: Vec<Vec<u32>> = (0..batch).map(|s| table(s, pages)).collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|s| {
            (0..context)
                .map(|i| ((s * 7919 + i * 31) as u32) % vocab)
                .collect()
        })
        .collect();
    let mut at = vec![0usize; batch];
    while at.iter().any(|&a| a < context) {
        let mut budget = step_tokens;
        let mut chunks = Vec::new();
        for s in 0..batch {
            if at[s] >= context || budget == 0 {
                continue;
            }
            let n = budget.min(context - at[s]);
            chunks.push(SeqChunk {
                tokens: &prompts[s][at[s]..at[s] + n],
                start: at[s],
                block_table: &tables[s],
                logits: Logits::None,
            });
            at[s] += n;
            budget -= n;
        }
        ex.step(&chunks, StepOutput::Argmax)?;
    }
    Ok(())
}

/// Decode at `batch` sequences of `context` tokens: `steps` timed steps after
/// `warmup`, each step one token per sequence, greedy on the GPU.
pub fn decode(
    ex: &mut CudaExecutor,
    batch: usize,
    context: usize,
    steps: usize,
    warmup: usize,
) -> Result<DecodeFigure, GpuError> {
    let bs = ex.kv.block_size;
    let pages = (context + steps + warmup + 1).div_ceil(bs);
    if batch * pages > ex.kv.n_blocks {
        return Err(GpuError::Other(format!(
            "batch {batch} at context {context} needs {} KV pages, the cache has {}",
            batch * pages,
            ex.kv.n_blocks
        )));
    }
    prefill_sequences(ex, batch, context, pages, 8192)?;
    let tables: Vec<Vec<u32>> = (0..batch).map(|s| table(s, pages)).collect();
    let mut last: Vec<u32> = vec![1; batch];
    let mut times = Vec::with_capacity(steps);
    for step in 0..warmup + steps {
        let pos = context + step;
        let tokens: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let chunks: Vec<SeqChunk<'_>> = (0..batch)
            .map(|s| SeqChunk {
                tokens: &tokens[s],
                start: pos,
                block_table: &tables[s],
                logits: Logits::Last,
            })
            .collect();
        let started = Instant::now();
        let out = ex.step(&chunks, StepOutput::Argmax)?;
        let elapsed = started.elapsed().as_secs_f64();
        if step >= warmup {
            times.push(elapsed);
        }
        for (s, r) in out.into_iter().enumerate() {
            if let super::model::ChunkResult::Tokens(t) = r {
                last[s] = t.first().copied().unwrap_or(1);
            }
        }
    }
    let step_s = median(times);
    let mid_context = context + warmup + steps / 2;
    let bytes =
        ex.model.weight_bytes() as f64 + (batch * mid_context * ex.kv.bytes_per_token()) as f64;
    let flops = gemm_flops_per_token(ex) * batch as f64;
    let roof = ceilings(&ex.model.gpu.name);
    let roof_s = (bytes / roof.hbm_bytes_per_s).max(flops / roof.bf16_flops);
    let tokens_per_s = batch as f64 / step_s;
    let roofline = batch as f64 / roof_s;
    Ok(DecodeFigure {
        batch,
        context,
        steps,
        step_ms_median: step_s * 1e3,
        tokens_per_s,
        roofline_tokens_per_s: roofline,
        percent_of_roofline: 100.0 * tokens_per_s / roofline,
    })
}

/// One sequence's whole prompt of `prompt` tokens in one step, `repeats` times
/// (into the same pages), after one warm-up.
pub fn prefill(
    ex: &mut CudaExecutor,
    prompt: usize,
    repeats: usize,
) -> Result<PrefillFigure, GpuError> {
    let bs = ex.kv.block_size;
    let pages = prompt.div_ceil(bs);
    if pages > ex.kv.n_blocks {
        return Err(GpuError::Other(format!(
            "a prompt of {prompt} needs {pages} KV pages, the cache has {}",
            ex.kv.n_blocks
        )));
    }
    let vocab = ex.model.config.vocab as u32;
    let tokens: Vec<u32> = (0..prompt).map(|i| ((i * 31 + 7) as u32) % vocab).collect();
    let t = table(0, pages);
    let chunk = [SeqChunk {
        tokens: &tokens,
        start: 0,
        block_table: &t,
        logits: Logits::Last,
    }];
    let mut times = Vec::new();
    for i in 0..=repeats {
        let started = Instant::now();
        ex.step(&chunk, StepOutput::Argmax)?;
        if i > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    let s = median(times);
    let c = &ex.model.config;
    // Causal attention: QK^T and PV, 2 FLOPs per multiply-add, half the square.
    let attention = 4.0 * (prompt as f64).powi(2) / 2.0 * (c.q_dim() * c.n_layers) as f64;
    let flops = gemm_flops_per_token(ex) * prompt as f64 + attention;
    let roof = ceilings(&ex.model.gpu.name);
    let roof_s =
        (flops / roof.bf16_flops).max(ex.model.weight_bytes() as f64 / roof.hbm_bytes_per_s);
    let tokens_per_s = prompt as f64 / s;
    let roofline = prompt as f64 / roof_s;
    Ok(PrefillFigure {
        prompt,
        ms_median: s * 1e3,
        tokens_per_s,
        roofline_tokens_per_s: roofline,
        percent_of_roofline: 100.0 * tokens_per_s / roofline,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each card's roofline at its own measured copy bandwidth; a card
    /// nobody measured says that it borrows the H200's.
    #[test]
    fn ceilings_follow_the_card() {
        assert_eq!(ceilings("NVIDIA H200"), H200);
        let h100 = ceilings("NVIDIA H100 80GB HBM3");
        assert_eq!(h100.hbm_bytes_per_s, 3.00e12);
        assert_eq!(h100.bf16_flops, H200.bf16_flops);
        let other = ceilings("NVIDIA A100-SXM4-80GB");
        assert_eq!(other.hbm_bytes_per_s, H200.hbm_bytes_per_s);
        assert!(other.source.contains("not measured"), "{}", other.source);
    }
}
