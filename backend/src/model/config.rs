//! The shape of a Llama-family model, read from GGUF metadata (or written by a
//! test for a tiny model).

use super::gguf::{Gguf, GgufError};

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
}

impl LlamaConfig {
    /// Reads `<arch>.*` keys (`general.architecture`, usually `llama`).
    pub fn from_gguf(g: &Gguf) -> Result<LlamaConfig, GgufError> {
        let arch = g.get_str("general.architecture")?;
        let key = |k: &str| format!("{arch}.{k}");
        let n_heads = g.get_u64(&key("attention.head_count"))? as usize;
        let hidden = g.get_u64(&key("embedding_length"))? as usize;
        let vocab = match g.get_u64(&key("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => g
                .get("tokenizer.ggml.tokens")?
                .as_array()
                .map_or(0, <[_]>::len),
        };
        let config = LlamaConfig {
            n_layers: g.get_u64(&key("block_count"))? as usize,
            hidden,
            ffn: g.get_u64(&key("feed_forward_length"))? as usize,
            n_heads,
            n_kv_heads: g
                .get_u64(&key("attention.head_count_kv"))
                .map_or(n_heads, |v| v as usize),
            head_dim: g
                .get_u64(&key("attention.key_length"))
                .map_or(hidden / n_heads.max(1), |v| v as usize),
            vocab,
            context: g.get_u64(&key("context_length"))? as usize,
            rope_theta: g.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0) as f32,
            rms_eps: g.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
        };
        config.check().map_err(|reason| GgufError::Metadata {
            key: format!("{arch}.*"),
            reason,
        })?;
        Ok(config)
    }

    /// Size of one token's Q across query heads (the hidden size, except in a
    /// tensor-parallel slice).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Size of one token's K (or V) across KV heads.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    pub fn check(&self) -> Result<(), String> {
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return Err(format!(
                "{} query heads cannot share {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(format!("a head size of {} is not even", self.head_dim));
        }
        if [self.n_layers, self.ffn, self.vocab, self.context].contains(&0) {
            return Err("a dimension is 0".into());
        }
        Ok(())
    }

    /// Llama shapes by name, for generated weights (`--synthetic-model`): real
    /// 8B or 70B weights cannot be fetched here, their shapes can be run.
    /// `llama-3.1-70b-tp8` is one GPU's slice of 70B under 8-way tensor
    /// parallelism (8 query heads, 1 KV head, an eighth of the FFN, all 80 layers).
    pub fn preset(name: &str) -> Option<LlamaConfig> {
        let llama3 = |n_layers, hidden, ffn, n_heads, n_kv_heads, head_dim| LlamaConfig {
            n_layers,
            hidden,
            ffn,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab: 128_256,
            context: 131_072,
            rope_theta: 500_000.0,
            rms_eps: 1e-5,
        };
        Some(match name {
            "llama-3.1-8b" => llama3(32, 4096, 14_336, 32, 8, 128),
            "llama-3.2-1b" => llama3(16, 2048, 8192, 32, 8, 64),
            "llama-3.1-70b-tp8" => LlamaConfig {
                vocab: 128_256 / 8,
                ..llama3(80, 8192, 28_672 / 8, 8, 1, 128)
            },
            _ => return None,
        })
    }

    /// The names `preset` knows.
    pub const PRESETS: &'static [&'static str] =
        &["llama-3.1-8b", "llama-3.2-1b", "llama-3.1-70b-tp8"];
}
