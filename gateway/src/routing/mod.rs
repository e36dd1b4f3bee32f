//! Where requests can go: the fleet of workers with their health and load
//! (`fleet`), the KV index of which worker caches which prompt block
//! (`kv_index`), and the per-worker monitors that keep both true (`monitor`);
//! beside the decisions, a candidate router in shadow (`shadow`) and the log
//! of decisions' inputs for offline replay (`decision_log`).

pub mod decision_log;
mod fleet;
mod kv_index;
mod monitor;
pub mod shadow;

pub use fleet::{Candidates, Fleet, Origin, Worker, WorkerStatus};
pub use kv_index::KvIndex;
pub use monitor::{SseBuffer, spawn as spawn_monitor};
pub use shadow::{Shadow, ShadowStatus};
