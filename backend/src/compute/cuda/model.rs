//! The Llama forward pass on one GPU. Weights are BF16 on the device, or the
//! linear layers' FP4 (MXFP4, NVFP4) as they are (Q and K projections fused
//! with V into one `wqkv`, gate with up into `w_gate_up`);
//! the residual stream is f32; K and V live in a paged BF16 cache with the same
//! block layout as the CPU's (`crate::kv::KvStorage`). A step runs a batch of
//! sequence chunks, prefill chunks and decode tokens mixed, as on the CPU:
//! per layer RMSNorm, one QKV GEMM, RoPE with the cache write, attention
//! (decode and prefill launches), the output GEMM accumulated into the
//! residual, RMSNorm, one gate-up GEMM, SwiGLU, the down GEMM accumulated.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaSlice};

use super::device::{
    DevPtr, GEMM_ROW_TILE, Gpu, GpuError, KernelArg, capture_broken_by_another_thread, elementwise,
    grid,
};
use super::fp4::{
    FP4_COLS_MULTIPLE, FP4_FUSED_ROWS_MULTIPLE, FP4_GEMV_MAX_TOKENS, Fp4Weights, SumOrder,
    fp4_fast_gemm_max_tokens,
};
use super::layers;
use crate::compute::cpu::{Quant, Weight};
use crate::compute::fp4::{Fp4Format, Fp4Matrix};
use crate::model::{Llama, LlamaConfig, SeqChunk, WeightFormat};

/// BF16 values as their bits.
type Bf16 = u16;

use super::plan::{KEY_TILE, MetaPtrs, PREFILL_ROWS, SplitPolicy, StepPlan};

/// Query heads per KV head the decode kernel takes (the N of its MMAs,
/// `attention_decode_mma` in attention.cu).
const DECODE_MAX_GROUP: usize = 8;

/// Dynamic shared memory of an attention block (the kernel's ATTN_SMEM).
fn attention_smem(head_dim: usize, rows: usize) -> u32 {
    (rows * head_dim * 4
        + rows * KEY_TILE * 4
        + 3 * rows * 4
        + KEY_TILE * (head_dim + 2) * 2
        + KEY_TILE * head_dim * 2) as u32
}

/// FP4 gate and up weights go to the GPU with their rows in alternate runs
/// of this many (gate rows 8k .. 8k + 7, then up rows 8k .. 8k + 7), so that
/// a 16-row tile of the fused one-token GEMV is 8 gate rows and their up
/// rows, read as one piece (fp4.cu, FP4_NORM_SWIGLU); `silu_mul` takes the
/// order in every other step. BF16 keeps [gate | up].
const GATE_UP_RUN: usize = 8;

/// A linear layer's weights (rows x cols, row-major).
#[derive(Debug)]
enum Linear {
    Bf16(CudaSlice<Bf16>),
    Fp4(Fp4Weights),
}

impl Linear {
    /// Bytes a step reads.
    fn bytes(&self) -> usize {
        match self {
            Linear::Bf16(w) => w.len() * 2,
            Linear::Fp4(w) => w.bytes(),
        }
    }

    /// The gate and up projections as one matrix, and the run in which their
    /// rows alternate: FP4 in runs of GATE_UP_RUN where the FFN size takes
    /// it, else stacked ([gate | up], run 0; BF16 with `g` folded in).
    fn gate_up(
        gpu: &Gpu,
        gate: &Weight,
        up: &Weight,
        cols: usize,
        g: &[f32],
    ) -> Result<(Linear, usize), GpuError> {
        if let (Weight::Fp4(a), Weight::Fp4(b)) = (gate, up)
            && a.rows == b.rows
            && a.rows.is_multiple_of(GATE_UP_RUN)
            && a.format == b.format
            && cols.is_multiple_of(FP4_COLS_MULTIPLE)
        {
            let runs: Vec<Fp4Matrix> = (0..a.rows / GATE_UP_RUN)
                .flat_map(|k| [a, b].map(|m| m.row_range(k * GATE_UP_RUN, GATE_UP_RUN)))
                .collect();
            let parts: Vec<&Fp4Matrix> = runs.iter().collect();
            return Ok((Linear::Fp4(Fp4Weights::stack(gpu, &parts)?), GATE_UP_RUN));
        }
        Ok((Linear::stacked(gpu, &[gate, up], cols, Some(g))?, 0))
    }

    /// The matrix of `parts` stacked by rows (each `rows x cols` as given):
    /// FP4 as it is when every part is FP4 of one format and the kernels take
    /// the columns; else BF16 (FP4 parts dequantized), its columns times
    /// `col_scale` where one is given (`put_weight`).
    fn stacked(
        gpu: &Gpu,
        parts: &[&Weight],
        cols: usize,
        col_scale: Option<&[f32]>,
    ) -> Result<Linear, GpuError> {
        let fp4: Vec<&Fp4Matrix> = parts
            .iter()
            .filter_map(|w| match w {
                Weight::Fp4(m) => Some(m),
                _ => None,
            })
            .collect();
        if fp4.len() == parts.len()
            && cols.is_multiple_of(FP4_COLS_MULTIPLE)
            && fp4.iter().all(|m| m.format == fp4[0].format)
        {
            return Ok(Linear::Fp4(Fp4Weights::stack(gpu, &fp4)?));
        }
        let rows: usize = parts.iter().map(|w| w.rows()).sum();
        let out = gpu.alloc::<Bf16>(rows * cols)?;
        let col_scale = col_scale.map(|g| gpu.upload(g)).transpose()?;
        let col_scale = col_scale.as_ref().map_or(0, |g| gpu.ptr(g, 0));
        let mut row = 0;
        for w in parts {
            put_weight(gpu, w, gpu.ptr(&out, row * cols), col_scale)?;
            row += w.rows();
        }
        Ok(Linear::Bf16(out))
    }
}

/// A layer's weights. Each RMSNorm's weights g are folded into the columns
/// of the projection after it where that is BF16 (W diag(g), rounded once
/// at load: RMSNorm(x) W^T = (x / rms(x)) (W diag(g))^T), and the norm then
/// applies ones; FP4 projections keep W as quantized and the norm applies g.
/// So the fused one-token GEMVs read the residual alone (gemv.cu).
#[derive(Debug)]
struct CudaLayer {
    /// The weights `rms_norm` applies before QKV: ones where folded.
    attn_norm: CudaSlice<f32>,
    /// [q_dim + 2 kv_dim, hidden]
    wqkv: Linear,
    /// [hidden, q_dim]
    wo: Linear,
    /// The weights `rms_norm` applies before gate/up: ones where folded.
    ffn_norm: CudaSlice<f32>,
    /// [2 ffn, hidden]: gate rows, then up rows; or, where `gate_up_run`
    /// is not 0, the two in alternate runs of that many rows.
    w_gate_up: Linear,
    gate_up_run: usize,
    /// [hidden, ffn]
    w_down: Linear,
}

impl CudaLayer {
    /// QKV, o, gate/up and down, when all four are BF16.
    fn bf16_weights(&self) -> Option<[&CudaSlice<Bf16>; 4]> {
        match (&self.wqkv, &self.wo, &self.w_gate_up, &self.w_down) {
            (Linear::Bf16(qkv), Linear::Bf16(o), Linear::Bf16(gate_up), Linear::Bf16(down)) => {
                Some([qkv, o, gate_up, down])
            }
            _ => None,
        }
    }

    /// QKV, o, gate/up and down, when all four are FP4 that the fused
    /// one-token GEMVs take (the Hopper kernels' order, whole 16-row tiles,
    /// gate and up in runs of GATE_UP_RUN).
    fn fp4_weights(&self) -> Option<[&Fp4Weights; 4]> {
        match (&self.wqkv, &self.wo, &self.w_gate_up, &self.w_down) {
            (Linear::Fp4(qkv), Linear::Fp4(o), Linear::Fp4(gate_up), Linear::Fp4(down))
                if self.gate_up_run == GATE_UP_RUN =>
            {
                let all = [qkv, o, gate_up, down];
                all.iter()
                    .all(|w| !w.file_order && w.rows.is_multiple_of(FP4_FUSED_ROWS_MULTIPLE))
                    .then_some(all)
            }
            _ => None,
        }
    }
}

/// A model whose weights are on the GPU.
#[derive(Debug)]
pub struct CudaLlama {
    pub config: LlamaConfig,
    pub gpu: Arc<Gpu>,
    embed: CudaSlice<Bf16>,
    layers: Vec<CudaLayer>,
    norm: CudaSlice<f32>,
    /// `None`: tied to the embedding.
    lm_head: Option<CudaSlice<Bf16>>,
}

/// How a step's numbers are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numerics {
    /// A token's results do not depend on what else is in the batch: every
    /// GEMM is a cuBLAS call of a fixed number of rows, and decode attention
    /// splits keys at fixed points. Continuous batching then gives the same
    /// greedy tokens as one request at a time.
    #[default]
    BatchInvariant,
    /// The fastest kernels for each batch (our GEMV for one token, cuBLAS at
    /// the batch's size, decode splits sized to fill the GPU); results can
    /// differ in the last bits with the batch.
    Fast,
}

impl std::str::FromStr for Numerics {
    type Err = String;
    fn from_str(s: &str) -> Result<Numerics, String> {
        match s {
            "batch-invariant" => Ok(Numerics::BatchInvariant),
            "fast" => Ok(Numerics::Fast),
            _ => Err(format!("unknown numerics {s:?}: batch-invariant or fast")),
        }
    }
}

/// What a step gives back for the tokens that asked for logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutput {
    /// The logits, copied to the host.
    Logits,
    /// The greedy token, picked on the GPU (only 4 bytes a token come back).
    Argmax,
}

/// Per chunk: its logits (`vocab` floats per token asked for) or greedy tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum ChunkResult {
    Logits(Vec<f32>),
    Tokens(Vec<u32>),
}

impl CudaLlama {
    fn check_shape(config: &LlamaConfig) -> Result<(), GpuError> {
        config.check().map_err(GpuError::Other)?;
        layers::check_shape(config)?;
        if ![64, 128].contains(&config.head_dim) {
            return Err(GpuError::Other(format!(
                "the CUDA attention kernels take heads of 64 or 128, not {}",
                config.head_dim
            )));
        }
        let (group, most) = (
            config.n_heads / config.n_kv_heads,
            DECODE_MAX_GROUP.min(PREFILL_ROWS),
        );
        if group > most {
            return Err(GpuError::Other(format!(
                "{group} query heads per KV head is more than the attention kernels take ({most})"
            )));
        }
        Ok(())
    }

    /// Copies a CPU model's weights to the GPU: FP4 linear layers as they
    /// are, Q4_1 and Q8_0 blocks dequantized to BF16 there.
    pub fn from_host(gpu: Arc<Gpu>, model: &Llama) -> Result<CudaLlama, GpuError> {
        let c = model.config.clone();
        Self::check_shape(&c)?;
        gpu.bind()?;
        let (embed_w, layers_w, norm_w, head_w) = model.parts();
        let (h, q, ffn) = (c.hidden, c.q_dim(), c.ffn);
        let put = |dst: &CudaSlice<Bf16>, row: usize, cols: usize, w: &Weight| {
            put_weight(&gpu, w, gpu.ptr(dst, row * cols), 0)
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        // The norm's weights left to apply once `linear` took them or not.
        let applied = |linear: &Linear, g: &[f32]| match linear {
            Linear::Bf16(_) => gpu.upload(&vec![1.0f32; g.len()]),
            Linear::Fp4(_) => gpu.upload(g),
        };
        for l in layers_w {
            let wqkv = Linear::stacked(&gpu, &[&l.wq, &l.wk, &l.wv], h, Some(&l.attn_norm))?;
            let (w_gate_up, gate_up_run) =
                Linear::gate_up(&gpu, &l.w_gate, &l.w_up, h, &l.ffn_norm)?;
            layers.push(CudaLayer {
                attn_norm: applied(&wqkv, &l.attn_norm)?,
                wqkv,
                wo: Linear::stacked(&gpu, &[&l.wo], q, None)?,
                ffn_norm: applied(&w_gate_up, &l.ffn_norm)?,
                w_gate_up,
                gate_up_run,
                w_down: Linear::stacked(&gpu, &[&l.w_down], ffn, None)?,
            });
            gpu.synchronize()?;
        }
        let embed = gpu.alloc::<Bf16>(c.vocab * h)?;
        put(&embed, 0, h, embed_w)?;
        let lm_head = match head_w {
            Some(w) => {
                let head = gpu.alloc::<Bf16>(c.vocab * h)?;
                put(&head, 0, h, w)?;
                Some(head)
            }
            None => None,
        };
        let norm = gpu.upload(norm_w)?;
        gpu.synchronize()?;
        Ok(CudaLlama {
            config: c,
            gpu,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// A model of shape `config` with generated weights (uniform, scaled by
    /// 1/sqrt(fan-in); norms 1), made on the GPU: for the shapes whose real
    /// weights cannot be fetched here (`LlamaConfig::preset`). With `weights`
    /// MXFP4 or NVFP4, the linear layers are random FP4 codes of about the
    /// same spread (`Fp4Weights::synthetic`); embeddings and head BF16.
    pub fn synthetic(
        gpu: Arc<Gpu>,
        config: LlamaConfig,
        seed: u64,
        weights: WeightFormat,
    ) -> Result<CudaLlama, GpuError> {
        let c = config;
        Self::check_shape(&c)?;
        gpu.bind()?;
        let (h, q, kv, ffn) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        let mut next_seed = seed;
        let mut random = |len: usize, fan_in: usize| -> Result<CudaSlice<Bf16>, GpuError> {
            let out = gpu.alloc::<Bf16>(len)?;
            next_seed = next_seed.wrapping_add(len as u64);
            let scale = 1.0 / (fan_in as f32).sqrt();
            gpu.launch(
                "fill_uniform_bf16",
                elementwise(len),
                &[&gpu.ptr(&out, 0), &(len as u64), &next_seed, &scale],
            )?;
            Ok(out)
        };
        let fp4 = match weights {
            WeightFormat::Mxfp4 => Some(Fp4Format::Mxfp4),
            WeightFormat::Nvfp4 => Some(Fp4Format::Nvfp4),
            WeightFormat::AsLoaded | WeightFormat::Bf16 => None,
        };
        let mut fp4_seed = seed ^ 0xf4f4_f4f4;
        let mut linear = |rows: usize, cols: usize| -> Result<Linear, GpuError> {
            Ok(match fp4 {
                Some(format) => {
                    fp4_seed = fp4_seed.wrapping_add((rows * cols) as u64);
                    Linear::Fp4(Fp4Weights::synthetic(&gpu, format, rows, cols, fp4_seed)?)
                }
                None => Linear::Bf16(random(rows * cols, cols)?),
            })
        };
        // Norms of 1: folded into BF16 projections or not, they apply ones.
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(CudaLayer {
                attn_norm: gpu.upload(&vec![1.0f32; h])?,
                wqkv: linear(q + 2 * kv, h)?,
                wo: linear(h, q)?,
                ffn_norm: gpu.upload(&vec![1.0f32; h])?,
                w_gate_up: linear(2 * ffn, h)?,
                // Random FP4 codes: read in runs where the kernels take them.
                gate_up_run: match fp4 {
                    Some(_) if ffn.is_multiple_of(GATE_UP_RUN) => GATE_UP_RUN,
                    _ => 0,
                },
                w_down: linear(h, ffn)?,
            });
        }
        let embed = random(c.vocab * h, 1)?;
        let lm_head = Some(random(c.vocab * h, h)?);
        let norm = gpu.upload(&vec![1.0f32; h])?;
        gpu.synchronize()?;
        Ok(CudaLlama {
            config: c,
            gpu,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Each BF16 layer matrix kind with every layer's copy, as (name,
    /// addresses, rows, cols): for GEMM measurements over more bytes than L2
    /// holds. (FP4 matrices are left out: `fp4_sweep` measures those.)
    pub fn layer_matrices(&self) -> Vec<(&'static str, Vec<DevPtr>, usize, usize)> {
        let c = &self.config;
        let (h, q, kv, ffn) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        let all = |f: fn(&CudaLayer) -> &Linear| {
            self.layers
                .iter()
                .filter_map(|l| match f(l) {
                    Linear::Bf16(w) => Some(self.gpu.ptr(w, 0)),
                    Linear::Fp4(_) => None,
                })
                .collect::<Vec<_>>()
        };
        vec![
            ("qkv", all(|l| &l.wqkv), q + 2 * kv, h),
            ("o", all(|l| &l.wo), h, q),
            ("gate_up", all(|l| &l.w_gate_up), 2 * ffn, h),
            ("down", all(|l| &l.w_down), h, ffn),
        ]
        .into_iter()
        .filter(|m| !m.1.is_empty())
        .collect()
    }

    /// The FP4 layer matrices.
    fn fp4_matrices(&self) -> impl Iterator<Item = &Fp4Weights> {
        self.layers
            .iter()
            .flat_map(|l| [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down])
            .filter_map(|w| match w {
                Linear::Fp4(f) => Some(f),
                Linear::Bf16(_) => None,
            })
    }

    /// Elements of the largest FP4 layer matrix (0 without FP4 layers): the
    /// BF16 scratch a many-token step dequantizes into.
    fn largest_fp4(&self) -> usize {
        self.fp4_matrices()
            .map(|f| f.rows * f.cols)
            .max()
            .unwrap_or(0)
    }

    /// Whether the FP4 matrices were uploaded for the Blackwell path
    /// (`fp4_blackwell`).
    fn fp4_blockscaled(&self) -> bool {
        self.fp4_matrices().any(|f| f.file_order)
    }

    /// Up to how many tokens fast steps take the tiled FP4 GEMM here.
    fn fp4_fast_gemm_max(&self) -> usize {
        fp4_fast_gemm_max_tokens(&self.gpu)
    }

    /// f32s of scratch the Blackwell path needs at most for `n` tokens.
    fn fp4_blockscaled_scratch(&self, n: usize) -> usize {
        self.fp4_matrices()
            .map(|f| f.blockscaled_scratch(n))
            .max()
            .unwrap_or(0)
    }

    /// f32s of partial sums the FP4 GEMM needs at most for `n` tokens.
    fn fp4_gemm_scratch(&self, n: usize, order: SumOrder) -> usize {
        self.fp4_matrices()
            .map(|f| f.gemm_scratch(n, self.gpu.sm_count, order))
            .max()
            .unwrap_or(0)
    }

    /// Bytes of weights one decode step reads (every layer's matrices, FP4
    /// codes and scales as they are, and the BF16 output head; one embedding
    /// row per token is left out).
    pub fn weight_bytes(&self) -> usize {
        let c = &self.config;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.wqkv.bytes() + l.wo.bytes() + l.w_gate_up.bytes() + l.w_down.bytes())
            .sum();
        layers + 2 * c.vocab * c.hidden
    }

    /// Runs the chunks, writing their K and V into `kv`; returns, per chunk,
    /// what `output` asks for of the tokens that want logits. A step of
    /// decode tokens only runs as a CUDA graph when `ws` has graphs on: one is
    /// captured per batch layout (tokens, logit rows, table width, splits)
    /// and replayed after the step's index arrays are copied in.
    pub fn forward(
        &self,
        kv: &mut CudaKvCache,
        ws: &mut Workspace,
        chunks: &[SeqChunk<'_>],
        output: StepOutput,
    ) -> Result<Vec<ChunkResult>, GpuError> {
        let c = &self.config;
        let gpu = &*self.gpu;
        gpu.bind()?;
        let group = c.n_heads / c.n_kv_heads;
        let splits = SplitPolicy::for_numerics(ws.numerics, gpu, c.n_kv_heads);
        let plan = StepPlan::new(chunks, kv.block_size, group, splits);
        let n = plan.tokens.len();
        let m = plan.logit_rows.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        ws.reserve(gpu, c, n, m, plan.decode_splits)?;
        match ws.fp4_path(n, self.fp4_blockscaled(), self.fp4_fast_gemm_max()) {
            Fp4Path::Gemv(_) => {}
            Fp4Path::Gemm(order) => ws.reserve_fp4_part(gpu, self.fp4_gemm_scratch(n, order))?,
            Fp4Path::Dequantize => ws.reserve_dequant(gpu, self.largest_fp4())?,
            Fp4Path::BlockScaled => ws.reserve_fp4_part(gpu, self.fp4_blockscaled_scratch(n))?,
        }
        let meta = plan.upload(gpu, &mut ws.meta)?;
        if meta.grown {
            // Captured graphs point at the old index arrays.
            ws.graphs.clear();
        }
        let key = GraphKey {
            tokens: n,
            logit_rows: m,
            max_blocks: plan.max_blocks,
            splits: plan.decode_splits,
            argmax: output == StepOutput::Argmax,
        };
        let mut replayed = false;
        if ws.use_graphs && plan.prefill_items.is_empty() {
            if !ws.graphs.contains_key(&key) {
                match gpu.capture(|| self.record(kv, ws, &plan, &meta, output)) {
                    Ok(graph) => {
                        ws.graphs.insert(key, Graph(graph));
                    }
                    // Nothing was run: the step goes uncaptured below and the
                    // next one of this shape tries again.
                    Err(GpuError::Driver(e)) if capture_broken_by_another_thread(e) => {
                        tracing::debug!(error = %e, "CUDA graph capture broken; step run without a graph");
                    }
                    Err(e) => return Err(e),
                }
            }
            if let Some(graph) = ws.graphs.get(&key) {
                graph.0.launch()?;
                replayed = true;
            }
        }
        if !replayed {
            self.record(kv, ws, &plan, &meta, output)?;
        }

        let per_chunk = plan.logits_per_chunk.iter().copied();
        let mut results: Vec<ChunkResult> = Vec::with_capacity(chunks.len());
        match output {
            StepOutput::Logits => {
                let all = gpu.download(&ws.logits, m * c.vocab)?;
                let mut at = 0;
                for count in per_chunk {
                    results.push(ChunkResult::Logits(
                        all[at * c.vocab..(at + count) * c.vocab].to_vec(),
                    ));
                    at += count;
                }
            }
            StepOutput::Argmax => {
                let all = gpu.download(&ws.argmax, m)?;
                let mut at = 0;
                for count in per_chunk {
                    results.push(ChunkResult::Tokens(
                        all[at..at + count].iter().map(|&t| t as u32).collect(),
                    ));
                    at += count;
                }
            }
        }
        Ok(results)
    }

    /// Whether a one-token step can take the fused GEMVs: every linear layer
    /// BF16 and a shape they take (`layers::fuses`).
    fn fused_one_token(&self) -> bool {
        layers::fuses(&self.config) && self.layers.iter().all(|l| l.bf16_weights().is_some())
    }

    /// Whether a one-token step can take the fused FP4 GEMVs: every linear
    /// layer FP4 that they take (`CudaLayer::fp4_weights`). Off with
    /// `SLUICE_FP4_FUSED=0` (to measure what they give).
    fn fused_fp4_one_token(&self) -> bool {
        static ON: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
            std::env::var("SLUICE_FP4_FUSED").map_or(true, |v| v != "0")
        });
        *ON && self.layers.iter().all(|l| l.fp4_weights().is_some())
    }

    /// Enqueues a step's kernels on the stream: no allocation, no copy, no
    /// wait (so that it can be captured into a graph).
    fn record(
        &self,
        kv: &CudaKvCache,
        ws: &Workspace,
        plan: &StepPlan,
        meta: &MetaPtrs,
        output: StepOutput,
    ) -> Result<(), GpuError> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (h, q_dim, kv_dim, ffn) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        let (n, m) = (plan.tokens.len(), plan.logit_rows.len());
        let p = |s: &CudaSlice<f32>| gpu.ptr(s, 0);
        let b = |s: &CudaSlice<Bf16>| gpu.ptr(s, 0);
        let (x, xn, qkv, qb, attn) = (p(&ws.x), b(&ws.xn), p(&ws.qkv), b(&ws.q), b(&ws.attn));
        let (gate_up, act) = (p(&ws.gate_up), b(&ws.act));
        let (n32, h32, eps) = (n as u32, h as i32, c.rms_eps);
        let null: DevPtr = 0;
        let gemm = |w, x, y, n, rows, cols, accumulate| match ws.numerics {
            Numerics::BatchInvariant => gpu.gemm_bf16(w, x, y, n, rows, cols, accumulate),
            Numerics::Fast => gpu.gemm_bf16_fast(w, x, y, n, rows, cols, accumulate),
        };
        let fp4_path = ws.fp4_path(n, self.fp4_blockscaled(), self.fp4_fast_gemm_max());
        let linear = |w: &Linear, x, y, rows, cols, accumulate| match (w, fp4_path) {
            (Linear::Bf16(w), _) => gemm(b(w), x, y, n, rows, cols, accumulate),
            (Linear::Fp4(w), Fp4Path::Gemv(order)) => w.gemv(gpu, x, y, n, accumulate, order),
            (Linear::Fp4(w), Fp4Path::Gemm(order)) => {
                w.gemm(gpu, x, y, p(&ws.fp4_part), n, accumulate, order)
            }
            (Linear::Fp4(w), Fp4Path::Dequantize) => {
                let scratch = b(&ws.dequant);
                w.dequantize_into(gpu, scratch)?;
                gpu.gemm_bf16_fast(scratch, x, y, n, rows, cols, accumulate)
            }
            (Linear::Fp4(w), Fp4Path::BlockScaled) => {
                w.gemm_blockscaled(gpu, x, y, p(&ws.fp4_part), n, accumulate)
            }
        };

        // One token with the fast numerics, every linear layer BF16: the
        // fused GEMVs (layers::gemv_norm_rope and its kin), each input
        // projection taking the RMSNorm in front of it (its weights folded
        // into the projection's, CudaLayer) and what follows it, reading the
        // residual as BF16 from `xn`, which the embedding and the output
        // projections write. Six launches a layer instead of ten.
        let one_fast = n == 1 && ws.numerics == Numerics::Fast;
        let fused = one_fast && self.fused_one_token();
        // The same with FP4 layers (fp4.cu, FP4_NORM_ROPE and kin): the norms'
        // weights g cannot be folded into FP4 codes, so `xn` holds the
        // residual times the next norm's g, and `sumsq_tiles` the f32
        // residual's sums of squares by 16, from which the input projections
        // take the RMS; the embedding and the output projections write both.
        let fused_fp4 = one_fast && !fused && self.fused_fp4_one_token();
        // SAFETY (all launches): the buffers were sized by `reserve` for n
        // tokens and m logit rows; the index arrays hold n (or m) entries.
        let x_bf16 = if fused || fused_fp4 { xn } else { null };
        let sumsq = p(&ws.sumsq_tiles);
        let (first_norm, embed_sumsq) = match self.layers.first() {
            Some(l) if fused_fp4 => (p(&l.attn_norm), sumsq),
            _ => (null, null),
        };
        gpu.launch(
            "embed_rows",
            grid((n32, 1, 1), 256, 0),
            &[
                &b(&self.embed),
                &meta.tokens,
                &x,
                &x_bf16,
                &first_norm,
                &embed_sumsq,
                &h32,
            ],
        )?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (k_cache, v_cache) = kv.layer(gpu, li);
            let (pos, slots) = (meta.positions, meta.slots);
            if let Some([wqkv, wo, w_gate_up, w_down]) = layer.fp4_weights().filter(|_| fused_fp4) {
                // The next layer's input as `xn`, bf16(x g); none after the last.
                let (next_in, next_norm) = match self.layers.get(li + 1) {
                    Some(next) => (xn, p(&next.attn_norm)),
                    None => (null, null),
                };
                layers::fp4_gemv_norm_rope(
                    gpu, c, wqkv, xn, sumsq, pos, slots, qb, k_cache, v_cache,
                )?;
                launch_attention(gpu, c, ws, plan, meta, qb, k_cache, v_cache, attn)?;
                let ffn_norm = p(&layer.ffn_norm);
                layers::fp4_gemv_residual(gpu, wo, attn, x, xn, ffn_norm, sumsq)?;
                layers::fp4_gemv_norm_swiglu(gpu, c, w_gate_up, xn, sumsq, act)?;
                layers::fp4_gemv_residual(gpu, w_down, act, x, next_in, next_norm, sumsq)?;
                continue;
            }
            if let Some([wqkv, wo, w_gate_up, w_down]) = layer.bf16_weights().filter(|_| fused) {
                layers::gemv_norm_rope(gpu, c, b(wqkv), xn, pos, slots, qb, k_cache, v_cache)?;
                launch_attention(gpu, c, ws, plan, meta, qb, k_cache, v_cache, attn)?;
                layers::gemv_residual(gpu, b(wo), attn, x, h, q_dim, xn)?;
                layers::gemv_norm_swiglu(gpu, c, b(w_gate_up), xn, act)?;
                layers::gemv_residual(gpu, b(w_down), act, x, h, ffn, xn)?;
                continue;
            }
            layers::rms_norm(gpu, x, null, p(&layer.attn_norm), xn, n, h, eps)?;
            linear(&layer.wqkv, xn, qkv, q_dim + 2 * kv_dim, h, false)?;
            layers::rope_store_kv(gpu, c, qkv, pos, slots, qb, k_cache, v_cache, n)?;
            launch_attention(gpu, c, ws, plan, meta, qb, k_cache, v_cache, attn)?;
            linear(&layer.wo, attn, x, h, q_dim, true)?;
            layers::rms_norm(gpu, x, null, p(&layer.ffn_norm), xn, n, h, eps)?;
            linear(&layer.w_gate_up, xn, gate_up, 2 * ffn, h, false)?;
            layers::silu_mul(gpu, gate_up, act, n, ffn, layer.gate_up_run)?;
            linear(&layer.w_down, act, x, h, ffn, true)?;
        }
        if m > 0 {
            let head_in = b(&ws.head_in);
            layers::rms_norm(gpu, x, meta.logit_rows, p(&self.norm), head_in, m, h, eps)?;
            let head = b(self.lm_head.as_ref().unwrap_or(&self.embed));
            gemm(head, head_in, p(&ws.logits), m, c.vocab, h, false)?;
            if output == StepOutput::Argmax {
                layers::argmax_rows(gpu, p(&ws.logits), gpu.ptr(&ws.argmax, 0), m, c.vocab)?;
            }
        }
        Ok(())
    }
}

/// A captured graph that may move between threads with its workspace.
struct Graph(CudaGraph);

// SAFETY: CUDA graph objects must not be used by two threads at once (the
// driver's rule); a Graph lives in a Workspace and is used only through
// `&mut Workspace`, so by one thread at a time.
unsafe impl Send for Graph {}

/// What a captured decode graph was captured for.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct GraphKey {
    tokens: usize,
    logit_rows: usize,
    max_blocks: usize,
    splits: usize,
    argmax: bool,
}

/// Attention of every query token of the step (`q`, BF16 rows of q_dim) over
/// one layer's paged K and V into `out` (BF16 rows of q_dim): one launch for
/// the decode tokens (split across blocks, then combined) and one for the
/// prefill runs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_attention(
    gpu: &Gpu,
    c: &LlamaConfig,
    ws: &Workspace,
    plan: &StepPlan,
    meta: &MetaPtrs,
    q: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
    out: DevPtr,
) -> Result<(), GpuError> {
    let hd = c.head_dim;
    let (part_acc, part_ml) = (gpu.ptr(&ws.part_acc, 0), gpu.ptr(&ws.part_ml, 0));
    let (max_blocks, block_size) = (plan.max_blocks as i32, plan.block_size as i32);
    let (n_heads, n_kv_heads) = (c.n_heads as i32, c.n_kv_heads as i32);
    let scale = 1.0 / (hd as f32).sqrt();
    // The kernels' parameters (ATTN_ARGS in attention.cu), in order.
    let launch = |name: String, items: DevPtr, count: usize, splits: usize, per_split: DevPtr| {
        // The cluster kernels: one cluster a (item, KV head), its splits.
        let in_clusters = name.contains("cluster");
        // Decode kernels: 4 warps (8 in clusters), static shared memory only.
        let (threads, smem) = if in_clusters {
            (256, 0)
        } else if name.contains("decode") {
            (128, 0)
        } else {
            (256, attention_smem(hd, PREFILL_ROWS))
        };
        let config = grid(
            (count as u32, c.n_kv_heads as u32, splits as u32),
            threads,
            smem,
        );
        let cluster = (1, 1, splits as u32);
        let splits = splits as i32;
        let args: [&dyn KernelArg; 15] = [
            &q,
            &k_cache,
            &v_cache,
            &meta.tables,
            &max_blocks,
            &block_size,
            &items,
            &n_heads,
            &n_kv_heads,
            &scale,
            &splits,
            &per_split,
            &out,
            &part_acc,
            &part_ml,
        ];
        if in_clusters {
            // These load their first keys before they wait (attention.cu).
            gpu.launch_cluster_early(&name, config, cluster, &args)
        } else {
            gpu.launch(&name, config, &args)
        }
    };
    let decode_items = plan.decode_items.len() / 4;
    if decode_items > 0 {
        let splits = plan.decode_splits;
        let in_clusters = plan.decode_in_clusters;
        let kernel = if in_clusters { "cluster" } else { "mma" };
        launch(
            format!("attention_decode_{kernel}_hd{hd}"),
            meta.decode_items,
            decode_items,
            splits,
            meta.decode_keys_per_split,
        )?;
        if splits > 1 && !in_clusters {
            gpu.launch(
                "attention_combine",
                grid((decode_items as u32, c.n_heads as u32, 1), hd as u32, 0),
                &[
                    &part_acc,
                    &part_ml,
                    &meta.decode_rows,
                    &n_heads,
                    &(hd as i32),
                    &(splits as i32),
                    &out,
                ],
            )?;
        }
    }
    let prefill_items = plan.prefill_items.len() / 4;
    if prefill_items > 0 {
        launch(
            format!("attention_prefill_hd{hd}"),
            meta.prefill_items,
            prefill_items,
            1,
            meta.prefill_keys_per_split,
        )?;
    }
    Ok(())
}

/// Writes `w` as BF16 at `dst` (rows x cols elements); with `col_scale` (a
/// device pointer to `cols` f32, or 0 for none) each column times its scale,
/// multiplied in f32 and rounded once (weights.cu).
fn put_weight(gpu: &Gpu, w: &Weight, dst: DevPtr, col_scale: DevPtr) -> Result<(), GpuError> {
    let n = (w.rows() * w.cols()) as u64;
    let cols = w.cols() as u64;
    // SAFETY (launches): the sources hold what the kernels read for n
    // elements; dst has room for n BF16 values (the caller's layout).
    let from_f32 = |values: &[f32]| -> Result<(), GpuError> {
        let src = gpu.upload(values)?;
        gpu.launch(
            "f32_to_bf16_array",
            elementwise(n as usize),
            &[&gpu.ptr(&src, 0), &dst, &n, &col_scale, &cols],
        )?;
        gpu.synchronize()
    };
    match w {
        Weight::F32(m) => from_f32(&m.data)?,
        // FP4 where the FP4 kernels do not take it (embeddings, a head,
        // columns not whole 32s): as BF16.
        Weight::Fp4(m) => from_f32(&m.dequantize())?,
        Weight::Quant { quant, .. } => match quant {
            Quant::Q4_1 { scales, mins, qs } => {
                let (s, mi, q) = (gpu.upload(scales)?, gpu.upload(mins)?, gpu.upload(qs)?);
                let blocks = n / 32;
                gpu.launch(
                    "dequant_q4_1",
                    elementwise(n as usize / 2),
                    &[
                        &gpu.ptr(&s, 0),
                        &gpu.ptr(&mi, 0),
                        &gpu.ptr(&q, 0),
                        &dst,
                        &blocks,
                        &col_scale,
                        &cols,
                    ],
                )?;
                gpu.synchronize()?;
            }
            Quant::Q8_0 { scales, qs } => {
                let (s, q) = (gpu.upload(scales)?, gpu.upload(qs)?);
                let blocks = n / 32;
                gpu.launch(
                    "dequant_q8_0",
                    elementwise(n as usize),
                    &[
                        &gpu.ptr(&s, 0),
                        &gpu.ptr(&q, 0),
                        &dst,
                        &blocks,
                        &col_scale,
                        &cols,
                    ],
                )?;
                gpu.synchronize()?;
            }
        },
    }
    Ok(())
}

/// `put_weight`, for the kernel tests.
#[cfg(test)]
pub(crate) fn put_weight_for_test(gpu: &Gpu, w: &Weight, dst: DevPtr, col_scale: DevPtr) {
    put_weight(gpu, w, dst, col_scale).expect("put weight");
}

/// K and V of every layer: `n_blocks` pages of `block_size` token slots of
/// `kv_dim` BF16 values, per layer (the CPU's `KvStorage` layout). Allocated
/// outside the stream-ordered pool, so that a prefill worker in another
/// process can map it and write its pages (CUDA IPC, `super::transfer`).
#[derive(Debug)]
pub struct CudaKvCache {
    pub n_layers: usize,
    pub n_blocks: usize,
    pub block_size: usize,
    pub kv_dim: usize,
    pub(crate) k: ManuallyDrop<CudaSlice<Bf16>>,
    pub(crate) v: ManuallyDrop<CudaSlice<Bf16>>,
}

impl CudaKvCache {
    pub fn new(
        gpu: &Gpu,
        config: &LlamaConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> Result<CudaKvCache, GpuError> {
        let len = config.n_layers * n_blocks * block_size * config.kv_dim();
        Ok(CudaKvCache {
            n_layers: config.n_layers,
            n_blocks,
            block_size,
            kv_dim: config.kv_dim(),
            k: ManuallyDrop::new(gpu.alloc_shareable(len)?),
            v: ManuallyDrop::new(gpu.alloc_shareable(len)?),
        })
    }

    /// How its blocks look outside it (BF16, the engine's `KvLayout`).
    pub fn layout(&self) -> crate::transfer::KvLayout {
        crate::transfer::KvLayout {
            n_layers: self.n_layers as u32,
            block_size: self.block_size as u32,
            kv_dim: self.kv_dim as u32,
            dtype: crate::transfer::KvDtype::Bf16,
        }
    }

    /// Bytes of K and V one token takes, across layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * 2 * self.n_layers * self.kv_dim
    }

    /// The K and V base addresses of `layer`.
    pub(crate) fn layer(&self, gpu: &Gpu, layer: usize) -> (DevPtr, DevPtr) {
        let at = layer * self.n_blocks * self.block_size * self.kv_dim;
        (gpu.ptr(&self.k, at), gpu.ptr(&self.v, at))
    }

    /// K and V of one layer, as f32 on the host (tests).
    pub fn read_layer(&self, gpu: &Gpu, layer: usize) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
        let span = self.n_blocks * self.block_size * self.kv_dim;
        let all_k = gpu.download(&self.k, (layer + 1) * span)?;
        let all_v = gpu.download(&self.v, (layer + 1) * span)?;
        let f = |v: &[u16]| {
            v.iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect()
        };
        Ok((f(&all_k[layer * span..]), f(&all_v[layer * span..])))
    }
}

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        // SAFETY: neither slice is used again.
        let (k, v) = unsafe {
            (
                ManuallyDrop::take(&mut self.k),
                ManuallyDrop::take(&mut self.v),
            )
        };
        for slice in [k, v] {
            if let Err(e) = super::device::free_shareable(slice) {
                tracing::warn!(error = %e, "freeing the KV cache failed");
            }
        }
    }
}

/// Activations and step metadata, grown to the largest step seen, and the
/// CUDA graphs captured over them.
pub struct Workspace {
    /// Replay pure-decode steps as CUDA graphs.
    pub use_graphs: bool,
    pub numerics: Numerics,
    graphs: HashMap<GraphKey, Graph>,
    tokens: usize,
    logit_rows: usize,
    splits: usize,
    x: CudaSlice<f32>,
    /// The normalized rows (BF16); in a fused one-token step, the norm's
    /// input instead: the residual as BF16.
    xn: CudaSlice<Bf16>,
    /// In a fused one-token FP4 step, the residual's sums of squares by 16
    /// elements, which the writer of `xn` leaves for the RMS (fp4.cu).
    sumsq_tiles: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<Bf16>,
    attn: CudaSlice<Bf16>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<Bf16>,
    head_in: CudaSlice<Bf16>,
    logits: CudaSlice<f32>,
    argmax: CudaSlice<i32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    meta: CudaSlice<i32>,
    /// BF16 scratch for one FP4 matrix (steps of many tokens, fast numerics).
    dequant: CudaSlice<Bf16>,
    /// Partial sums of the FP4 GEMM's column splits.
    fp4_part: CudaSlice<f32>,
}

/// How a step multiplies FP4 weights (`fp4_path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fp4Path {
    /// Up to FP4_GEMV_MAX_TOKENS: the GEMV, in the GEMV's order
    /// (batch-invariant) or the fastest (`fp4::gemv_rotates`).
    Gemv(SumOrder),
    Gemm(SumOrder),
    Dequantize,
    /// Blackwell's block-scaled MMA, any number of tokens (`fp4_blackwell`).
    BlockScaled,
}

/// See `Workspace::fp4_path`.
fn fp4_path(numerics: Numerics, tokens: usize, blockscaled: bool, fast_gemm_max: usize) -> Fp4Path {
    match numerics {
        _ if blockscaled => Fp4Path::BlockScaled,
        Numerics::BatchInvariant if tokens <= FP4_GEMV_MAX_TOKENS => {
            Fp4Path::Gemv(SumOrder::AsGemv)
        }
        Numerics::Fast if tokens <= FP4_GEMV_MAX_TOKENS => Fp4Path::Gemv(SumOrder::Fastest),
        Numerics::BatchInvariant => Fp4Path::Gemm(SumOrder::AsGemv),
        Numerics::Fast if tokens <= fast_gemm_max => Fp4Path::Gemm(SumOrder::Fastest),
        Numerics::Fast => Fp4Path::Dequantize,
    }
}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("tokens", &self.tokens)
            .field("logit_rows", &self.logit_rows)
            .field("graphs", &self.graphs.len())
            .finish_non_exhaustive()
    }
}

impl Workspace {
    pub fn new(gpu: &Gpu) -> Result<Workspace, GpuError> {
        Ok(Workspace {
            use_graphs: true,
            numerics: Numerics::default(),
            graphs: HashMap::new(),
            tokens: 0,
            logit_rows: 0,
            splits: 0,
            x: gpu.alloc(1)?,
            xn: gpu.alloc(1)?,
            sumsq_tiles: gpu.alloc(1)?,
            qkv: gpu.alloc(1)?,
            q: gpu.alloc(1)?,
            attn: gpu.alloc(1)?,
            gate_up: gpu.alloc(1)?,
            act: gpu.alloc(1)?,
            head_in: gpu.alloc(1)?,
            logits: gpu.alloc(1)?,
            argmax: gpu.alloc(1)?,
            part_acc: gpu.alloc(1)?,
            part_ml: gpu.alloc(1)?,
            meta: gpu.alloc(1)?,
            dequant: gpu.alloc(1)?,
            fp4_part: gpu.alloc(1)?,
        })
    }

    /// How a step of `tokens` multiplies FP4 weights: the GEMV for few; past
    /// that, batch-invariant steps take the tiled GEMM in the GEMV's order
    /// (a token's results the same bits whichever the step's size picks),
    /// fast ones the tiled GEMM in its own order or, past `fast_gemm_max`
    /// (`fp4_fast_gemm_max_tokens`), a BF16 copy and cuBLAS. Weights uploaded
    /// for Blackwell's tensor cores (`blockscaled`) take them at every size.
    fn fp4_path(&self, tokens: usize, blockscaled: bool, fast_gemm_max: usize) -> Fp4Path {
        fp4_path(self.numerics, tokens, blockscaled, fast_gemm_max)
    }

    /// Room for `floats` partial sums of the FP4 GEMM.
    fn reserve_fp4_part(&mut self, gpu: &Gpu, floats: usize) -> Result<(), GpuError> {
        if floats > self.fp4_part.len() {
            self.fp4_part = gpu.alloc(floats)?;
            // Captured graphs point at the old buffer.
            self.graphs.clear();
        }
        Ok(())
    }

    /// Room for `elements` BF16 weights in the dequantization scratch.
    fn reserve_dequant(&mut self, gpu: &Gpu, elements: usize) -> Result<(), GpuError> {
        if elements > self.dequant.len() {
            self.dequant = gpu.alloc(elements)?;
            // Captured graphs point at the old buffer.
            self.graphs.clear();
        }
        Ok(())
    }

    pub(crate) fn q_ptr(&self, gpu: &Gpu) -> DevPtr {
        gpu.ptr(&self.q, 0)
    }

    pub(crate) fn attn_ptr(&self, gpu: &Gpu) -> DevPtr {
        gpu.ptr(&self.attn, 0)
    }

    pub(crate) fn reserve(
        &mut self,
        gpu: &Gpu,
        c: &LlamaConfig,
        tokens: usize,
        logit_rows: usize,
        splits: usize,
    ) -> Result<bool, GpuError> {
        let mut grown = false;
        if tokens > self.tokens || splits > self.splits {
            grown = true;
            // Room for whole GEMM tiles of rows (Gpu::gemm_bf16).
            let n = tokens
                .max(self.tokens)
                .max(GEMM_ROW_TILE)
                .next_power_of_two();
            // Splits grow a step at a time as sequences lengthen: room for
            // the next power of two, so that buffers (and graphs) rarely go.
            let s = splits.max(self.splits).next_power_of_two();
            let (h, q, kv, ffn) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
            self.x = gpu.alloc(n * h)?;
            self.xn = gpu.alloc(n * h)?;
            self.sumsq_tiles = gpu.alloc(h.div_ceil(16))?;
            self.qkv = gpu.alloc(n * (q + 2 * kv))?;
            self.q = gpu.alloc(n * q)?;
            self.attn = gpu.alloc(n * q)?;
            self.gate_up = gpu.alloc(n * 2 * ffn)?;
            self.act = gpu.alloc(n * ffn)?;
            self.part_acc = gpu.alloc(n * c.n_heads * s * c.head_dim)?;
            self.part_ml = gpu.alloc(n * c.n_heads * s * 2)?;
            self.tokens = n;
            self.splits = s;
        }
        if logit_rows > self.logit_rows {
            grown = true;
            let m = logit_rows.max(GEMM_ROW_TILE).next_power_of_two();
            self.head_in = gpu.alloc(m * c.hidden)?;
            self.logits = gpu.alloc(m * c.vocab)?;
            self.argmax = gpu.alloc(m)?;
            self.logit_rows = m;
        }
        if grown {
            // Captured graphs point at the old buffers.
            self.graphs.clear();
        }
        Ok(grown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// More query heads per KV head than the decode kernel's MMA takes are
    /// refused at load, with the count in the error.
    #[test]
    fn groups_past_the_decode_kernel_are_refused() {
        let mut c = LlamaConfig::preset("llama-3.1-8b").unwrap();
        assert!(CudaLlama::check_shape(&c).is_ok());
        c.n_kv_heads = 2; // 16 query heads per KV head
        let e = CudaLlama::check_shape(&c).unwrap_err().to_string();
        assert!(e.contains("16 query heads per KV head"), "{e}");
    }

    /// Batch-invariant steps never leave the GEMV's sums (the GEMV in its
    /// order, the GEMM in that order past 16 tokens, at any size); fast ones
    /// pick by size, the GEMV in the fastest order, the GEMM
    /// up to the GPU's limit (64 on `mma.sync`, 256 on warpgroup MMAs).
    #[test]
    fn fp4_paths_by_numerics_and_size() {
        use super::super::fp4::{FP4_GEMM_MAX_TOKENS, FP4_WGMMA_GEMM_MAX_TOKENS};
        use Fp4Path::*;
        let (mma, wgmma) = (FP4_GEMM_MAX_TOKENS, FP4_WGMMA_GEMM_MAX_TOKENS);
        for limit in [mma, wgmma] {
            for n in [1, 8, 16] {
                assert_eq!(
                    fp4_path(Numerics::BatchInvariant, n, false, limit),
                    Gemv(SumOrder::AsGemv)
                );
                assert_eq!(
                    fp4_path(Numerics::Fast, n, false, limit),
                    Gemv(SumOrder::Fastest)
                );
            }
            for n in [17, 64, 65, 257, 8192] {
                assert_eq!(
                    fp4_path(Numerics::BatchInvariant, n, false, limit),
                    Gemm(SumOrder::AsGemv)
                );
            }
        }
        let fast = Gemm(SumOrder::Fastest);
        for (n, limit, path) in [
            (17, mma, fast),
            (64, mma, fast),
            (65, mma, Dequantize),
            (17, wgmma, fast),
            (65, wgmma, fast),
            (256, wgmma, fast),
            (257, wgmma, Dequantize),
        ] {
            assert_eq!(
                fp4_path(Numerics::Fast, n, false, limit),
                path,
                "{n} tokens, limit {limit}"
            );
        }
        for numerics in [Numerics::BatchInvariant, Numerics::Fast] {
            for n in [1, 16, 17, 65, 8192] {
                assert_eq!(fp4_path(numerics, n, true, wgmma), BlockScaled);
            }
        }
    }
}
