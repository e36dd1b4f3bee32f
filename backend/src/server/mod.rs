//! The worker's HTTP API (axum on hyper): the OpenAI endpoints (`openai`), the
//! internal token-level endpoint the gateway uses, the event stream (KV events
//! and load), `/health` and `/metrics`, and the endpoints peer routers ask
//! of a worker (`peers`).

mod error;
pub mod events;
mod internal;
pub mod openai;
mod peers;
mod v1;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

pub use error::ApiError;
pub use internal::{PrefillDone, PrefillRequest};
pub use openai::Frontend;

use crate::engine::{Engine, Usage};

/// The largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Blocks this worker pushed as a prefill worker: copied into the decode
    /// worker's cache directly, and sent as bytes.
    pub kv_blocks_in_place: AtomicU64,
    pub kv_blocks_as_bytes: AtomicU64,
}

impl Metrics {
    pub fn record(&self, u: &Usage) {
        self.prompt_tokens
            .fetch_add(u.prompt_tokens.into(), Ordering::Relaxed);
        self.cached_prompt_tokens
            .fetch_add(u.cached_tokens.into(), Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(u.completion_tokens.into(), Ordering::Relaxed);
    }
}

/// What every handler shares.
#[derive(Debug)]
pub struct WorkerState {
    pub engine: Arc<Engine>,
    /// Which hops of a disaggregated request this worker takes.
    pub role: crate::transfer::Role,
    /// Where prefill workers send this worker's KV (`host:port`); `None` =
    /// no KV listener, so no `remote_prefill` requests.
    pub kv_addr: Option<String>,
    /// How this worker sends KV when it prefills for another.
    pub transport: Arc<dyn crate::transfer::KvTransport>,
    /// Copy KV straight into decode workers' caches where both are on one
    /// node and can (CUDA IPC); false: always bytes.
    pub kv_direct: bool,
    /// The OpenAI layer over this worker's model.
    pub frontend: Arc<Frontend>,
    /// The name clients use in `model`.
    pub model_name: String,
    /// A per-process tag for response ids.
    pub instance: String,
    pub started_unix: u64,
    pub metrics: Metrics,
}

impl WorkerState {
    pub fn new(engine: Arc<Engine>, model_name: String) -> Self {
        let started_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let frontend = Arc::new(Frontend {
            model_name: model_name.clone(),
            tokenizer: engine.tokenizer.clone(),
            context: engine.context,
            vocab: engine.vocab as u32,
            created: started_unix,
            max_tokens_limit: None,
            simulated: None,
        });
        Self {
            engine,
            role: crate::transfer::Role::Both,
            kv_addr: None,
            transport: Arc::new(crate::transfer::tcp::TcpTransport::default()),
            kv_direct: true,
            frontend,
            model_name,
            instance: format!("{:x}", started_unix ^ u64::from(std::process::id())),
            started_unix,
            metrics: Metrics::default(),
        }
    }

    /// Sets the worker's role and starts its KV listener on `kv_listen`
    /// (unless the role is prefill-only), advertised as `kv_advertise` (else
    /// the bound address, with 127.0.0.1 for an unspecified host).
    pub async fn with_role(
        mut self,
        role: crate::transfer::Role,
        kv_listen: SocketAddr,
        kv_advertise: Option<String>,
    ) -> std::io::Result<Self> {
        self.role = role;
        if role.can_decode() {
            let listener = tokio::net::TcpListener::bind(kv_listen).await?;
            let local = listener.local_addr()?;
            self.kv_addr =
                Some(kv_advertise.unwrap_or_else(|| loopback_if_unspecified(local).to_string()));
            // A prefill step per frame: allow as long as a request waits.
            tokio::spawn(crate::transfer::tcp::serve_kv(
                listener,
                self.engine.clone(),
                self.engine.config.kv_wait,
            ));
        }
        Ok(self)
    }

    /// Marks a worker as simulated (the `sim` module's): `/v1/models`,
    /// `/health` and the server info name the timing profile.
    pub fn simulated(mut self, profile: &str) -> Self {
        let frontend = Arc::get_mut(&mut self.frontend).expect("the frontend is not shared yet");
        frontend.simulated = Some(profile.to_string());
        self
    }
}

/// The worker's routes.
pub fn router(state: Arc<WorkerState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(v1::chat_completions))
        .route("/v1/completions", post(v1::completions))
        .route("/v1/models", get(v1::models))
        .route("/internal/generate", post(internal::generate))
        .route("/internal/prefill", post(internal::prefill))
        .route("/internal/kv", get(internal::kv_snapshot))
        .route("/events", get(internal::events))
        .route("/health", get(internal::health))
        .route("/metrics", get(internal::metrics))
        .route("/health_generate", get(peers::health_generate))
        .route("/get_model_info", get(peers::model_info))
        .route("/get_server_info", get(peers::server_info))
        .route("/tokenize", post(peers::tokenize))
        .route("/v1/chat/completions/render", post(peers::render_chat))
        .fallback(|| async { ApiError::not_found_path() })
        // Handlers read bodies themselves, up to MAX_BODY_BYTES, to answer an
        // oversize one with an OpenAI-shaped 413.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// Serves until the listener fails; every accepted socket gets TCP_NODELAY.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<WorkerState>,
) -> std::io::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    match &state.frontend.simulated {
        // A simulated fleet logs itself once, not once per worker.
        Some(profile) => tracing::debug!(%addr, %profile, "simulated worker listening"),
        None => tracing::info!(%addr, model = %state.model_name, "worker listening"),
    }
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    axum::serve(listener, router(state)).await
}

/// How `sluice worker` runs.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub model: std::path::PathBuf,
    pub served_name: Option<String>,
    pub engine: crate::engine::EngineConfig,
    /// CPU or CUDA (`auto`: a GPU when there is one).
    pub device: crate::engine::Device,
    /// How the GPU computes (batch-invariant, or fast).
    pub numerics: crate::compute::cuda::Numerics,
    /// The linear layers' precision (`as-loaded`: the file's).
    pub weights: crate::model::WeightFormat,
    /// A gateway to register with (its base URL), again every few seconds.
    pub register: Option<String>,
    /// Which hops of a disaggregated request this worker takes.
    pub role: crate::transfer::Role,
    /// Where the KV listener binds (decode and both roles); port 0 = any.
    pub kv_listen: SocketAddr,
    /// The `host:port` prefill workers should send KV to; default the bound
    /// address (127.0.0.1 for an unspecified host).
    pub kv_advertise: Option<String>,
    /// The URL the gateway should use for this worker; default
    /// `http://<listen address>` (with 127.0.0.1 for an unspecified host).
    pub advertise: Option<String>,
    /// The gateway's admin token, for registering.
    pub register_token: Option<String>,
    /// Same-node direct KV copies when prefilling (`WorkerState::kv_direct`).
    pub kv_direct: bool,
}

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot load the model {path}")]
    Model {
        path: String,
        source: crate::model::LoadError,
    },
    #[error("cannot convert the weights: {0}")]
    Weights(String),
    #[error("cannot start the engine on {device}")]
    Device {
        device: crate::engine::Device,
        source: crate::compute::cuda::GpuError,
    },
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the server failed: {0}")]
    Serve(std::io::Error),
}

/// Loads the model, starts the engine and serves on `listener` (bound by the
/// caller before the model loads, so a taken port fails at once) until the
/// process ends.
pub async fn run_worker(
    listener: tokio::net::TcpListener,
    config: WorkerConfig,
) -> Result<(), WorkerError> {
    let started = std::time::Instant::now();
    let loaded = crate::model::load(&config.model).map_err(|source| WorkerError::Model {
        path: config.model.display().to_string(),
        source,
    })?;
    tracing::info!(
        model = %loaded.name,
        layers = loaded.llama.config.n_layers,
        load_ms = started.elapsed().as_millis() as u64,
        "model loaded"
    );
    let name = config.served_name.clone().unwrap_or(loaded.name);
    let llama = loaded
        .llama
        .with_linear_weights(config.weights)
        .map_err(WorkerError::Weights)?;
    let engine = Engine::start_on(
        config.device,
        config.numerics,
        Arc::new(llama),
        Arc::new(loaded.tokenizer),
        config.engine,
    )
    .map_err(|source| WorkerError::Device {
        device: config.device,
        source,
    })?;
    let mut state = WorkerState::new(Arc::new(engine), name)
        .with_role(config.role, config.kv_listen, config.kv_advertise.clone())
        .await
        .map_err(|source| WorkerError::Listen {
            addr: config.kv_listen,
            source,
        })?;
    state.kv_direct = config.kv_direct;
    if let Some(kv) = &state.kv_addr {
        tracing::info!(role = %state.role, kv_addr = %kv, "KV listener ready");
    }
    let state = Arc::new(state);
    if let Some(gateway) = config.register.clone() {
        let local = listener.local_addr().map_err(WorkerError::Serve)?;
        let advertise = config
            .advertise
            .clone()
            .unwrap_or_else(|| format!("http://{}", loopback_if_unspecified(local)));
        tokio::spawn(register(gateway, advertise, config.register_token.clone()));
    }
    serve(listener, state).await.map_err(WorkerError::Serve)
}

/// `addr`, with 127.0.0.1 in place of an unspecified host (0.0.0.0, ::).
fn loopback_if_unspecified(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(std::net::IpAddr::from([127, 0, 0, 1]), addr.port())
    } else {
        addr
    }
}

/// How often a worker registers again (the gateway forgets a registered
/// worker it cannot reach for its registration TTL).
const REGISTER_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Registers with the gateway now and every [`REGISTER_EVERY`], logging only
/// changes between success and failure.
async fn register(gateway: String, advertise: String, token: Option<String>) {
    let client = reqwest::Client::new();
    let url = format!("{}/admin/workers", gateway.trim_end_matches('/'));
    let mut last_ok: Option<bool> = None;
    loop {
        let mut request = client
            .post(&url)
            .timeout(std::time::Duration::from_secs(2))
            .json(&serde_json::json!({"url": advertise}));
        if let Some(t) = &token {
            request = request.bearer_auth(t);
        }
        let result = match request.send().await {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => Err(format!("it answered {}", r.status())),
            Err(e) => Err(e.to_string()),
        };
        match (&result, last_ok) {
            (Ok(()), Some(true)) | (Err(_), Some(false)) => {}
            (Ok(()), _) => tracing::info!(%gateway, %advertise, "registered with the gateway"),
            (Err(e), _) => tracing::warn!(%gateway, error = %e, "cannot register with the gateway"),
        }
        last_ok = Some(result.is_ok());
        tokio::time::sleep(REGISTER_EVERY).await;
    }
}
