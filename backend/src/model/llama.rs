//! The Llama-family forward pass on the CPU: embeddings, RMSNorm, RoPE,
//! grouped-query attention over the paged KV cache, SwiGLU, tied or separate
//! output head. One call runs a batch of sequence chunks (prefill chunks and
//! decode tokens mixed), reading each weight once per call.

use rayon::prelude::*;

use super::config::LlamaConfig;
use super::gguf::{Gguf, GgufError, TensorType};
use crate::compute::cpu::{Matrix, Weight, dot, rms_norm, rope, rope_table, silu, softmax};
use crate::kv::KvStorage;

/// The weights of one transformer block (Q and K rows in adjacent-pair RoPE
/// order).
#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: Weight,
    pub(crate) wk: Weight,
    pub(crate) wv: Weight,
    pub(crate) wo: Weight,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) w_gate: Weight,
    pub(crate) w_up: Weight,
    pub(crate) w_down: Weight,
}

/// A loaded model, weights in f32.
#[derive(Debug)]
pub struct Llama {
    pub config: LlamaConfig,
    embed: Weight,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None`: the output head is the embedding matrix (tied).
    lm_head: Option<Weight>,
}

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (scoring a text, perplexity).
    All,
    /// None (a prefill chunk that is not the prompt's last).
    None,
}

/// Tokens of one sequence to run, at positions `start..start + tokens.len()`.
/// The block table must cover every position up to the last.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub block_table: &'a [u32],
    pub logits: Logits,
}

/// Where a loader finds weights: tensors by name, as f32 in row-major order with
/// their shape outermost first (`[rows, cols]`, or `[len]`).
pub trait TensorSource {
    fn tensor(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), String>;
    fn has(&self, name: &str) -> bool;
    /// The tensor kept quantized (Q4_1, Q8_0), if it is stored so.
    fn quantized(&self, _name: &str, _rows: usize, _cols: usize) -> Option<Result<Weight, String>> {
        None
    }
}

impl TensorSource for Gguf {
    fn tensor(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), String> {
        let (data, dims) = self.tensor_f32(name).map_err(|e| e.to_string())?;
        // GGUF lists dimensions innermost first.
        Ok((data, dims.iter().rev().map(|&d| d as usize).collect()))
    }
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    fn quantized(&self, name: &str, rows: usize, cols: usize) -> Option<Result<Weight, String>> {
        let (ty, bytes, dims) = self.tensor_raw(name).ok()?;
        let q4_1 = match ty {
            TensorType::Q4_1 => true,
            TensorType::Q8_0 => false,
            _ => return None,
        };
        if dims != [cols as u64, rows as u64] {
            return Some(Err(format!(
                "{name}: dims {dims:?}, expected [{cols}, {rows}]"
            )));
        }
        Some(Weight::from_blocks(rows, cols, q4_1, bytes).map_err(|e| format!("{name}: {e}")))
    }
}

/// Tensor names of one file layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// llama.cpp's GGUF names (`blk.N.attn_q.weight`); Q and K rows already in
    /// adjacent-pair RoPE order.
    Gguf,
    /// Hugging Face names (`model.layers.N.self_attn.q_proj.weight`); Q and K rows
    /// in rotate-half order, reordered at load.
    HuggingFace,
}

impl Naming {
    fn embed(self) -> &'static str {
        match self {
            Naming::Gguf => "token_embd.weight",
            Naming::HuggingFace => "model.embed_tokens.weight",
        }
    }
    fn norm(self) -> &'static str {
        match self {
            Naming::Gguf => "output_norm.weight",
            Naming::HuggingFace => "model.norm.weight",
        }
    }
    fn head(self) -> &'static str {
        match self {
            Naming::Gguf => "output.weight",
            Naming::HuggingFace => "lm_head.weight",
        }
    }
    /// A layer tensor: `part` is the GGUF short name.
    fn layer(self, i: usize, part: &str) -> String {
        match self {
            Naming::Gguf => format!("blk.{i}.{part}.weight"),
            Naming::HuggingFace => {
                let hf = match part {
                    "attn_norm" => "input_layernorm",
                    "attn_q" => "self_attn.q_proj",
                    "attn_k" => "self_attn.k_proj",
                    "attn_v" => "self_attn.v_proj",
                    "attn_output" => "self_attn.o_proj",
                    "ffn_norm" => "post_attention_layernorm",
                    "ffn_gate" => "mlp.gate_proj",
                    "ffn_up" => "mlp.up_proj",
                    "ffn_down" => "mlp.down_proj",
                    other => other,
                };
                format!("model.layers.{i}.{hf}.weight")
            }
        }
    }
}

/// A weight of shape `rows x cols`, kept quantized when the file stores it so.
fn weight(src: &dyn TensorSource, name: &str, rows: usize, cols: usize) -> Result<Weight, String> {
    match src.quantized(name, rows, cols) {
        Some(w) => w,
        None => matrix(src, name, rows, cols).map(Weight::F32),
    }
}

/// A weight of shape `rows x cols`, in f32.
fn matrix(src: &dyn TensorSource, name: &str, rows: usize, cols: usize) -> Result<Matrix, String> {
    let (data, shape) = src.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    if shape != [rows, cols] {
        return Err(format!(
            "{name}: shape {shape:?}, expected [{rows}, {cols}]"
        ));
    }
    Ok(Matrix::new(rows, cols, data))
}

fn vector(src: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, String> {
    let (data, shape) = src.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    if shape != [len] {
        return Err(format!("{name}: shape {shape:?}, expected [{len}]"));
    }
    Ok(data)
}

/// Where row `r` of a Q or K projection in rotate-half RoPE order (pairs
/// `(i, i + d/2)` within each head) goes in adjacent-pair order `(2i, 2i + 1)`.
fn adjacent_pair_row(r: usize, head_dim: usize) -> usize {
    let (head, within, half) = (r / head_dim, r % head_dim, head_dim / 2);
    head * head_dim
        + if within < half {
            2 * within
        } else {
            2 * (within - half) + 1
        }
}

/// Reorders the rows of a Q or K projection from rotate-half RoPE order to
/// adjacent pairs (`adjacent_pair_row`).
fn rotate_half_to_adjacent(m: Matrix, head_dim: usize) -> Matrix {
    let mut data = vec![0.0; m.data.len()];
    for r in 0..m.rows {
        let to = adjacent_pair_row(r, head_dim);
        data[to * m.cols..(to + 1) * m.cols].copy_from_slice(m.row(r));
    }
    Matrix::new(m.rows, m.cols, data)
}

impl Llama {
    /// Loads a llama.cpp-style GGUF (`token_embd`, `blk.N.*`, `output_norm`,
    /// optional `output`).
    pub fn from_gguf(g: &Gguf) -> Result<Llama, GgufError> {
        let config = LlamaConfig::from_gguf(g)?;
        Llama::from_source(config, g, Naming::Gguf).map_err(|reason| GgufError::Tensor {
            name: "model".into(),
            reason,
        })
    }

    /// Loads the weights of a model of shape `c` from `src`.
    pub fn from_source(
        c: LlamaConfig,
        src: &dyn TensorSource,
        naming: Naming,
    ) -> Result<Llama, String> {
        c.check()?;
        if c.q_dim() != c.hidden {
            return Err(format!(
                "{} heads of {} do not make a hidden size of {}",
                c.n_heads, c.head_dim, c.hidden
            ));
        }
        let (h, kv) = (c.hidden, c.kv_dim());
        // Hugging Face Q and K rows are reordered for RoPE (FP4 ones too).
        let qk = |name: &str, rows: usize| -> Result<Weight, String> {
            match naming {
                Naming::Gguf => weight(src, name, rows, h),
                Naming::HuggingFace => match src.quantized(name, rows, h) {
                    Some(Ok(Weight::Fp4(m))) => Ok(Weight::Fp4(
                        m.permute_rows(|r| adjacent_pair_row(r, c.head_dim)),
                    )),
                    Some(Ok(_)) => Err(format!("{name}: unexpected quantization")),
                    Some(Err(e)) => Err(e),
                    None => Ok(Weight::F32(rotate_half_to_adjacent(
                        matrix(src, name, rows, h)?,
                        c.head_dim,
                    ))),
                },
            }
        };
        let layers = (0..c.n_layers)
            .map(|i| {
                let n = |part: &str| naming.layer(i, part);
                Ok(Layer {
                    attn_norm: vector(src, &n("attn_norm"), h)?,
                    wq: qk(&n("attn_q"), h)?,
                    wk: qk(&n("attn_k"), kv)?,
                    wv: weight(src, &n("attn_v"), kv, h)?,
                    wo: weight(src, &n("attn_output"), h, h)?,
                    ffn_norm: vector(src, &n("ffn_norm"), h)?,
                    w_gate: weight(src, &n("ffn_gate"), c.ffn, h)?,
                    w_up: weight(src, &n("ffn_up"), c.ffn, h)?,
                    w_down: weight(src, &n("ffn_down"), h, c.ffn)?,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let lm_head = match src.has(naming.head()) {
            true => Some(weight(src, naming.head(), c.vocab, h)?),
            false => None,
        };
        Ok(Llama {
            embed: weight(src, naming.embed(), c.vocab, h)?,
            norm: vector(src, naming.norm(), h)?,
            layers,
            lm_head,
            config: c,
        })
    }

    pub(crate) fn layers_mut(&mut self) -> &mut [Layer] {
        &mut self.layers
    }

    /// The weights, for another backend to copy: (embedding, layers, final
    /// norm, output head; `None` when tied to the embedding).
    pub(crate) fn parts(&self) -> (&Weight, &[Layer], &[f32], Option<&Weight>) {
        (&self.embed, &self.layers, &self.norm, self.lm_head.as_ref())
    }

    /// Runs the chunks, writing their K and V into `kv`, and returns each chunk's
    /// requested logits (`vocab` floats per token asked for).
    pub fn forward(&self, kv: &mut KvStorage, chunks: &[SeqChunk<'_>]) -> Vec<Vec<f32>> {
        let c = &self.config;
        let (h, kv_dim, hd) = (c.hidden, c.kv_dim(), c.head_dim);
        // (chunk, position) of every token, in batch order.
        let tokens: Vec<(usize, usize)> = chunks
            .iter()
            .enumerate()
            .flat_map(|(ci, ch)| (0..ch.tokens.len()).map(move |i| (ci, ch.start + i)))
            .collect();
        let n = tokens.len();
        let mut x = Vec::with_capacity(n * h);
        for ch in chunks {
            for &t in ch.tokens {
                x.extend_from_slice(&self.embed.row_f32(t as usize));
            }
        }
        let ropes: Vec<Vec<(f32, f32)>> = tokens
            .iter()
            .map(|&(_, pos)| rope_table(pos, hd, c.rope_theta))
            .collect();
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();

        for (li, layer) in self.layers.iter().enumerate() {
            let xn = rms_norm(&x, &layer.attn_norm, c.rms_eps);
            let mut q = layer.wq.matmul(&xn, n);
            let mut k = layer.wk.matmul(&xn, n);
            let v = layer.wv.matmul(&xn, n);
            for (t, &(ci, pos)) in tokens.iter().enumerate() {
                rope(&mut q[t * h..(t + 1) * h], hd, &ropes[t]);
                rope(&mut k[t * kv_dim..(t + 1) * kv_dim], hd, &ropes[t]);
                kv.write(
                    li,
                    chunks[ci].block_table,
                    pos,
                    &k[t * kv_dim..(t + 1) * kv_dim],
                    &v[t * kv_dim..(t + 1) * kv_dim],
                );
            }
            let kv_ro: &KvStorage = kv;
            let mut attn = vec![0.0f32; n * h];
            attn.par_chunks_mut(h).enumerate().for_each(|(t, out)| {
                let (ci, pos) = tokens[t];
                let table = chunks[ci].block_table;
                let mut scores = vec![0.0f32; pos + 1];
                for head in 0..c.n_heads {
                    let qh = &q[t * h + head * hd..t * h + (head + 1) * hd];
                    let kvh = (head / group) * hd;
                    for (p, s) in scores.iter_mut().enumerate() {
                        let (kp, _) = kv_ro.read(li, table, p);
                        *s = dot(qh, &kp[kvh..kvh + hd]) * scale;
                    }
                    softmax(&mut scores);
                    let oh = &mut out[head * hd..(head + 1) * hd];
                    for (p, &w) in scores.iter().enumerate() {
                        let (_, vp) = kv_ro.read(li, table, p);
                        for (o, val) in oh.iter_mut().zip(&vp[kvh..kvh + hd]) {
                            *o += w * val;
                        }
                    }
                }
            });
            let o = layer.wo.matmul(&attn, n);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            let xn = rms_norm(&x, &layer.ffn_norm, c.rms_eps);
            let gate = layer.w_gate.matmul(&xn, n);
            let up = layer.w_up.matmul(&xn, n);
            let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
            let down = layer.w_down.matmul(&act, n);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }

        // Logits only for the tokens asked for.
        let mut first = 0;
        chunks
            .iter()
            .map(|ch| {
                let len = ch.tokens.len();
                let rows = match ch.logits {
                    Logits::None => first + len..first + len,
                    Logits::Last => first + len.saturating_sub(1)..first + len,
                    Logits::All => first..first + len,
                };
                first += len;
                if rows.is_empty() {
                    return Vec::new();
                }
                let xn = rms_norm(&x[rows.start * h..rows.end * h], &self.norm, c.rms_eps);
                self.lm_head
                    .as_ref()
                    .unwrap_or(&self.embed)
                    .matmul(&xn, rows.len())
            })
            .collect()
    }
}
