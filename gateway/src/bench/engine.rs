//! `sluice bench engine`: decode speed of sluice's CPU engine on a real model,
//! at batch 1 and batch 8 (aggregate), and, with `--vs-llamacpp`, llama.cpp's
//! batch-1 decode on the same GGUF with the same thread count, in the same run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use sluice_backend::engine::{Engine, EngineConfig, GenerateEvent, GenerateRequest};

/// What `sluice bench engine` measures.
#[derive(Clone, Debug)]
pub struct EngineBenchOptions {
    pub model: PathBuf,
    /// Tokens generated per request.
    pub new_tokens: u32,
    /// Also run llama.cpp (through the llama-cpp-python package).
    pub vs_llamacpp: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineBenchError {
    #[error("cannot load {path}")]
    Model {
        path: String,
        source: sluice_backend::model::LoadError,
    },
    #[error("the engine failed: {0}")]
    Engine(String),
}

/// The prompt every request starts from (a different suffix per request).
const PROMPT: &str = "Once upon a time, in a small village by the sea, there lived";

/// Runs `batch` requests at once; returns (aggregate decode tokens/s, tokens).
fn decode_rate(
    engine: &Engine,
    batch: usize,
    new_tokens: u32,
) -> Result<(f64, u64), EngineBenchError> {
    let receivers: Vec<_> = (0..batch)
        .map(|i| {
            let text = format!("{PROMPT} {i}");
            let prompt = engine.tokenizer.encode(&text).unwrap_or_default();
            let mut r = GenerateRequest::new(prompt, new_tokens);
            r.sampling.temperature = 0.0;
            r.ignore_eos = true;
            engine.submit(r).1
        })
        .collect();
    // Decode time: from the moment every request has its first token to the
    // last token of all; tokens counted after each request's first.
    let mut first_tokens = 0usize;
    let mut decode_start = None;
    let mut tokens_after_first = 0u64;
    let mut receivers: Vec<_> = receivers.into_iter().map(Some).collect();
    let mut seen_first = vec![false; batch];
    let mut done = 0;
    while done < batch {
        for (i, slot) in receivers.iter_mut().enumerate() {
            let Some(rx) = slot else { continue };
            match rx.try_recv() {
                Ok(GenerateEvent::Token(_)) => {
                    if seen_first[i] {
                        if decode_start.is_some() {
                            tokens_after_first += 1;
                        }
                    } else {
                        seen_first[i] = true;
                        first_tokens += 1;
                        if first_tokens == batch {
                            decode_start = Some(Instant::now());
                        }
                    }
                }
                Ok(GenerateEvent::Finished { .. }) => {
                    *slot = None;
                    done += 1;
                }
                Ok(GenerateEvent::Error { message, .. }) => {
                    return Err(EngineBenchError::Engine(message));
                }
                Ok(GenerateEvent::Started { .. } | GenerateEvent::AwaitingKv { .. }) => {}
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {}
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    return Err(EngineBenchError::Engine("the engine stopped".into()));
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    let secs = decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    Ok((
        tokens_after_first as f64 / secs.max(1e-9),
        tokens_after_first,
    ))
}

/// llama.cpp's batch-1 decode rate through llama-cpp-python, or why not.
fn llamacpp_rate(model: &std::path::Path, new_tokens: u32, threads: usize) -> Result<f64, String> {
    let script = format!(
        r#"
import json, time
from llama_cpp import Llama
llm = Llama(model_path={model:?}, n_threads={threads}, n_threads_batch={threads}, n_ctx=512, verbose=False, seed=0)
prompt = {PROMPT:?}
llm(prompt, max_tokens=1, temperature=0)
t = time.perf_counter(); a = llm(prompt, max_tokens=1, temperature=0); t1 = time.perf_counter() - t
t = time.perf_counter(); b = llm(prompt, max_tokens={new_tokens}, temperature=0, stop=[]); tn = time.perf_counter() - t
n = b["usage"]["completion_tokens"]
print(json.dumps({{"tokens": n, "decode_tok_s": (n - 1) / max(tn - t1, 1e-9)}}))
"#,
        model = model.display().to_string(),
    );
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "llama-cpp-python failed: {}",
            err.lines().last().unwrap_or("")
        ));
    }
    let line: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("bad output: {e}"))?;
    line["decode_tok_s"]
        .as_f64()
        .ok_or_else(|| "no rate".into())
}

/// Runs the benchmark, printing JSON lines through `emit`; returns the summary.
pub fn run_engine_bench(
    options: &EngineBenchOptions,
    mut emit: impl FnMut(&Value),
) -> Result<Value, EngineBenchError> {
    let loaded =
        sluice_backend::model::load(&options.model).map_err(|source| EngineBenchError::Model {
            path: options.model.display().to_string(),
            source,
        })?;
    let threads = rayon::current_num_threads();
    let engine = Engine::start(
        Arc::new(loaded.llama),
        Arc::new(loaded.tokenizer),
        EngineConfig::default(),
    );
    // Warm up (page in the weights, start the threads).
    decode_rate(&engine, 1, 4)?;
    let mut summary = serde_json::Map::new();
    for batch in [1usize, 8] {
        let (rate, tokens) = decode_rate(&engine, batch, options.new_tokens)?;
        emit(
            &json!({"bench": "decode", "engine": "sluice", "batch": batch, "threads": threads,
                     "tokens": tokens, "decode_tok_s": rate}),
        );
        summary.insert(format!("decode_tok_s_b{batch}"), json!(rate));
    }
    if options.vs_llamacpp {
        match llamacpp_rate(&options.model, options.new_tokens, threads) {
            Ok(rate) => {
                emit(
                    &json!({"bench": "decode", "engine": "llama.cpp", "batch": 1, "threads": threads, "decode_tok_s": rate}),
                );
                summary.insert("llamacpp_decode_tok_s_b1".into(), json!(rate));
                let ours = summary["decode_tok_s_b1"].as_f64().unwrap_or(0.0);
                summary.insert("vs_llamacpp_b1".into(), json!(ours / rate));
            }
            Err(why) => emit(&json!({"bench": "decode", "engine": "llama.cpp", "skipped": why})),
        }
    }
    summary.insert("model".into(), json!(options.model.display().to_string()));
    summary.insert("threads".into(), json!(threads));
    summary.insert("summary".into(), json!(true));
    Ok(Value::Object(summary))
}
