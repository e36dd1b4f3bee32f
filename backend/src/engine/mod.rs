//! The engine: continuous batching with chunked prefill and preemption
//! (`core`), token sampling (`sampling`), incremental detokenization with stop
//! strings (`detok`), and the request/event types (`types`).

mod core;
mod detok;
pub mod sampling;
mod types;

pub use core::{Engine, EngineConfig, NumberedKvEvent};
pub use sampling::{Sampled, Sampler, SamplingParams};
pub use types::{FinishReason, GenerateEvent, GenerateRequest, Load, TokenOut, Usage};
