//! The wasmtime host for policy plugins: nothing else in the gateway imports
//! wasmtime. One [`Runtime`] (engine with fuel metering, host imports) serves every
//! [`Slot`]; a slot holds the active version of one plugin kind and swaps in new
//! ones without dropping a call. [`WasmRouter`], [`WasmAdmission`] and
//! [`WasmCachePolicy`] put slots behind the plain traits of `crate::policy`.

mod abi;
mod generation;
mod host_state;
mod kind;
mod runtime;
mod shared;
mod slot;
mod stats;

pub use generation::Generation;
pub use host_state::PluginIdentity;
pub use kind::{Admission, Cache, PluginKind, Router, WasmAdmission, WasmCachePolicy, WasmRouter};
pub use runtime::{HostConfig, Runtime};
pub use slot::{LoadError, LoadTimings, PACKAGE, PACKAGE_VERSION, Slot, SlotStatus, VersionStatus};
pub use stats::{ErrorClass, LogHistogram};
