//! Models: the GGUF reader, the Llama-family config and forward pass.

mod config;
pub mod gguf;
mod llama;
mod tokenizer;

pub use config::LlamaConfig;
pub use gguf::{Gguf, GgufError};
pub use llama::{Llama, Logits, SeqChunk};
pub use tokenizer::{ChatMessage, Tokenizer, TokenizerError};
