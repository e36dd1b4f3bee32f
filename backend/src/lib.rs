//! sluice's inference worker: models (`model`), CPU compute kernels (`compute`)
//! and the paged KV cache (`kv`). The scheduler and the worker API come next
//! (`../shared/DESIGN.md`, "Backend").

pub mod compute;
pub mod kv;
pub mod model;
