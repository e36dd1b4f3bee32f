//! Where requests can go: the fleet of workers with their health and load
//! (`fleet`), the KV index of which worker caches which prompt block
//! (`kv_index`), and the per-worker monitors that keep both true (`monitor`).

mod fleet;
mod kv_index;
mod monitor;

pub use fleet::{Candidates, Fleet, Origin, Worker, WorkerStatus};
pub use kv_index::KvIndex;
pub use monitor::{SseBuffer, spawn as spawn_monitor};
