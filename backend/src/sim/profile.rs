//! The simulator's timing model: how long one engine step takes for a batch,
//! from a few constants per (model, machine) pair, and the profiles shipped
//! (`h200-llama-8b`, and `cpu-smollm2` fitted to the real CPU worker by
//! `sluice sim calibrate`).

use crate::compute::cuda::bench::H200;
use crate::model::SeqChunk;

/// The constants of one (model, machine) pair. A step takes
///
/// ```text
/// overhead + max(weight_s, tokens * token_s) + pairs * pair_s + kv_reads * kv_token_s
/// ```
///
/// where `tokens` are all tokens fed in the step, `pairs` the attention
/// (query, key) pairs of its prefill chunks (a chunk of n tokens at position
/// s has n·s + n·(n+1)/2), and `kv_reads` the context tokens whose K and V the
/// decode tokens read. The `max` is the roofline: a small batch is bound by
/// reading the weights once, a large one by the GEMM FLOPs.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Profile {
    pub name: String,
    /// What the profile stands for, and where each constant comes from.
    pub source: String,
    /// Fixed cost of a step (scheduling, launches, sampling), seconds.
    pub overhead_s: f64,
    /// Reading every weight once, seconds.
    pub weight_s: f64,
    /// Compute per token fed (the linear layers), seconds.
    pub token_s: f64,
    /// Compute per attention (query, key) pair in prefill, seconds.
    pub pair_s: f64,
    /// Reading one context token's K and V in decode, seconds.
    pub kv_token_s: f64,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks per worker.
    pub kv_blocks: u32,
    /// Tokens one step may feed.
    pub step_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// The model's context, tokens.
    pub context: usize,
    /// Bytes of K and V per token (all layers): what a disaggregated
    /// transfer moves. 0 = transfers take no time.
    #[serde(default)]
    pub kv_bytes_per_token: f64,
    /// The link between a prefill and a decode worker, bytes per second.
    #[serde(default)]
    pub kv_link_bytes_s: f64,
}

/// What one step feeds, summed over its chunks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    pub tokens: f64,
    pub pairs: f64,
    pub kv_reads: f64,
}

impl StepShape {
    /// Chunks of one token that extend a sequence are decode tokens (their
    /// attention reads the whole context); longer ones are prefill chunks.
    pub fn of(chunks: &[SeqChunk<'_>]) -> StepShape {
        let mut shape = StepShape::default();
        for c in chunks {
            let (n, s) = (c.tokens.len() as f64, c.start as f64);
            shape.tokens += n;
            if c.tokens.len() == 1 {
                shape.kv_reads += s + 1.0;
            } else {
                shape.pairs += n * s + n * (n + 1.0) / 2.0;
            }
        }
        shape
    }
}

impl Profile {
    /// Seconds one step of this shape takes.
    pub fn step_seconds(&self, shape: StepShape) -> f64 {
        self.overhead_s
            + self.weight_s.max(shape.tokens * self.token_s)
            + shape.pairs * self.pair_s
            + shape.kv_reads * self.kv_token_s
    }

    pub fn names() -> &'static [&'static str] {
        &["h200-llama-8b", "cpu-smollm2"]
    }

    pub fn by_name(name: &str) -> Option<Profile> {
        match name {
            "h200-llama-8b" => Some(Self::h200_llama_8b()),
            "cpu-smollm2" => Some(Self::cpu_smollm2()),
            _ => None,
        }
    }

    /// Llama-3.1-8B in BF16 on one H200.
    pub fn h200_llama_8b() -> Profile {
        // Llama-3.1-8B: 8.03e9 parameters; 32 layers, 32 query heads and 8
        // KV heads of 128, so K+V is 2*32*8*128*2 = 131,072 bytes per token.
        const PARAMS: f64 = 8.03e9;
        const KV_BYTES_PER_TOKEN: f64 = 131_072.0;
        const ATTN_FLOP_PER_PAIR: f64 = 4.0 * 32.0 * 32.0 * 128.0; // QK^T and PV
        // H200, measured on the device machine (the bench's ceilings, from
        // ../shared/GPU.md): device copy and dense BF16 GEMM. We assume a good
        // engine reaches 85% of each in its steps (issue 7's batch-1 decode
        // target), and 50% of the GEMM peak in attention.
        const HBM: f64 = H200.hbm_bytes_per_s * 0.85;
        const GEMM: f64 = H200.bf16_flops * 0.85;
        const ATTN: f64 = H200.bf16_flops * 0.5;
        // 141 GB of HBM at 90% use, less 16.1 GB of weights and ~4 GB of
        // activations and graphs: ~107 GB of KV = ~816k tokens = 51k blocks.
        let kv_tokens = (141e9 * 0.9 - PARAMS * 2.0 - 4e9) / KV_BYTES_PER_TOKEN;
        Profile {
            name: "h200-llama-8b".into(),
            source: format!(
                "Llama-3.1-8B BF16 on one H200: weights 16.1 GB read at 85% of the \
                 measured {} TB/s; 2*params FLOPs per token at 85% of the measured \
                 {} TFLOP/s; attention at 50%; 131,072 KV bytes per token; KV pool \
                 from 90% of 141 GB less weights and 4 GB; 0.4 ms step overhead and \
                 vLLM-like limits (8192 tokens per step, 256 running) assumed; \
                 disaggregated KV moves over one 400 Gb/s NIC (50 GB/s) between nodes",
                H200.hbm_bytes_per_s / 1e12,
                H200.bf16_flops / 1e12
            ),
            overhead_s: 0.4e-3,
            weight_s: PARAMS * 2.0 / HBM,
            token_s: 2.0 * PARAMS / GEMM,
            pair_s: ATTN_FLOP_PER_PAIR / ATTN,
            kv_token_s: KV_BYTES_PER_TOKEN / HBM,
            block_size: 16,
            kv_blocks: (kv_tokens / 16.0) as u32,
            step_tokens: 8192,
            max_running: 256,
            context: 131_072,
            kv_bytes_per_token: KV_BYTES_PER_TOKEN,
            kv_link_bytes_s: 50e9,
        }
    }

    /// SmolLM2-135M (Q4_1) on this project's 2-core development VM, fitted to
    /// the real CPU worker's step times by `sluice sim calibrate`.
    pub fn cpu_smollm2() -> Profile {
        Profile {
            name: "cpu-smollm2".into(),
            source: "SmolLM2-135M Q4_1 on the 2-core development VM: constants fitted by \
                     `sluice sim calibrate` to the real CPU worker's step times (see \
                     BENCHMARKS.md); limits are the CPU worker's defaults; F32 KV \
                     (46,080 bytes a token) over the TCP transport at the 1.1 GB/s \
                     `sluice bench transfer` measured on loopback"
                .into(),
            overhead_s: CPU_FIT.0,
            weight_s: CPU_FIT.1,
            token_s: CPU_FIT.2,
            pair_s: CPU_FIT.3,
            kv_token_s: CPU_FIT.4,
            block_size: 16,
            kv_blocks: 512,
            step_tokens: 256,
            max_running: 16,
            context: 8192,
            kv_bytes_per_token: 46_080.0,
            kv_link_bytes_s: 1.1e9,
        }
    }
}

/// (overhead, weight, token, pair, kv token) seconds, from `sluice sim
/// calibrate` on the development VM (BENCHMARKS.md).
const CPU_FIT: (f64, f64, f64, f64, f64) = (5.50e-3, 0.0, 5.86e-3, 3.28e-6, 7.74e-6);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Logits;

    fn chunk(tokens: &[u32], start: usize) -> SeqChunk<'_> {
        SeqChunk {
            tokens,
            start,
            block_table: &[],
            logits: Logits::Last,
        }
    }

    #[test]
    fn shape_counts_prefill_pairs_and_decode_reads() {
        let prompt = [1u32; 4];
        let one = [7u32];
        let shape = StepShape::of(&[chunk(&prompt, 10), chunk(&one, 99)]);
        assert_eq!(shape.tokens, 5.0);
        // 4 queries at positions 10..14 see 11, 12, 13, 14 keys.
        assert_eq!(shape.pairs, 11.0 + 12.0 + 13.0 + 14.0);
        assert_eq!(shape.kv_reads, 100.0);
    }

    #[test]
    fn h200_decode_is_bandwidth_bound_and_prefill_compute_bound() {
        let p = Profile::h200_llama_8b();
        let decode = p.step_seconds(StepShape {
            tokens: 1.0,
            pairs: 0.0,
            kv_reads: 1024.0,
        });
        // 16.1 GB at 3.6 TB/s is ~4.4 ms: about 220 tok/s at batch 1.
        assert!((4.5e-3..5.5e-3).contains(&decode), "{decode}");
        let prefill = p.step_seconds(StepShape {
            tokens: 8192.0,
            pairs: 8192.0 * 8193.0 / 2.0,
            kv_reads: 0.0,
        });
        // 8k tokens: 131 TFLOP of GEMM plus 17.6 TFLOP of attention.
        assert!((0.2..0.3).contains(&prefill), "{prefill}");
        assert!(p.kv_blocks > 40_000);
    }
}
