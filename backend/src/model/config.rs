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
        if !self.head_dim.is_multiple_of(2) || self.n_heads * self.head_dim != self.hidden {
            return Err(format!(
                "{} heads of {} do not make a hidden size of {}",
                self.n_heads, self.head_dim, self.hidden
            ));
        }
        if [self.n_layers, self.ffn, self.vocab, self.context].contains(&0) {
            return Err("a dimension is 0".into());
        }
        Ok(())
    }
}
