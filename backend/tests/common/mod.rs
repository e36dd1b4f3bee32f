//! Shared by the worker's integration tests: where the real model is.

use std::path::PathBuf;

/// `$SLUICE_MODEL`, else the SmolLM2 GGUF that `make model` fetches.
pub fn model_path() -> PathBuf {
    std::env::var_os("SLUICE_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        })
}
