//! The SDK for sluice policy plugins: implement one trait, call one export macro,
//! build with `cargo build --release --target wasm32-wasip2`.
//!
//! ```ignore
//! use sluice_plugin_sdk::{export_router, FleetView, RequestView, RouteDecision, Router};
//!
//! #[derive(Default)]
//! struct FirstHealthy;
//!
//! impl Router for FirstHealthy {
//!     fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
//!         fleet.eligible(request.hop).next().map_or(RouteDecision::UseDefault, RouteDecision::Worker)
//!     }
//! }
//!
//! export_router!(FirstHealthy);
//! ```
//!
//! The same policy runs natively under [`testing`], so it can be unit-tested with
//! `cargo test` and no Wasm runtime. `plugins/README.md` is the five-minute guide;
//! `wit/README.md` says when each call runs and what each answer means.
//!
//! A plugin has no WASI: std's `HashMap::new()` asks for random seeds and traps.
//! Use [`collections::HashMap`] (fixed hasher) or a `BTreeMap`.
//!
//! The host runs several instances of a plugin side by side: state that every
//! call must see alike (a session's worker, a tenant's budget) goes in the
//! slot's [`shared`] entries, not in the policy's fields.

mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        inline: "package sluice:sdk; world imports { import sluice:policy/host@0.1.1; import sluice:policy/types@0.1.1; }",
        world: "sluice:sdk/imports",
        generate_all,
        additional_derives: [PartialEq, Clone],
    });
}

mod config;
mod fleet;
mod host;
pub mod kv;
mod policy;
pub mod testing;

/// The WIT contract's shared types (`sluice:policy/types`), as Rust types.
pub mod types {
    pub use crate::bindings::sluice::policy::types::*;
}

/// Maps that work without WASI.
pub mod collections {
    use std::collections::hash_map::DefaultHasher;
    use std::hash::BuildHasherDefault;

    /// std's `HashMap` with a fixed-key hasher: `HashMap::default()` needs no random
    /// seed (a plugin has none; std's `HashMap::new()` traps asking for one).
    pub type HashMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<DefaultHasher>>;
}

pub use config::{Config, ConfigError};
pub use fleet::{Worker, WorkerState};
pub use host::{Level, counter_add, histogram_record, log, now_ns, shared};
pub use policy::{Admission, CachePolicy, Router};
pub use sluice_plugin_sdk_macros::{export_admission, export_cache_policy, export_router};
pub use types::{
    AdmitDecision, CacheHints, Completion, EvictionCandidates, FleetSaturation, FleetView, Hop,
    Outcome, Rejection, RequestView, RouteDecision,
};

/// Glue for the export macros; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use crate::bindings::sluice::policy::host;
    pub use crate::policy::{init, with_policy};
    pub use wit_bindgen;
}
