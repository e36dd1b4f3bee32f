//! Where requests can go: the fleet of workers with their health and load
//! (`fleet`), the KV index of which worker caches which prompt block
//! (`kv_index`), and the per-worker monitors that keep both true (`monitor`);
//! beside the decisions, a candidate router in shadow (`shadow`) and the log
//! of decisions' inputs for offline replay (`decision_log`). OpenAI-compatible
//! engines (vLLM, SGLang) feed the index through their ZMQ KV events
//! (`engine_events`), or, unheard, through predictions from the gateway's own
//! routing (`approx`).

mod approx;
pub mod decision_log;
pub mod engine_events;
mod fleet;
mod kv_index;
mod monitor;
pub mod shadow;

pub use fleet::{
    Approximate, Candidates, Fleet, Origin, PromptKeys, Upstream, Worker, WorkerStatus,
};
pub use kv_index::KvIndex;
pub use monitor::{SseBuffer, spawn as spawn_monitor};
pub use shadow::{Shadow, ShadowStatus};
