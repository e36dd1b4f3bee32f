//! The Llama-family forward pass on the CPU: embeddings, RMSNorm, RoPE,
//! grouped-query attention over the paged KV cache, SwiGLU, tied or separate
//! output head. One call runs a batch of sequence chunks (prefill chunks and
//! decode tokens mixed), reading each weight once per call.

use rayon::prelude::*;

use super::config::LlamaConfig;
use super::gguf::{Gguf, GgufError};
use crate::compute::cpu::{Matrix, dot, rms_norm, rope, rope_table, silu, softmax};
use crate::kv::KvStorage;

/// The weights of one transformer block.
#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    ffn_norm: Vec<f32>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
}

/// A loaded model, weights in f32.
#[derive(Debug)]
pub struct Llama {
    pub config: LlamaConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None`: the output head is the embedding matrix (tied).
    lm_head: Option<Matrix>,
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

/// A weight of shape `rows x cols` from the GGUF (dims `[cols, rows]`).
fn matrix(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Matrix, GgufError> {
    let (data, dims) = g.tensor_f32(name)?;
    if dims != [cols as u64, rows as u64] {
        return Err(GgufError::Tensor {
            name: name.into(),
            reason: format!("dims {dims:?}, expected [{cols}, {rows}]"),
        });
    }
    Ok(Matrix::new(rows, cols, data))
}

fn vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, GgufError> {
    let (data, dims) = g.tensor_f32(name)?;
    if dims != [len as u64] {
        return Err(GgufError::Tensor {
            name: name.into(),
            reason: format!("dims {dims:?}, expected [{len}]"),
        });
    }
    Ok(data)
}

impl Llama {
    /// Loads a llama.cpp-style GGUF (`token_embd`, `blk.N.*`, `output_norm`,
    /// optional `output`).
    pub fn from_gguf(g: &Gguf) -> Result<Llama, GgufError> {
        let c = LlamaConfig::from_gguf(g)?;
        let (h, kv) = (c.hidden, c.kv_dim());
        let layers = (0..c.n_layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}.weight");
                Ok(Layer {
                    attn_norm: vector(g, &n("attn_norm"), h)?,
                    wq: matrix(g, &n("attn_q"), h, h)?,
                    wk: matrix(g, &n("attn_k"), kv, h)?,
                    wv: matrix(g, &n("attn_v"), kv, h)?,
                    wo: matrix(g, &n("attn_output"), h, h)?,
                    ffn_norm: vector(g, &n("ffn_norm"), h)?,
                    w_gate: matrix(g, &n("ffn_gate"), c.ffn, h)?,
                    w_up: matrix(g, &n("ffn_up"), c.ffn, h)?,
                    w_down: matrix(g, &n("ffn_down"), h, c.ffn)?,
                })
            })
            .collect::<Result<Vec<_>, GgufError>>()?;
        let lm_head = match g.tensors.contains_key("output.weight") {
            true => Some(matrix(g, "output.weight", c.vocab, h)?),
            false => None,
        };
        Ok(Llama {
            embed: matrix(g, "token_embd.weight", c.vocab, h)?,
            norm: vector(g, "output_norm.weight", h)?,
            layers,
            lm_head,
            config: c,
        })
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
                x.extend_from_slice(self.embed.row(t as usize));
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
