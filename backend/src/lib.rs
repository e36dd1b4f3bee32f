//! sluice's inference worker: models (`model`), CPU compute kernels (`compute`),
//! the paged KV cache with prefix reuse (`kv`) and the continuous-batching engine
//! (`engine`), and the worker's HTTP API with the OpenAI layer the gateway
//! shares (`server`), KV movement between prefill and decode workers
//! (`transfer`), and a simulated engine behind the same API for fleet-scale
//! routing experiments (`sim`).

pub mod compute;
pub mod engine;
pub mod kv;
pub mod model;
pub mod server;
pub mod sim;
pub mod transfer;
