//! The assembled gateway: the state every stage shares, built from a
//! [`Config`] ([`Gateway::start`]), and the HTTP server in front of it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluice_backend::server::Frontend;

use crate::admission::AdmissionQueue;
use crate::config::{Config, WorkerKind, WorkerSpec};
use crate::plugins::{self, HostConfig, Runtime, Slot, WasmAdmission, WasmCachePolicy, WasmRouter};
use crate::routing::decision_log::DecisionLog;
use crate::routing::{Fleet, Origin, Shadow, Upstream, engine_events};
use crate::telemetry::Metrics;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "no model: set `model` in the config (or pass --model); only a gateway whose workers are all kind = \"openai\" runs without one"
    )]
    NoModel,
    #[error("cannot load the tokenizer {path}")]
    Tokenizer {
        path: String,
        source: sluice_backend::model::LoadError,
    },
    #[error("worker {url}: {message}")]
    Configured { url: String, message: String },
    #[error("cannot load the model {path}")]
    Model {
        path: String,
        source: sluice_backend::model::LoadError,
    },
    #[error("cannot start the plugin runtime: {0}")]
    Runtime(String),
    #[error("cannot load plugin {path}")]
    Plugin {
        path: String,
        source: plugins::LoadError,
    },
    #[error("cannot read {path}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start embedded worker {index}")]
    Worker { index: u32, source: std::io::Error },
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// The three plugin slots, each behind its policy trait with a built-in fallback.
#[derive(Debug)]
pub struct Policies {
    pub runtime: Arc<Runtime>,
    pub router: WasmRouter,
    pub admission: WasmAdmission,
    pub cache: WasmCachePolicy,
    /// A candidate router asked beside the active one, never acted on.
    pub shadow: Shadow,
}

impl Policies {
    pub fn new(host: HostConfig) -> Result<Self, StartError> {
        let runtime =
            Arc::new(Runtime::new(host).map_err(|e| StartError::Runtime(format!("{e:#}")))?);
        Ok(Self {
            router: WasmRouter::new(Arc::new(Slot::new(runtime.clone()))),
            admission: WasmAdmission::new(Arc::new(Slot::new(runtime.clone()))),
            cache: WasmCachePolicy::new(Arc::new(Slot::new(runtime.clone()))),
            shadow: Shadow::new(runtime.clone()),
            runtime,
        })
    }

    /// Every slot's status, in a fixed order.
    pub fn status(&self) -> Vec<plugins::SlotStatus> {
        vec![
            self.router.slot().status(),
            self.admission.slot().status(),
            self.cache.slot().status(),
        ]
    }
}

/// Everything the request path, the admin API and the monitors share.
#[derive(Debug)]
pub struct Gateway {
    pub config: Config,
    /// The OpenAI layer over the served model (the worker's code); none when
    /// the gateway only forwards to OpenAI workers and knows no model.
    pub frontend: Option<Arc<Frontend>>,
    /// What prompts bound for OpenAI workers are tokenized with, for
    /// routing (none: by their text).
    pub routing_tokenizer: Option<Arc<sluice_backend::model::Tokenizer>>,
    pub fleet: Arc<Fleet>,
    pub policies: Policies,
    pub queue: Arc<AdmissionQueue>,
    pub metrics: Metrics,
    /// Talks to workers (a template: each server thread uses its own, see
    /// [`Gateway::client`]).
    client: reqwest::Client,
    /// The `/admin` bearer token.
    pub admin_token: String,
    /// Response ids: `<prefix>-<instance>-<n>`.
    pub instance: String,
    pub next_request: AtomicU64,
    /// Where routing decisions' inputs are recorded, when configured.
    pub decision_log: Option<DecisionLog>,
    /// Whether the config names OpenAI workers (requests are then read
    /// for forwarding too).
    forwards: bool,
    /// The runtime `start` ran on: worker monitors live there, never on a
    /// server thread whose request work could delay their heartbeats.
    background: tokio::runtime::Handle,
}

/// A running gateway; dropping it stops its server threads.
#[derive(Debug)]
pub struct Running {
    pub gateway: Arc<Gateway>,
    pub addr: SocketAddr,
    pub server: crate::api::ServerThreads,
}

impl Gateway {
    /// Loads the model's tokenizer, the plugins, starts embedded workers and
    /// the fleet's monitors, and serves on `config.listen`.
    pub async fn start(config: Config) -> Result<Running, StartError> {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let (frontend, embedded) = match &config.model {
            Some(path) => {
                let (frontend, embedded) = Self::load_model(&config, path, created).await?;
                (Some(frontend), embedded)
            }
            None => {
                if !config.forwards_only() {
                    return Err(StartError::NoModel);
                }
                (None, Vec::new())
            }
        };
        let routing_tokenizer = match &config.tokenizer {
            Some(path) => Some(Arc::new(
                sluice_backend::model::load_tokenizer(path).map_err(|source| {
                    StartError::Tokenizer {
                        path: path.display().to_string(),
                        source,
                    }
                })?,
            )),
            None => frontend.as_ref().map(|f| f.tokenizer.clone()),
        };
        let client = worker_client(&config)?;
        let mut fleet = Fleet::new(config.fleet.clone(), config.block_size);
        fleet.approximate = crate::routing::Approximate {
            ttl: Duration::from_millis(config.routing.approximate_ttl_ms),
            max_blocks: config.routing.approximate_max_blocks as usize,
        };
        let fleet = Arc::new(fleet);
        let policies = Policies::new(HostConfig {
            memory_reservation: config.plugin_memory_reservation,
            ..HostConfig::default()
        })?;
        if let Some(dir) = &config.plugins_dir {
            crate::admin::load_plugins_dir(&policies, dir)?;
        }
        let admin_token = match config.admin_token.clone() {
            Some(t) => t,
            None => {
                let token = random_token().map_err(|source| StartError::Read {
                    path: "/dev/urandom".into(),
                    source,
                })?;
                tracing::warn!(%token, "no admin token configured; /admin uses this random one for this run");
                token
            }
        };
        let decision_log = match &config.routing.decision_log {
            Some(path) => Some(
                DecisionLog::open(path, config.routing.decision_log_max_bytes).map_err(
                    |source| StartError::Read {
                        path: path.display().to_string(),
                        source,
                    },
                )?,
            ),
            None => None,
        };
        let gateway = Arc::new(Gateway {
            forwards: config.has_openai_workers(),
            decision_log,
            queue: AdmissionQueue::new(config.limits.max_queued),
            instance: format!("{:x}", created ^ u64::from(std::process::id())),
            config,
            frontend,
            routing_tokenizer,
            fleet,
            policies,
            metrics: Metrics::new(),
            client,
            admin_token,
            next_request: AtomicU64::new(1),
            background: tokio::runtime::Handle::current(),
        });
        for url in &embedded {
            gateway.add_worker(url, Origin::Embedded);
        }
        for entry in gateway.config.workers.clone() {
            gateway
                .add_configured(&entry.spec())
                .map_err(|message| StartError::Configured {
                    url: entry.spec().url,
                    message,
                })?;
        }
        if let Some(dir) = gateway.config.plugins_dir.clone() {
            crate::admin::watch_plugins_dir(gateway.clone(), dir);
        }
        let threads = match gateway.config.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let listen = gateway.config.listen;
        let server = crate::api::start_server_threads(listen, threads, gateway.clone()).map_err(
            |source| StartError::Listen {
                addr: listen,
                source,
            },
        )?;
        let addr = server.addr;
        let model = gateway.frontend.as_ref().map(|f| f.model_name.clone());
        tracing::info!(%addr, threads, model = model.as_deref().unwrap_or("(the workers')"), workers = gateway.fleet.workers().len(), "gateway listening");
        Ok(Running {
            gateway,
            addr,
            server,
        })
    }

    /// Loads the served model's tokenizer and config (and, for embedded
    /// workers, its weights) and starts the embedded workers.
    async fn load_model(
        config: &Config,
        model_path: &std::path::Path,
        created: u64,
    ) -> Result<(Arc<Frontend>, Vec<String>), StartError> {
        let load_error = |source| StartError::Model {
            path: model_path.display().to_string(),
            source,
        };
        use sluice_backend::transfer::Role;
        let roles: Vec<Role> = [
            (config.embedded_workers, Role::Both),
            (config.embedded_prefill, Role::Prefill),
            (config.embedded_decode, Role::Decode),
        ]
        .iter()
        .flat_map(|&(n, role)| std::iter::repeat_n(role, n as usize))
        .collect();
        if !roles.is_empty() {
            // One load of the weights serves every embedded worker.
            let loaded = sluice_backend::model::load(model_path).map_err(load_error)?;
            let name = config.served_model_name.clone().unwrap_or(loaded.name);
            let llama = Arc::new(loaded.llama);
            let tokenizer = Arc::new(loaded.tokenizer);
            let frontend = frontend(config, &name, tokenizer.clone(), &llama.config, created);
            let mut urls = Vec::new();
            for (index, &role) in roles.iter().enumerate() {
                urls.push(
                    start_embedded_worker(config, llama.clone(), tokenizer.clone(), &name, role)
                        .await
                        .map_err(|source| StartError::Worker {
                            index: index as u32,
                            source,
                        })?,
                );
            }
            Ok((frontend, urls))
        } else {
            let info = sluice_backend::model::describe(model_path).map_err(load_error)?;
            let name = config.served_model_name.clone().unwrap_or(info.name);
            let frontend = frontend(
                config,
                &name,
                Arc::new(info.tokenizer),
                &info.config,
                created,
            );
            Ok((frontend, Vec::new()))
        }
    }

    /// Adds a configured worker: a sluice worker, or an OpenAI worker (one
    /// fleet entry per data-parallel rank, each following its rank's KV
    /// event publisher when one is named).
    pub fn add_configured(&self, spec: &WorkerSpec) -> Result<(), String> {
        if spec.kind == WorkerKind::Sluice {
            self.add_worker(&spec.url, Origin::Static);
            return Ok(());
        }
        for rank in 0..spec.dp_ranks {
            let upstream = Upstream {
                kind: WorkerKind::Openai,
                dp_rank: (spec.dp_ranks > 1).then_some(rank),
                api_key: spec.api_key.clone(),
                kv_events: spec.kv_events.is_some(),
            };
            let (worker, new) = self.fleet.add_upstream(&spec.url, Origin::Static, upstream);
            if !new {
                continue;
            }
            let _guard = self.background.enter();
            crate::routing::spawn_monitor(self.fleet.clone(), self.client.clone(), worker.clone());
            if let Some(events) = &spec.kv_events {
                let publisher = engine_events::Publisher {
                    events: engine_events::rank_endpoint(events, rank)?,
                    replay: spec
                        .kv_replay
                        .as_deref()
                        .map(|r| engine_events::rank_endpoint(r, rank))
                        .transpose()?,
                };
                engine_events::spawn(self.fleet.clone(), worker, publisher);
            }
        }
        Ok(())
    }

    /// Whether requests may be forwarded to OpenAI workers (the config
    /// names some).
    pub fn forwards(&self) -> bool {
        self.forwards
    }

    /// Adds (or refreshes) a worker and starts watching a new one.
    pub fn add_worker(&self, url: &str, origin: Origin) -> u32 {
        let (worker, new) = self.fleet.add(url, origin);
        if new {
            let _guard = self.background.enter();
            crate::routing::spawn_monitor(self.fleet.clone(), self.client.clone(), worker.clone());
        }
        worker.id
    }

    /// The calling thread's HTTP client to OpenAI workers (its own connection
    /// pool; sluice workers' token path goes through `upstream::conn`).
    pub fn client(&self) -> reqwest::Client {
        crate::api::thread_client(|| {
            worker_client(&self.config).unwrap_or_else(|_| self.client.clone())
        })
    }

    /// How many requests may run at once: per healthy worker, by the limits.
    pub fn capacity(&self) -> u32 {
        self.fleet
            .healthy_count()
            .saturating_mul(self.config.limits.max_running_per_worker)
    }
}

/// 128 random bits from the kernel, in hex.
fn random_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// An HTTP client to workers with the configured timeouts.
fn worker_client(config: &Config) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(config.fleet.connect_timeout_ms))
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
}

fn frontend(
    config: &Config,
    name: &str,
    tokenizer: Arc<sluice_backend::model::Tokenizer>,
    model: &sluice_backend::model::LlamaConfig,
    created: u64,
) -> Arc<Frontend> {
    Arc::new(Frontend {
        model_name: name.to_string(),
        tokenizer,
        context: config.context.map_or(model.context, |c| c as usize),
        vocab: model.vocab as u32,
        created,
        max_tokens_limit: config.limits.max_tokens,
        simulated: None,
    })
}

/// Starts a worker inside this process on a free loopback port (and, for
/// a decode-capable role, its KV listener on another); returns its URL.
async fn start_embedded_worker(
    config: &Config,
    llama: Arc<sluice_backend::model::Llama>,
    tokenizer: Arc<sluice_backend::model::Tokenizer>,
    name: &str,
    role: sluice_backend::transfer::Role,
) -> std::io::Result<String> {
    use sluice_backend::engine::{Device, Engine, EngineConfig};
    use sluice_backend::server::WorkerState;
    let device: Device = config.device.parse().map_err(std::io::Error::other)?;
    let numerics = config.numerics.parse().map_err(std::io::Error::other)?;
    let engine = Engine::start_on(
        device,
        numerics,
        llama,
        tokenizer,
        EngineConfig {
            block_size: config.block_size as usize,
            ..EngineConfig::default()
        },
    )
    .map_err(|e| std::io::Error::other(format!("device {device}: {e}")))?;
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let state = WorkerState::new(Arc::new(engine), name.to_string())
        .with_role(role, loopback, None)
        .await?;
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind(loopback).await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        if let Err(e) = sluice_backend::server::serve(listener, state).await {
            tracing::error!(error = %e, "embedded worker stopped");
        }
    });
    Ok(url)
}

/// An error and its causes on one line: `outer: cause: root cause`.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}
