//! sluice's inference worker: models (`model`), CPU compute kernels (`compute`),
//! the paged KV cache with prefix reuse (`kv`) and the continuous-batching engine
//! (`engine`). The worker API comes next (`../shared/DESIGN.md`, "Backend").

pub mod compute;
pub mod engine;
pub mod kv;
pub mod model;
pub mod server;
