//! The plugins folder: `router.wasm`, `admission.wasm`, `cache-policy.wasm`,
//! each with an optional `<slot>.conf` (the plugin's `key=value` config).
//! Loaded at start (a bad file stops the start), then polled every second: a
//! changed file is validated and swapped in, and a bad one is refused with a
//! log line while the running version stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{SlotName, load_into};
use crate::gateway::{Gateway, Policies, StartError};

/// What identifies a version of a slot's files on disk.
type Stamp = Option<(SystemTime, u64, Option<(SystemTime, u64)>)>;

fn files(dir: &Path, slot: SlotName) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{}.wasm", slot.as_str())),
        dir.join(format!("{}.conf", slot.as_str())),
    )
}

fn stamp_of(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

fn stamp(dir: &Path, slot: SlotName) -> Stamp {
    let (wasm, conf) = files(dir, slot);
    let (modified, len) = stamp_of(&wasm)?;
    Some((modified, len, stamp_of(&conf)))
}

/// Reads and loads one slot's files; `Ok(None)` when the slot has no file.
fn load_slot(
    policies: &Policies,
    dir: &Path,
    slot: SlotName,
) -> Result<Option<String>, StartError> {
    let (wasm, conf) = files(dir, slot);
    if !wasm.exists() {
        return Ok(None);
    }
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| StartError::Read {
            path: path.display().to_string(),
            source,
        })
    };
    let bytes = read(&wasm)?;
    let config = if conf.exists() {
        String::from_utf8_lossy(&read(&conf)?).trim().to_string()
    } else {
        String::new()
    };
    let name = format!("{}.wasm", slot.as_str());
    let (identity, timings) =
        load_into(policies, slot, &name, &bytes, &config).map_err(|source| StartError::Plugin {
            path: wasm.display().to_string(),
            source,
        })?;
    Ok(Some(format!(
        "{} v{} ({}) in {:.0} ms",
        identity.name,
        identity.version,
        identity.digest,
        timings.validate.as_secs_f64() * 1e3
    )))
}

/// Loads every slot file in `dir`.
pub fn load_plugins_dir(policies: &Policies, dir: &Path) -> Result<(), StartError> {
    if !dir.is_dir() {
        return Err(StartError::Read {
            path: dir.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a folder"),
        });
    }
    for slot in SlotName::ALL {
        if let Some(loaded) = load_slot(policies, dir, slot)? {
            tracing::info!(slot = slot.as_str(), %loaded, "plugin loaded");
        }
    }
    Ok(())
}

/// Polls `dir` every second and reloads a slot whose files changed.
pub fn watch_plugins_dir(gateway: Arc<Gateway>, dir: PathBuf) {
    tokio::spawn(async move {
        let mut stamps: Vec<Stamp> = SlotName::ALL.iter().map(|&s| stamp(&dir, s)).collect();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            for (i, slot) in SlotName::ALL.into_iter().enumerate() {
                let now = stamp(&dir, slot);
                if now == stamps[i] {
                    continue;
                }
                stamps[i] = now;
                if now.is_none() {
                    tracing::info!(
                        slot = slot.as_str(),
                        "plugin file removed; the running version stays"
                    );
                    continue;
                }
                let (g, d) = (gateway.clone(), dir.clone());
                let loaded =
                    tokio::task::spawn_blocking(move || load_slot(&g.policies, &d, slot)).await;
                match loaded {
                    Ok(Ok(Some(loaded))) => {
                        tracing::info!(slot = slot.as_str(), %loaded, "plugin reloaded")
                    }
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => {
                        tracing::error!(slot = slot.as_str(), error = %crate::error_chain(&e), "plugin file refused; the running version stays")
                    }
                    Err(e) => {
                        tracing::error!(slot = slot.as_str(), error = %e, "plugin reload failed")
                    }
                }
            }
        }
    });
}
