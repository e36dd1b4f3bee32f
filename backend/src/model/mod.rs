//! Models: the GGUF reader, the Llama-family config and forward pass, and the
//! linear layers' precision (`precision`).

mod byte_level;
mod chatml;
mod config;
mod generations;
pub mod gguf;
mod hf;
mod llama;
mod precision;
mod segments;
mod tokenizer;

pub use config::LlamaConfig;
pub use gguf::{Gguf, GgufError};
pub use llama::{Llama, Logits, Naming, SeqChunk, TensorSource};
pub use precision::WeightFormat;
pub use tokenizer::{ChatMessage, Tokenizer, TokenizerError};

use std::path::Path;

/// Where `make model` puts SmolLM2-135M-Instruct, from the repository root.
pub const FETCHED_MODEL: &str = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$SLUICE_MODEL`, else the fetched SmolLM2 under `repo_root` (for tests and
/// tools that run inside the repository).
pub fn fetched_model(repo_root: &Path) -> std::path::PathBuf {
    std::env::var_os("SLUICE_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| repo_root.join(FETCHED_MODEL))
}

/// A model ready to serve: weights, tokenizer, and the name clients use.
#[derive(Debug)]
pub struct LoadedModel {
    pub llama: Llama,
    pub tokenizer: Tokenizer,
    pub name: String,
}

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{0}")]
    HuggingFace(String),
}

/// Loads a model: a GGUF file, or a Hugging Face folder (config.json,
/// safetensors, tokenizer.json). The name is the file's stem without a
/// quantization suffix (`SmolLM2-135M-Instruct.Q4_1.gguf` ->
/// `SmolLM2-135M-Instruct`), or the folder's name.
pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
    if path.is_dir() {
        let llama = hf::load_llama(path).map_err(LoadError::HuggingFace)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        let name = path
            .file_name()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        return Ok(LoadedModel {
            llama,
            tokenizer,
            name,
        });
    }
    let gguf = Gguf::open(path)?;
    Ok(LoadedModel {
        llama: Llama::from_gguf(&gguf)?,
        tokenizer: Tokenizer::from_gguf(&gguf)?,
        name: gguf_model_name(path),
    })
}

/// What a front door needs of a model, without its weights.
#[derive(Debug)]
pub struct ModelInfo {
    pub config: LlamaConfig,
    pub tokenizer: Tokenizer,
    pub name: String,
}

/// Reads a model's config, tokenizer and name (as [`load`] names it); a GGUF
/// file's weights are not read.
pub fn describe(path: &Path) -> Result<ModelInfo, LoadError> {
    if path.is_dir() {
        let loaded = load(path)?;
        return Ok(ModelInfo {
            config: loaded.llama.config.clone(),
            tokenizer: loaded.tokenizer,
            name: loaded.name,
        });
    }
    let gguf = Gguf::open(path)?;
    Ok(ModelInfo {
        config: LlamaConfig::from_gguf(&gguf)?,
        tokenizer: Tokenizer::from_gguf(&gguf)?,
        name: gguf_model_name(path),
    })
}

/// A tokenizer alone: a GGUF file's, a Hugging Face folder's, or a
/// `tokenizer.json` file's (with the `tokenizer_config.json` beside it).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
    if path.is_dir() {
        return Ok(Tokenizer::from_hf_dir(path)?);
    }
    if path.extension().is_some_and(|e| e == "json") {
        let dir = path.parent().unwrap_or(Path::new("."));
        return Ok(Tokenizer::from_hf_dir(dir)?);
    }
    Ok(Tokenizer::from_gguf(&Gguf::open(path)?)?)
}

/// A GGUF file's stem without a quantization suffix.
fn gguf_model_name(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    match stem.rsplit_once('.') {
        Some((base, quant)) if quant.starts_with(['Q', 'q', 'F', 'f', 'B', 'b']) => {
            base.to_string()
        }
        _ => stem,
    }
}
