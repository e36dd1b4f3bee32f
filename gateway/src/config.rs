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
    /// Workers' base URLs (`http://host:port`); more can register themselves.
    pub workers: Vec<String>,
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
    /// Clients' API keys for `/v1`; none = `/v1` is open.
    pub api_keys: Vec<ApiKey>,
    /// The bearer token of `/admin`; none = a random one, logged at start.
    pub admin_token: Option<String>,
    pub limits: Limits,
    pub fleet: FleetConfig,
    pub routing: RoutingConfig,
    pub telemetry: TelemetryConfig,
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
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            decision_log: None,
            decision_log_max_bytes: 1 << 30,
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
            embedded_workers: 0,
            embedded_prefill: 0,
            embedded_decode: 0,
            disaggregation: DisaggregationConfig::default(),
            device: "auto".into(),
            numerics: "batch-invariant".into(),
            block_size: 16,
            plugins_dir: None,
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
        for url in &self.workers {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(ConfigError::Invalid(format!(
                    "worker `{url}` is not an http:// URL"
                )));
            }
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
    }
}
