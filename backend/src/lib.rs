//! sluice's inference worker: model loading, the paged KV cache, the scheduler
//! and the worker API (`../shared/DESIGN.md`, "Backend"). Empty until the worker
//! lands; the crate exists so the workspace has its fixed layout.
