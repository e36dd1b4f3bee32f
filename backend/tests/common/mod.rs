//! Shared by the worker's integration tests: where the real model is.

use std::path::{Path, PathBuf};

/// `$SLUICE_MODEL`, else the SmolLM2 GGUF that `make model` fetches.
pub fn model_path() -> PathBuf {
    sluice_backend::model::fetched_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}
