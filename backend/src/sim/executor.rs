//! The simulated executor: a step takes the time the profile gives for its
//! batch (slept, not computed), and each sequence's next token is a word
//! chosen by a hash of the previous token and its position, so the same
//! prompt always gets the same answer and answers re-tokenize to themselves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::profile::{Profile, StepShape};
use crate::engine::{Executor, Next};
use crate::model::{Logits, SeqChunk, Tokenizer};
use crate::transfer::{KvDtype, KvLayout};

#[derive(Debug)]
pub struct SimExecutor {
    profile: Profile,
    /// Real seconds per modelled second (2.0 = everything twice as slow).
    time_scale: f64,
    words: Arc<[u32]>,
    vocab: usize,
    /// When the previous step ends in real time; steps run back to back
    /// from it, so oversleeping once does not slow the engine down for good.
    busy_until: Instant,
}

impl SimExecutor {
    pub fn new(profile: Profile, time_scale: f64, words: Arc<[u32]>, vocab: usize) -> Self {
        assert!(
            !words.is_empty(),
            "the simulator needs at least one word token"
        );
        Self {
            profile,
            time_scale,
            words,
            vocab,
            busy_until: Instant::now(),
        }
    }
}

impl Executor for SimExecutor {
    fn context(&self) -> usize {
        self.profile.context
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    /// Simulated blocks hold no data: a transfer moves empty blocks.
    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            n_layers: 0,
            block_size: self.profile.block_size as u32,
            kv_dim: 0,
            dtype: KvDtype::Bf16,
        }
    }

    fn read_kv(&mut self, _blocks: &[u32]) -> Vec<u8> {
        Vec::new()
    }

    fn write_kv(&mut self, _blocks: &[u32], _data: &[u8]) {}

    fn run(&mut self, chunks: &[SeqChunk<'_>]) -> Vec<Next> {
        let seconds = self.profile.step_seconds(StepShape::of(chunks)) * self.time_scale;
        let now = Instant::now();
        self.busy_until = self.busy_until.max(now) + Duration::from_secs_f64(seconds);
        std::thread::sleep(self.busy_until.saturating_duration_since(now));
        chunks
            .iter()
            .map(|c| match c.logits {
                Logits::None => Next::Pending,
                Logits::Last | Logits::All => {
                    let last = c.tokens.last().copied().unwrap_or(0);
                    let position = (c.start + c.tokens.len()) as u64;
                    Next::Token(next_word(&self.words, last, position))
                }
            })
            .collect()
    }
}

/// The simulator's next token after `last` at `position`.
pub fn next_word(words: &[u32], last: u32, position: u64) -> u32 {
    let mut key = [0u8; 12];
    key[..4].copy_from_slice(&last.to_le_bytes());
    key[4..].copy_from_slice(&position.to_le_bytes());
    let h = xxhash_rust::xxh3::xxh3_64(&key);
    words[(h % words.len() as u64) as usize]
}

/// Tokens that are a space and 2-10 lowercase ASCII letters and that encode
/// back to themselves: text made of them tokenizes to the same ids, so a
/// client that sends an answer back in the next turn's history hits the
/// cache as it would with a real model.
pub fn word_tokens(tokenizer: &Tokenizer) -> Vec<u32> {
    (0..tokenizer.vocab_size() as u32)
        .filter(|&id| {
            let Ok(text) = tokenizer.decode(&[id], false) else {
                return false;
            };
            let Some(word) = text.strip_prefix(' ') else {
                return false;
            };
            (2..=10).contains(&word.len())
                && word.bytes().all(|b| b.is_ascii_lowercase())
                && tokenizer.encode(&text).ok().as_deref() == Some(&[id][..])
        })
        .collect()
}
