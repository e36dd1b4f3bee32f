//! What runs a step's batch for the scheduler: the model's forward pass over
//! the paged KV storage (`ModelExecutor`), or a timing model that only takes
//! time and picks tokens (the simulated engine in `crate::sim`).

use std::sync::Arc;

use crate::kv::KvStorage;
use crate::model::{Llama, SeqChunk};

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
