//! The engine: continuous batching with chunked prefill and preemption
//! (`core`) over an `executor` (the model's forward pass, or a timing model),
//! token sampling (`sampling`), incremental detokenization with stop strings
//! (`detok`), the request/event types (`types`), and which device runs it
//! (`device`).

mod core;
mod detok;
mod device;
mod executor;
pub mod sampling;
mod token_line;
mod types;

pub use core::{Engine, EngineConfig, KvIntake, NumberedKvEvent, Reservation};
pub use device::Device;
pub use executor::{Executor, ModelExecutor, Next};
pub use sampling::{Sampled, Sampler, SamplingParams};
pub use types::{FinishReason, GenerateEvent, GenerateRequest, Load, TokenOut, Usage};
