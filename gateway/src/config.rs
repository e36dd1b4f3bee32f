//! The gateway's configuration: one TOML file (every field optional), then
//! the environment (`SLUICE_API_KEYS`, `SLUICE_ADMIN_TOKEN`) read through
//! [`Env`] so tests never touch the process environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the config {path}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Everything `sluice serve` reads.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where the gateway listens.
    pub listen: SocketAddr,
    /// HTTP server threads (one runtime each); 0 = one per core.
    pub threads: usize,
    /// The served model (GGUF file or Hugging Face folder): its tokenizer and
    /// chat template preprocess every request.
    pub model: Option<PathBuf>,
    /// The name clients use in `model`; default: the model's own name.
    pub served_model_name: Option<String>,
    /// The context the workers serve, in tokens; default: the model file's.
    /// Set it when they serve a longer one (simulated workers, say).
    pub context: Option<u32>,
    /// Workers: a base URL (`http://host:port`, a sluice worker) or a table
    /// (`{ url, kind = "openai", kv_events, ... }`); sluice workers can also
    /// register themselves.
    pub workers: Vec<WorkerEntry>,
    /// The tokenizer that prompts bound for `kind = "openai"` workers are
    /// cut into blocks with, for routing (a GGUF file, a Hugging Face folder,
    /// or a `tokenizer.json` beside its `tokenizer_config.json`); default:
    /// `model`'s. With neither, such prompts are routed by their text.
    pub tokenizer: Option<PathBuf>,
    /// In-process workers serving `model` (the single-machine default).
    pub embedded_workers: u32,
    /// In-process prefill-only workers (a disaggregated fleet on one machine).
    pub embedded_prefill: u32,
    /// In-process decode workers (KV from the prefill workers).
    pub embedded_decode: u32,
    pub disaggregation: DisaggregationConfig,
    /// What the in-process workers run on: `auto` (a CUDA GPU when there is
    /// one, else the CPU), `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// How in-process GPU workers compute: `batch-invariant` (a request's
    /// answer does not depend on what runs beside it) or `fast`.
    pub numerics: String,
    /// KV block size in tokens; workers must use the same.
    pub block_size: u32,
    /// Folder of `router.wasm`, `admission.wasm`, `cache-policy.wasm` (each
    /// with an optional `<slot>.conf` plugin config), watched for changes.
    pub plugins_dir: Option<PathBuf>,
    /// Address space reserved for each plugin instance's linear memory, in
    /// bytes; default: wasmtime's (4 GiB and guard pages, so that the
    /// compiled plugins need no bounds checks). With 128 instances that is
    /// ~0.5 TB of reserved (not used) address space, which `ulimit -v` and
    /// tools such as valgrind refuse; 33554432 (the 32 MiB an instance may
    /// grow to) reserves that much instead, and the plugins check bounds.
    pub plugin_memory_reservation: Option<u64>,
    /// Clients' API keys for `/v1`; none = `/v1` is open.
    pub api_keys: Vec<ApiKey>,
    /// The bearer token of `/admin`; none = a random one, logged at start.
    pub admin_token: Option<String>,
    pub limits: Limits,
    pub fleet: FleetConfig,
    pub routing: RoutingConfig,
    pub telemetry: TelemetryConfig,
}

/// One configured worker: a URL alone is a sluice worker.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum WorkerEntry {
    Url(String),
    Spec(WorkerSpec),
}

impl WorkerEntry {
    pub fn spec(&self) -> WorkerSpec {
        match self {
            WorkerEntry::Url(url) => WorkerSpec::sluice(url),
            WorkerEntry::Spec(spec) => spec.clone(),
        }
    }
}

impl From<&str> for WorkerEntry {
    fn from(url: &str) -> Self {
        WorkerEntry::Url(url.to_string())
    }
}

/// What a worker is, and how the gateway learns what it caches.
#[derive(
    Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum WorkerKind {
    /// A sluice worker: token ids in, events out, KV events on `/events`.
    #[default]
    Sluice,
    /// Any OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM, llama.cpp,
    /// another gateway): the client's body is forwarded and the answer relayed
    /// byte for byte.
    Openai,
}

/// A worker entry in full.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// Base URL, `http://host:port`.
    pub url: String,
    #[serde(default)]
    pub kind: WorkerKind,
    /// The engine's KV event publisher (ZMQ, `tcp://host:5557`: vLLM's
    /// `--kv-events-config` endpoint, SGLang's likewise); none = the
    /// gateway predicts the worker's cache from its own routing
    /// (approximate mode).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// The publisher's replay endpoint (vLLM's `replay_endpoint`): after a
    /// gap or a reconnect the missed events are asked for there.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// Data-parallel ranks of the engine (attention DP): each rank caches on
    /// its own and is routed to as its own worker (header
    /// `X-data-parallel-rank`); rank r publishes on the endpoint's port + r.
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// Sent as `Authorization: Bearer` to the worker.
    #[serde(default)]
    pub api_key: Option<String>,
}

fn one() -> u32 {
    1
}

impl WorkerSpec {
    pub fn sluice(url: &str) -> Self {
        Self::new(url, WorkerKind::Sluice)
    }

    pub fn openai(url: &str) -> Self {
        Self::new(url, WorkerKind::Openai)
    }

    fn new(url: &str, kind: WorkerKind) -> Self {
        Self {
            url: url.to_string(),
            kind,
            kv_events: None,
            kv_replay: None,
            dp_ranks: 1,
            api_key: None,
        }
    }
}

/// When a request takes the prefill hop (in a fleet with prefill workers).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggregationConfig {
    /// A prompt with fewer tokens than this not cached on its decode
    /// worker is prefilled there, skipping the prefill hop (conditional
    /// disaggregation); 0 = every prompt takes the hop.
    pub min_prefill_tokens: u32,
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            min_prefill_tokens: 256,
        }
    }
}

/// Records of routing decisions, for `sluice plugins replay`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// A file that every routing decision's inputs and answer are appended
    /// to (JSON lines); none = not recorded.
    pub decision_log: Option<PathBuf>,
    /// The file stops growing at this size.
    pub decision_log_max_bytes: u64,
    /// Approximate mode (workers whose KV events are not heard): a routed
    /// prompt's blocks count as cached on its worker for this long after
    /// the last request that used them.
    pub approximate_ttl_ms: u64,
    /// The most predicted blocks per worker (the oldest go first).
    pub approximate_max_blocks: u32,
    /// Without a tokenizer, prompts bound for OpenAI workers are cut into
    /// blocks of this many characters (a block counts as a quarter as many
    /// tokens).
    pub text_block_chars: u32,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            decision_log: None,
            decision_log_max_bytes: 1 << 30,
            approximate_ttl_ms: 120_000,
            approximate_max_blocks: 1 << 20,
            text_block_chars: 64,
        }
    }
}

/// One client key and the tenant it stands for.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    pub key: String,
    /// 1.. (0 is "anonymous").
    pub tenant: u32,
}

/// Limits on what one request may ask and take.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_body_bytes: usize,
    /// The most tokens a request may ask to generate; none = up to the context.
    pub max_tokens: Option<u32>,
    /// From arrival to the last byte, queueing included.
    pub request_timeout_ms: u64,
    /// The longest wait for the next token of a running request.
    pub idle_stream_timeout_ms: u64,
    /// Requests the gateway lets run at once per healthy worker when the
    /// admission policy queues (the built-in policy admits everything).
    pub max_running_per_worker: u32,
    /// Requests that may wait in the admission queue.
    pub max_queued: u32,
}

/// How the gateway watches its workers.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// A worker whose event stream is silent this long is taken out (workers
    /// send a load event every 250 ms).
    pub heartbeat_timeout_ms: u64,
    /// Wait between attempts to reach a worker that is out.
    pub reconnect_ms: u64,
    /// A self-registered worker unreachable this long is forgotten.
    pub registration_ttl_ms: u64,
    /// Workers tried for one request before it fails (retries happen only
    /// before the first token).
    pub max_attempts: u32,
    /// Connect timeout to a worker.
    pub connect_timeout_ms: u64,
}

impl FleetConfig {
    pub fn connect_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.connect_timeout_ms)
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// OTLP/HTTP traces endpoint (`http://host:4318/v1/traces`); none = off.
    pub otlp_endpoint: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            threads: 0,
            model: None,
            served_model_name: None,
            context: None,
            workers: Vec::new(),
            tokenizer: None,
            embedded_workers: 0,
            embedded_prefill: 0,
            embedded_decode: 0,
            disaggregation: DisaggregationConfig::default(),
            device: "auto".into(),
            numerics: "batch-invariant".into(),
            block_size: 16,
            plugins_dir: None,
            plugin_memory_reservation: None,
            api_keys: Vec::new(),
            admin_token: None,
            limits: Limits::default(),
            fleet: FleetConfig::default(),
            routing: RoutingConfig::default(),
            telemetry: TelemetryConfig::default(),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 8 << 20,
            max_tokens: None,
            request_timeout_ms: 600_000,
            idle_stream_timeout_ms: 60_000,
            max_running_per_worker: 64,
            max_queued: 4096,
        }
    }
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            heartbeat_timeout_ms: 2_000,
            reconnect_ms: 500,
            registration_ttl_ms: 30_000,
            max_attempts: 3,
            connect_timeout_ms: 1_000,
        }
    }
}

impl Limits {
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    pub fn idle_stream_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_stream_timeout_ms)
    }
}

/// Reads environment variables; tests pass a map instead of the process's.
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment.
#[derive(Debug, Clone, Copy)]
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.is_empty())
    }
}

impl<const N: usize> Env for [(&str, &str); N] {
    fn var(&self, name: &str) -> Option<String> {
        self.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    }
}

impl Config {
    /// Parses a config file's text.
    pub fn from_toml(text: &str, path: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            message: e.to_string(),
        })
    }

    /// Whether any configured worker is an OpenAI passthrough upstream.
    pub fn has_openai_workers(&self) -> bool {
        self.workers
            .iter()
            .any(|w| w.spec().kind == WorkerKind::Openai)
    }

    /// Workers this process runs itself, of every role.
    pub fn in_process_workers(&self) -> u32 {
        self.embedded_workers + self.embedded_prefill + self.embedded_decode
    }

    /// Whether the gateway only forwards: no in-process worker, and every
    /// configured worker an OpenAI one (such a gateway needs no model).
    pub fn forwards_only(&self) -> bool {
        self.in_process_workers() == 0
            && !self.workers.is_empty()
            && self
                .workers
                .iter()
                .all(|w| w.spec().kind == WorkerKind::Openai)
    }

    pub fn from_file(path: &std::path::Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Adds what the environment says: `SLUICE_API_KEYS` (comma-separated
    /// `key` or `key:tenant`; a bare key's tenant is its position, from 1)
    /// and `SLUICE_ADMIN_TOKEN` (when the file names none).
    pub fn apply_env(&mut self, env: &impl Env) -> Result<(), ConfigError> {
        if let Some(keys) = env.var("SLUICE_API_KEYS") {
            for (i, item) in keys.split(',').map(str::trim).enumerate() {
                if item.is_empty() {
                    continue;
                }
                let (key, tenant) = match item.rsplit_once(':') {
                    Some((key, tenant)) => (
                        key,
                        tenant.parse().map_err(|_| {
                            ConfigError::Invalid(format!(
                                "SLUICE_API_KEYS: tenant of item {} is not a number",
                                i + 1
                            ))
                        })?,
                    ),
                    None => (item, i as u32 + 1),
                };
                self.api_keys.push(ApiKey {
                    key: key.into(),
                    tenant,
                });
            }
        }
        if self.admin_token.is_none() {
            self.admin_token = env.var("SLUICE_ADMIN_TOKEN");
        }
        self.check()
    }

    /// Refuses settings that cannot work.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Invalid("block_size must be at least 1".into()));
        }
        self.device
            .parse::<sluice_backend::engine::Device>()
            .map_err(|e| ConfigError::Invalid(format!("device: {e}")))?;
        self.numerics
            .parse::<sluice_backend::compute::cuda::Numerics>()
            .map_err(|e| ConfigError::Invalid(format!("numerics: {e}")))?;
        if let Some(k) = self.api_keys.iter().find(|k| k.tenant == 0) {
            return Err(ConfigError::Invalid(format!(
                "API key {}…: tenant 0 is reserved for anonymous requests",
                k.key.chars().take(4).collect::<String>()
            )));
        }
        if self.admin_token.as_deref().is_some_and(|t| t.len() < 16) {
            return Err(ConfigError::Invalid(
                "admin_token must be at least 16 characters".into(),
            ));
        }
        const DAY_MS: u64 = 86_400_000;
        let limits = &self.limits;
        for (name, ms) in [
            ("limits.request_timeout_ms", limits.request_timeout_ms),
            (
                "limits.idle_stream_timeout_ms",
                limits.idle_stream_timeout_ms,
            ),
            (
                "fleet.heartbeat_timeout_ms",
                self.fleet.heartbeat_timeout_ms,
            ),
            ("fleet.reconnect_ms", self.fleet.reconnect_ms),
            ("fleet.registration_ttl_ms", self.fleet.registration_ttl_ms),
            ("fleet.connect_timeout_ms", self.fleet.connect_timeout_ms),
        ] {
            if !(1..=DAY_MS).contains(&ms) {
                return Err(ConfigError::Invalid(format!(
                    "{name} must be between 1 and {DAY_MS} (a day), got {ms}"
                )));
            }
        }
        if self.embedded_prefill > 0
            && self.embedded_decode == 0
            && self.embedded_workers == 0
            && self.workers.is_empty()
        {
            return Err(ConfigError::Invalid(
                "prefill workers need decode workers (embedded_decode, embedded_workers or workers)"
                    .into(),
            ));
        }
        if limits.max_running_per_worker == 0 {
            return Err(ConfigError::Invalid(
                "limits.max_running_per_worker must be at least 1".into(),
            ));
        }
        if self.fleet.max_attempts == 0 {
            return Err(ConfigError::Invalid(
                "fleet.max_attempts must be at least 1".into(),
            ));
        }
        for worker in &self.workers {
            let spec = worker.spec();
            let url = &spec.url;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(ConfigError::Invalid(format!(
                    "worker `{url}` is not an http:// URL"
                )));
            }
            if !(1..=256).contains(&spec.dp_ranks) {
                return Err(ConfigError::Invalid(format!(
                    "worker `{url}`: dp_ranks must be between 1 and 256"
                )));
            }
            for endpoint in spec.kv_events.iter().chain(&spec.kv_replay) {
                if spec.kind != WorkerKind::Openai {
                    return Err(ConfigError::Invalid(format!(
                        "worker `{url}`: kv_events and kv_replay are for kind = \"openai\" (sluice workers publish on /events)"
                    )));
                }
                crate::routing::engine_events::parse_tcp_endpoint(endpoint)
                    .map_err(|e| ConfigError::Invalid(format!("worker `{url}`: {e}")))?;
            }
            if spec.kind == WorkerKind::Sluice && spec.dp_ranks != 1 {
                return Err(ConfigError::Invalid(format!(
                    "worker `{url}`: dp_ranks is for kind = \"openai\""
                )));
            }
        }
        let routing = &self.routing;
        if routing.approximate_ttl_ms == 0 || routing.approximate_max_blocks == 0 {
            return Err(ConfigError::Invalid(
                "routing.approximate_ttl_ms and routing.approximate_max_blocks must be at least 1"
                    .into(),
            ));
        }
        if !(4..=65_536).contains(&routing.text_block_chars) {
            return Err(ConfigError::Invalid(
                "routing.text_block_chars must be between 4 and 65536".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_then_environment() {
        let mut c = Config::from_toml(
            r#"
            workers = ["http://10.0.0.1:8081"]
            [limits]
            max_tokens = 512
            [[api_keys]]
            key = "sk-file"
            tenant = 7
            "#,
            "test.toml",
        )
        .unwrap();
        c.apply_env(&[
            ("SLUICE_API_KEYS", "sk-a, sk-b:9"),
            ("SLUICE_ADMIN_TOKEN", "0123456789abcdef"),
        ])
        .unwrap();
        assert_eq!(c.limits.max_tokens, Some(512));
        assert_eq!(c.limits.max_body_bytes, 8 << 20, "defaults fill the rest");
        let keys: Vec<_> = c
            .api_keys
            .iter()
            .map(|k| (k.key.as_str(), k.tenant))
            .collect();
        assert_eq!(keys, [("sk-file", 7), ("sk-a", 1), ("sk-b", 9)]);
        assert_eq!(c.admin_token.as_deref(), Some("0123456789abcdef"));
    }

    #[test]
    fn refuses_what_cannot_work() {
        let err = |text: &str| {
            let mut c = Config::from_toml(text, "t.toml")?;
            c.apply_env(&[("X", "")])
        };
        assert!(matches!(
            err("nonsense = 1"),
            Err(ConfigError::Parse { .. })
        ));
        assert!(matches!(
            err("block_size = 0"),
            Err(ConfigError::Invalid(_))
        ));
        assert!(matches!(
            err("admin_token = \"short\""),
            Err(ConfigError::Invalid(_))
        ));
        assert!(matches!(
            err("workers = [\"10.0.0.1:80\"]"),
            Err(ConfigError::Invalid(_))
        ));
        assert!(err("").is_ok());
        assert!(matches!(
            err("workers = [{ url = \"http://a:1\", kv_events = \"tcp://a:5557\" }]"),
            Err(ConfigError::Invalid(_))
        ));
        assert!(matches!(
            err("workers = [{ url = \"http://a:1\", kind = \"openai\", kv_events = \"a:5557\" }]"),
            Err(ConfigError::Invalid(_))
        ));
    }

    #[test]
    fn worker_entries_are_urls_or_tables() {
        let c = Config::from_toml(
            r#"
            workers = [
                "http://10.0.0.1:8081",
                { url = "http://10.0.0.2:8000", kind = "openai", kv_events = "tcp://10.0.0.2:5557", dp_ranks = 2 },
            ]
            "#,
            "t.toml",
        )
        .unwrap();
        c.check().unwrap();
        assert_eq!(
            c.workers[0].spec(),
            WorkerSpec::sluice("http://10.0.0.1:8081")
        );
        let vllm = c.workers[1].spec();
        assert_eq!(vllm.kind, WorkerKind::Openai);
        assert_eq!(vllm.kv_events.as_deref(), Some("tcp://10.0.0.2:5557"));
        assert_eq!((vllm.dp_ranks, vllm.kv_replay), (2, None));
        assert!(c.has_openai_workers());
    }
}
