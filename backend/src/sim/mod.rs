//! The simulated engine: the real scheduler (continuous batching, chunked
//! prefill, paged KV with prefix cache, eviction and KV events) over an
//! executor that sleeps for the time a timing model gives (`profile`) instead
//! of running a model (`executor`), behind the worker's own HTTP API. Many
//! simulated workers run in one process, each on its own port (`SimFleet`),
//! for fleet-scale routing experiments; `calibrate` fits a profile to the real
//! CPU worker. Everything it serves says it is simulated. A fleet can be
//! disaggregated (`prefill_workers`): KV moves over the real TCP transport
//! with a delay for its modelled bytes (`transfer`).

pub mod calibrate;
mod executor;
pub mod profile;
mod transfer;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::task::JoinHandle;

pub use executor::{SimExecutor, next_word, word_tokens};
pub use profile::{Profile, StepShape};
pub use transfer::SimTransport;

use crate::engine::{Engine, EngineConfig};
use crate::model::Tokenizer;
use crate::server::WorkerState;

/// What a simulated fleet looks like.
#[derive(Clone, Debug)]
pub struct SimOptions {
    pub profile: Profile,
    pub workers: usize,
    /// Real seconds per modelled second: 10 runs everything ten times slower
    /// than the profile says, so a small machine can drive a fast fleet.
    pub time_scale: f64,
    pub host: IpAddr,
    /// The first worker's port (the others follow); 0 = any free ports.
    pub base_port: u16,
    /// The name in `/v1/models`.
    pub model_name: String,
    /// Disaggregation: the first this many workers only prefill and the
    /// rest only decode; 0 = every worker does both.
    pub prefill_workers: usize,
}

impl SimOptions {
    pub fn new(profile: Profile, workers: usize) -> Self {
        Self {
            profile,
            workers,
            time_scale: 1.0,
            host: IpAddr::from([127, 0, 0, 1]),
            base_port: 0,
            model_name: "sim".into(),
            prefill_workers: 0,
        }
    }
}

/// Simulated workers serving in this process until stopped or dropped.
#[derive(Debug)]
pub struct SimFleet {
    /// Each worker's base URL.
    pub urls: Vec<String>,
    pub states: Vec<Arc<WorkerState>>,
    servers: Vec<JoinHandle<()>>,
}

impl SimFleet {
    /// Binds every worker's port and starts serving (on the current tokio
    /// runtime); each worker has its own engine thread.
    pub async fn start(
        tokenizer: Arc<Tokenizer>,
        options: &SimOptions,
    ) -> std::io::Result<SimFleet> {
        let words: Arc<[u32]> = word_tokens(&tokenizer).into();
        Self::start_with_words(tokenizer, words, options).await
    }

    /// [`SimFleet::start`] with the tokenizer's [`word_tokens`] already
    /// worked out (a caller starting many fleets works them out once).
    pub async fn start_with_words(
        tokenizer: Arc<Tokenizer>,
        words: Arc<[u32]>,
        options: &SimOptions,
    ) -> std::io::Result<SimFleet> {
        if !(options.time_scale > 0.0 && options.time_scale.is_finite()) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the time scale must be a positive number",
            ));
        }
        if words.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the tokenizer has no plain word tokens for the simulator to answer with",
            ));
        }
        let p = &options.profile;
        if options.prefill_workers > 0 && options.prefill_workers >= options.workers {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a disaggregated fleet needs at least one decode worker",
            ));
        }
        let transport = std::sync::Arc::new(SimTransport {
            inner: crate::transfer::tcp::TcpTransport::default(),
            block_bytes: p.kv_bytes_per_token * p.block_size as f64,
            link_bytes_s: p.kv_link_bytes_s,
            time_scale: options.time_scale,
        });
        let mut fleet = SimFleet {
            urls: Vec::new(),
            states: Vec::new(),
            servers: Vec::new(),
        };
        for i in 0..options.workers {
            let port = match options.base_port {
                0 => 0,
                base => base.checked_add(i as u16).ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, "ports run past 65535")
                })?,
            };
            let listener =
                tokio::net::TcpListener::bind(SocketAddr::new(options.host, port)).await?;
            let addr = listener.local_addr()?;
            let executor = SimExecutor::new(
                p.clone(),
                options.time_scale,
                words.clone(),
                tokenizer.vocab_size(),
            );
            let engine = Engine::start_with(
                Box::new(executor),
                tokenizer.clone(),
                EngineConfig {
                    block_size: p.block_size,
                    kv_blocks: p.kv_blocks,
                    step_tokens: p.step_tokens,
                    max_running: p.max_running,
                    ..EngineConfig::default()
                },
            );
            let role = match (options.prefill_workers, i < options.prefill_workers) {
                (0, _) => crate::transfer::Role::Both,
                (_, true) => crate::transfer::Role::Prefill,
                (_, false) => crate::transfer::Role::Decode,
            };
            let mut state = WorkerState::new(Arc::new(engine), options.model_name.clone())
                .simulated(&p.name)
                .with_role(role, SocketAddr::new(options.host, 0), None)
                .await?;
            state.transport = transport.clone();
            let state = Arc::new(state);
            fleet.urls.push(format!("http://{addr}"));
            fleet.states.push(state.clone());
            fleet.servers.push(tokio::spawn(async move {
                if let Err(e) = crate::server::serve(listener, state).await {
                    tracing::error!(error = %e, %addr, "simulated worker stopped");
                }
            }));
        }
        tracing::info!(
            workers = options.workers,
            profile = %p.name,
            time_scale = options.time_scale,
            first = %fleet.urls.first().map_or("", String::as_str),
            "SIMULATED fleet started: no model runs; step times come from the profile"
        );
        Ok(fleet)
    }

    /// Stops serving; each engine thread ends when its last handle is gone.
    pub fn stop(&mut self) {
        for server in self.servers.drain(..) {
            server.abort();
        }
        self.states.clear();
    }
}

impl Drop for SimFleet {
    fn drop(&mut self) {
        self.stop();
    }
}
