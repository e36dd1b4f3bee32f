//! What runs a step's batch for the scheduler: the model's forward pass over
//! the paged KV storage (`ModelExecutor`), or a timing model that only takes
//! time and picks tokens (the simulated engine in `crate::sim`).

use std::sync::Arc;

use crate::kv::KvStorage;
use crate::model::{Llama, SeqChunk};
use crate::transfer::{DirectTarget, KvDtype, KvLayout, KvShare};

/// What a chunk of the batch gives back.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Nothing: a prefill chunk that is not its prompt's last.
    Pending,
    /// The next token's logits, for the sampler.
    Logits(Vec<f32>),
    /// The next token itself (the simulator: no logits, logprob 0).
    Token(u32),
}

/// Runs one step over a batch of sequence chunks (prefill chunks and decode
/// tokens mixed), on the engine thread.
pub trait Executor: Send + 'static {
    /// The longest sequence, prompt plus output, in tokens.
    fn context(&self) -> usize;
    /// Token ids run from 0 to `vocab - 1`.
    fn vocab(&self) -> usize;
    /// One answer per chunk, in order.
    fn run(&mut self, chunks: &[SeqChunk<'_>]) -> Vec<Next>;
    /// How this executor's KV blocks look outside it (disaggregation).
    fn kv_layout(&self) -> KvLayout;
    /// The bytes of `blocks` in the [`KvLayout`] format, one after another.
    fn read_kv(&mut self, blocks: &[u32]) -> Vec<u8>;
    /// Writes `data` (blocks in the [`KvLayout`] format, in this executor's
    /// dtype) into `blocks`.
    fn write_kv(&mut self, blocks: &[u32], data: &[u8]);
    /// This executor's KV cache as other processes of the node may write
    /// into it (direct transfers to this worker); `None`: bytes only.
    fn kv_share(&self) -> Option<KvShare> {
        None
    }
    /// Copies `blocks` (from `target.from_block + offset` on) straight into
    /// the target's reserved pages, done when it returns; an error leaves
    /// the caller to send the bytes instead.
    fn copy_kv_into(
        &mut self,
        target: &DirectTarget,
        offset: usize,
        blocks: &[u32],
    ) -> Result<(), String> {
        let _ = (target, offset, blocks);
        Err("this executor cannot copy KV into another worker's cache".into())
    }
}

/// The real thing: the Llama forward pass, with K and V in `storage`.
#[derive(Debug)]
pub struct ModelExecutor {
    pub model: Arc<Llama>,
    pub storage: KvStorage,
}

impl Executor for ModelExecutor {
    fn context(&self) -> usize {
        self.model.config.context
    }

    fn vocab(&self) -> usize {
        self.model.config.vocab
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            n_layers: self.storage.n_layers as u32,
            block_size: self.storage.block_size as u32,
            kv_dim: self.storage.kv_dim as u32,
            dtype: KvDtype::F32,
        }
    }

    fn read_kv(&mut self, blocks: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(blocks.len() * self.kv_layout().block_bytes());
        for &block in blocks {
            for layer in 0..self.storage.n_layers {
                let (k, v) = self.storage.block(layer, block);
                out.extend(k.iter().flat_map(|x| x.to_le_bytes()));
                out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
            }
        }
        out
    }

    fn write_kv(&mut self, blocks: &[u32], data: &[u8]) {
        let span = self.storage.block_size * self.storage.kv_dim * 4;
        let mut parts = data.chunks_exact(span);
        for &block in blocks {
            for layer in 0..self.storage.n_layers {
                let (k, v) = self.storage.block_mut(layer, block);
                for (dst, src) in [(k, parts.next()), (v, parts.next())] {
                    let src = src.expect("the engine checked the data's length");
                    for (x, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
            }
        }
    }

    fn run(&mut self, chunks: &[SeqChunk<'_>]) -> Vec<Next> {
        // Run the forward pass on a pool thread: its many short parallel loops
        // then start without waking this thread in between.
        let (model, storage) = (&self.model, &mut self.storage);
        let logits = rayon::scope(|_| model.forward(storage, chunks));
        logits
            .into_iter()
            .map(|l| {
                if l.is_empty() {
                    Next::Pending
                } else {
                    Next::Logits(l)
                }
            })
            .collect()
    }
}
