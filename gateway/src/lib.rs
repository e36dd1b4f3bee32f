//! sluice's gateway: the policy contract (`policy`) and the Wasm plugin host that
//! runs operators' routing, admission and cache policies (`plugins`), with the
//! benchmarks behind `sluice bench`.

pub mod bench;
pub mod plugins;
pub mod policy;
