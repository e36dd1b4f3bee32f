//! A plugin slot: the active version of one plugin kind, swapped atomically
//! (arc-swap) after the new version has been compiled and checked off the request
//! path, and the previous version kept for rollback.
//!
//! Loading checks, in order: the bytes compile as a component; every import is
//! `sluice:policy/*` at a compatible version or a `wasi:*` interface (linked to
//! trap); the component exports this slot's interface at a compatible version;
//! `init(config)` accepts the config; a smoke call gives a valid answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use wasmtime::component::{Component, ComponentExportIndex};

use super::generation::{CallFailure, Generation};
use super::host_state::{DeniedImport, HostState, PluginIdentity, SlotShared};
use super::kind::PluginKind;
use super::runtime::Runtime;
use super::shared::SharedStore;

/// The WIT package the host speaks, and the versions of it it accepts.
pub const PACKAGE: &str = "sluice:policy";
pub const PACKAGE_VERSION: &str = "0.1.1";

/// True for versions semver-compatible with 0.1.1 (0.1.x: 0.1.0 plugins
/// import a subset of what 0.1.1 offers).
fn compatible(version: &str) -> bool {
    let mut parts = version.split('.');
    matches!((parts.next(), parts.next()), (Some("0"), Some("1")))
}

/// Why a plugin was refused; each message names the plugin, its digest and the reason.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("plugin `{plugin}` ({digest}) does not compile as a component: {reason}")]
    Compile {
        plugin: String,
        digest: String,
        reason: String,
    },
    #[error(
        "plugin `{plugin}` ({digest}) imports `{import}`, which is not allowed \
         (only {PACKAGE}/* and wasi:* imports are linked)"
    )]
    DisallowedImport {
        plugin: String,
        digest: String,
        import: String,
    },
    #[error(
        "plugin `{plugin}` ({digest}) was built against `{found}`; this gateway speaks \
         {PACKAGE}@{PACKAGE_VERSION} (compatible: 0.1.x)"
    )]
    IncompatibleVersion {
        plugin: String,
        digest: String,
        found: String,
    },
    #[error(
        "plugin `{plugin}` ({digest}) does not export {PACKAGE}/{interface} for the `{interface}` \
         slot (it exports: {exports})"
    )]
    WrongKind {
        plugin: String,
        digest: String,
        interface: &'static str,
        exports: String,
    },
    #[error("plugin `{plugin}` ({digest}) cannot be linked: {reason}")]
    Link {
        plugin: String,
        digest: String,
        reason: String,
    },
    #[error("plugin `{plugin}` ({digest}) failed init with config {config:?}: {reason}")]
    Init {
        plugin: String,
        digest: String,
        config: String,
        reason: String,
    },
    #[error("plugin `{plugin}` ({digest}) failed its smoke call: {reason}")]
    Smoke {
        plugin: String,
        digest: String,
        reason: String,
    },
    #[error("the `{slot}` slot has no previous version to roll back to")]
    NoPrevious { slot: &'static str },
}

/// Time spent checking and activating one version.
#[derive(Clone, Copy, Debug)]
pub struct LoadTimings {
    /// Compile, import/export checks, linking, init and smoke call, pre-warm.
    pub validate: Duration,
    /// The swap itself.
    pub swap: Duration,
}

/// What an operator sees of a slot.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SlotStatus {
    pub slot: &'static str,
    pub active: Option<PluginIdentity>,
    pub previous: Option<PluginIdentity>,
    pub calls: u64,
    pub deferred: u64,
    /// Fallbacks by error class.
    pub errors: Vec<(&'static str, u64)>,
    pub call_p50_ns: f64,
    pub call_p99_ns: f64,
    pub logs_dropped: u64,
    pub metrics_refused: u64,
    /// Entries the slot's instances share now, and stores refused because
    /// the store was full.
    pub shared_entries: usize,
    pub shared_refused: u64,
    pub counters: Vec<(String, u64)>,
    /// The active and previous versions' own figures.
    pub versions: Vec<VersionStatus>,
}

/// One version's own calls, fallbacks and call times.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VersionStatus {
    pub plugin: String,
    pub version: u64,
    pub active: bool,
    pub calls: u64,
    pub errors: Vec<(&'static str, u64)>,
    pub call_p50_ns: f64,
    pub call_p99_ns: f64,
}

impl VersionStatus {
    fn of<K: PluginKind>(generation: &Generation<K>, active: bool) -> Self {
        let stats = &generation.stats;
        Self {
            plugin: generation.identity.name.clone(),
            version: generation.identity.version,
            active,
            calls: stats.calls.load(Ordering::Relaxed),
            errors: stats.fallbacks_by_class(),
            call_p50_ns: stats.call_ns.quantile(0.5),
            call_p99_ns: stats.call_ns.quantile(0.99),
        }
    }
}

/// The slot of one plugin kind.
pub struct Slot<K: PluginKind> {
    runtime: Arc<Runtime>,
    shared: Arc<SlotShared>,
    current: ArcSwapOption<Generation<K>>,
    previous: Mutex<Option<Arc<Generation<K>>>>,
    next_version: AtomicU64,
    /// Serializes swaps and rollbacks (calls never take it).
    swapping: Mutex<()>,
}

impl<K: PluginKind> std::fmt::Debug for Slot<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("interface", &K::INTERFACE)
            .finish()
    }
}

impl<K: PluginKind> Slot<K> {
    pub fn new(runtime: Arc<Runtime>) -> Self {
        let shared = Arc::new(SlotShared::new(
            runtime.config.log_lines_per_sec,
            runtime.config.max_log_line_bytes,
            runtime.config.max_shared_entries,
        ));
        Self {
            runtime,
            shared,
            current: ArcSwapOption::empty(),
            previous: Mutex::new(None),
            next_version: AtomicU64::new(1),
            swapping: Mutex::new(()),
        }
    }

    pub fn shared(&self) -> &SlotShared {
        &self.shared
    }

    /// Runs `f` on the active version without taking a reference count;
    /// `None` when the slot is empty.
    pub fn with_current<R>(&self, f: impl FnOnce(&Generation<K>) -> R) -> Option<R> {
        self.current.load().as_deref().map(f)
    }

    /// The active version, kept alive for as long as the caller holds it.
    pub fn current(&self) -> Option<Arc<Generation<K>>> {
        self.current.load_full()
    }

    /// Compiles and checks a version without activating it.
    pub fn prepare(
        &self,
        name: &str,
        bytes: &[u8],
        config: &str,
    ) -> Result<Arc<Generation<K>>, LoadError> {
        let digest = digest(bytes);
        let plugin = name.to_string();
        let engine = &self.runtime.engine;
        let component = Component::new(engine, bytes).map_err(|e| LoadError::Compile {
            plugin: plugin.clone(),
            digest: digest.clone(),
            reason: format!("{e:#}"),
        })?;
        let ty = component.component_type();
        for (import, _) in ty.imports(engine) {
            check_import(import).map_err(|bad| match bad {
                ImportProblem::Disallowed => LoadError::DisallowedImport {
                    plugin: plugin.clone(),
                    digest: digest.clone(),
                    import: import.to_string(),
                },
                ImportProblem::Version => LoadError::IncompatibleVersion {
                    plugin: plugin.clone(),
                    digest: digest.clone(),
                    found: import.to_string(),
                },
            })?;
        }
        let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
        let wanted = format!("{PACKAGE}/{}@", K::INTERFACE);
        let export = exports.iter().find(|n| n.starts_with(&wanted));
        let export = match export {
            Some(n) if compatible(&n[wanted.len()..]) => n.clone(),
            Some(n) => {
                return Err(LoadError::IncompatibleVersion {
                    plugin,
                    digest,
                    found: n.clone(),
                });
            }
            None => {
                return Err(LoadError::WrongKind {
                    plugin,
                    digest,
                    interface: K::INTERFACE,
                    exports: if exports.is_empty() {
                        "nothing".into()
                    } else {
                        exports.join(", ")
                    },
                });
            }
        };
        let link_error = |reason: String| LoadError::Link {
            plugin: plugin.clone(),
            digest: digest.clone(),
            reason,
        };
        let interface = component
            .get_export_index(None, &export)
            .ok_or_else(|| link_error(format!("no export index for `{export}`")))?;
        let indexes: Vec<ComponentExportIndex> = K::FUNCTIONS
            .iter()
            .map(|f| {
                component
                    .get_export_index(Some(&interface), f)
                    .ok_or_else(|| link_error(format!("`{export}` has no function `{f}`")))
            })
            .collect::<Result<_, _>>()?;

        // The wasi:* imports that std pulls in are linked to a denial; the
        // sluice:policy imports resolve (by semver) to the host's 0.1.1.
        let mut linker = self.runtime.linker.clone();
        deny_wasi_imports(&mut linker, &component, engine)
            .map_err(|e| link_error(format!("{e:#}")))?;
        let instance_pre = linker
            .instantiate_pre(&component)
            .map_err(|e| link_error(format!("{e:#}")))?;

        let identity = PluginIdentity {
            name: plugin.clone(),
            version: 0, // numbered once the checks pass
            digest: digest.clone(),
        };
        let mut generation = Generation::<K>::new(
            identity,
            config.to_string(),
            self.runtime.clone(),
            self.shared.clone(),
            instance_pre,
            indexes,
        );
        let init_error = |f: CallFailure| LoadError::Init {
            plugin: plugin.clone(),
            digest: digest.clone(),
            config: config.to_string(),
            reason: failure_text(f),
        };
        let mut probe = generation.instantiate().map_err(init_error)?;
        probe
            .arm(self.runtime.config.init_fuel)
            .map_err(|e| init_error(CallFailure::Wasm(e)))?;
        // The made-up request must not leave shared entries for real ones.
        probe.store.data_mut().scratch = Some(Box::new(SharedStore::new(1024)));
        K::smoke(&mut probe).map_err(|f| LoadError::Smoke {
            plugin: plugin.clone(),
            digest: digest.clone(),
            reason: failure_text(f),
        })?;
        drop(probe); // its state saw made-up inputs
        // Numbered once it passed; then the first instance for calls is made.
        generation.set_version(self.next_version.fetch_add(1, Ordering::Relaxed));
        generation.prewarm().map_err(init_error)?;
        Ok(Arc::new(generation))
    }

    /// Makes `generation` (from [`Slot::prepare`]) the active version; the one it
    /// replaces is kept for rollback. Returns the identity it was given.
    pub fn activate(&self, generation: Arc<Generation<K>>) -> PluginIdentity {
        let _guard = self.swapping.lock().unwrap_or_else(|e| e.into_inner());
        let identity = (*generation.identity).clone();
        // It may have been active before (a kept `prepare`d version).
        generation.reinstate();
        let old = self.current.swap(Some(generation.clone()));
        let mut previous = self.previous.lock().unwrap_or_else(|e| e.into_inner());
        match old {
            // Activating the active version changes nothing.
            Some(old) if Arc::ptr_eq(&old, &generation) => {}
            old => {
                if let Some(old) = &old {
                    old.retire();
                }
                *previous = old;
            }
        }
        tracing::info!(slot = K::INTERFACE, plugin = %identity.name, version = identity.version, digest = %identity.digest, "plugin activated");
        identity
    }

    /// Prepares and activates; the usual way to load a version.
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        config: &str,
    ) -> Result<(PluginIdentity, LoadTimings), LoadError> {
        let started = Instant::now();
        let generation = self.prepare(name, bytes, config)?;
        let validate = started.elapsed();
        let started = Instant::now();
        let identity = self.activate(generation);
        Ok((
            identity,
            LoadTimings {
                validate,
                swap: started.elapsed(),
            },
        ))
    }

    /// Swaps the previous version back in; the version it replaces becomes the
    /// previous one (so a second rollback undoes the first).
    pub fn rollback(&self) -> Result<PluginIdentity, LoadError> {
        let _guard = self.swapping.lock().unwrap_or_else(|e| e.into_inner());
        let mut previous = self.previous.lock().unwrap_or_else(|e| e.into_inner());
        let back = previous
            .take()
            .ok_or(LoadError::NoPrevious { slot: K::INTERFACE })?;
        back.reinstate();
        let identity = (*back.identity).clone();
        let replaced = self.current.swap(Some(back));
        if let Some(r) = &replaced {
            r.retire();
        }
        *previous = replaced;
        tracing::info!(slot = K::INTERFACE, plugin = %identity.name, version = identity.version, "plugin rolled back");
        Ok(identity)
    }

    /// Empties the slot: the active version is retired and kept as the
    /// previous one (so a rollback brings it back). Returns what was active.
    pub fn clear(&self) -> Option<PluginIdentity> {
        let _guard = self.swapping.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.current.swap(None)?;
        old.retire();
        let identity = (*old.identity).clone();
        *self.previous.lock().unwrap_or_else(|e| e.into_inner()) = Some(old);
        tracing::info!(slot = K::INTERFACE, plugin = %identity.name, version = identity.version, "plugin unloaded");
        Some(identity)
    }

    pub fn status(&self) -> SlotStatus {
        let stats = &self.shared.stats;
        let previous = self.previous.lock().unwrap_or_else(|e| e.into_inner());
        SlotStatus {
            slot: K::INTERFACE,
            active: self.with_current(|g| (*g.identity).clone()),
            previous: previous.as_ref().map(|g| (*g.identity).clone()),
            calls: stats.calls.load(Ordering::Relaxed),
            deferred: stats.deferred.load(Ordering::Relaxed),
            errors: stats.fallbacks_by_class(),
            call_p50_ns: stats.call_ns.quantile(0.5),
            call_p99_ns: stats.call_ns.quantile(0.99),
            logs_dropped: stats.logs_dropped.load(Ordering::Relaxed),
            metrics_refused: self.shared.metrics.refused.load(Ordering::Relaxed),
            shared_entries: self.shared.store.len(),
            shared_refused: self.shared.store.refused.load(Ordering::Relaxed),
            counters: self.shared.metrics.counters(),
            versions: self
                .current()
                .map(|g| VersionStatus::of(&g, true))
                .into_iter()
                .chain(previous.as_ref().map(|g| VersionStatus::of(g, false)))
                .collect(),
        }
    }
}

/// Links every function of every `wasi:*` import to a [`DeniedImport`] error
/// (and its resources to placeholders), so that a Rust guest whose std imports
/// WASI instantiates, and any real use of WASI fails the call.
fn deny_wasi_imports(
    linker: &mut wasmtime::component::Linker<HostState>,
    component: &Component,
    engine: &wasmtime::Engine,
) -> wasmtime::Result<()> {
    use wasmtime::component::ResourceType;
    use wasmtime::component::types::ComponentItem;
    for (name, item) in component.component_type().imports(engine) {
        if !name.starts_with("wasi:") {
            continue;
        }
        let ComponentItem::ComponentInstance(instance) = item.ty else {
            continue;
        };
        let mut stubs = linker.instance(name)?;
        for (item_name, item) in instance.exports(engine) {
            match item.ty {
                ComponentItem::ComponentFunc(_) => {
                    let full = format!("{name}#{item_name}");
                    stubs.func_new(item_name, move |_, _, _, _| {
                        Err(wasmtime::Error::new(DeniedImport(full.clone())))
                    })?;
                }
                ComponentItem::Resource(_) => {
                    stubs.resource(item_name, ResourceType::host::<()>(), |_, _| Ok(()))?;
                }
                _ => {}
            }
        }
    }
    Ok(())
}

enum ImportProblem {
    Disallowed,
    Version,
}

/// `sluice:policy/host` and `sluice:policy/types` at 0.1.x are linked for real;
/// `wasi:*` is linked to trap; anything else is refused.
fn check_import(name: &str) -> Result<(), ImportProblem> {
    if name.starts_with("wasi:") {
        return Ok(());
    }
    let Some(rest) = name.strip_prefix(PACKAGE).and_then(|r| r.strip_prefix('/')) else {
        return Err(ImportProblem::Disallowed);
    };
    let (interface, version) = rest.split_once('@').unwrap_or((rest, ""));
    if !matches!(interface, "host" | "types") {
        return Err(ImportProblem::Disallowed);
    }
    if compatible(version) {
        Ok(())
    } else {
        Err(ImportProblem::Version)
    }
}

fn failure_text(f: CallFailure) -> String {
    match f {
        CallFailure::Wasm(e) => format!("{e:#}"),
        CallFailure::Invalid(why) => why,
    }
}

/// The first 16 hex digits of the SHA-256 of `bytes`.
fn digest(bytes: &[u8]) -> String {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(bytes);
    hash[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_sluice_host_and_types_at_0_1_and_wasi() {
        assert!(check_import("sluice:policy/host@0.1.0").is_ok());
        assert!(check_import("sluice:policy/types@0.1.7").is_ok());
        assert!(check_import("wasi:cli/environment@0.2.6").is_ok());
        assert!(matches!(
            check_import("sluice:policy/host@0.2.0"),
            Err(ImportProblem::Version)
        ));
        assert!(matches!(
            check_import("sluice:policy/host@1.1.0"),
            Err(ImportProblem::Version)
        ));
        assert!(matches!(
            check_import("sluice:policy/secrets@0.1.0"),
            Err(ImportProblem::Disallowed)
        ));
        assert!(matches!(
            check_import("acme:net/socket"),
            Err(ImportProblem::Disallowed)
        ));
        assert!(matches!(
            check_import("sluice:policyx/host@0.1.0"),
            Err(ImportProblem::Disallowed)
        ));
    }

    #[test]
    fn digest_is_sha256_prefix() {
        // SHA-256("abc") = ba7816bf8f01cfea...
        assert_eq!(digest(b"abc"), "ba7816bf8f01cfea");
    }
}
