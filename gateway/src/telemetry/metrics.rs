//! The gateway's Prometheus metrics (prometheus-client, OpenMetrics text):
//! requests by outcome, TTFT, inter-token and end-to-end latency, routing per
//! worker, connections opened to workers, KV hits, and the plugin slots'
//! calls, latency and errors.

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::plugins::SlotStatus;
use crate::routing::ShadowStatus;

/// How a request ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum RequestOutcome {
    success,
    /// The client's request was refused (4xx) before it reached a worker.
    invalid,
    /// Admission or routing refused it.
    rejected,
    /// A worker failed and no retry could save it.
    failed,
    timeout,
    /// The client went away.
    cancelled,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: RequestOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
}

/// Every metric the gateway keeps.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<OutcomeLabels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    routed: Family<WorkerLabels, Counter>,
    retries: Counter,
    worker_connections: Counter,
    prompt_blocks: Counter,
    cached_prompt_blocks: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("sluice");
        let requests = Family::<OutcomeLabels, Counter>::default();
        registry.register("requests", "Requests by how they ended", requests.clone());
        // 100 µs .. ~3.4 min, doubling.
        let ttft = Histogram::new(exponential_buckets(1e-4, 2.0, 22));
        registry.register("ttft_seconds", "Time to first token", ttft.clone());
        let itl = Histogram::new(exponential_buckets(1e-5, 2.0, 20));
        registry.register("inter_token_seconds", "Time between tokens", itl.clone());
        let e2e = Histogram::new(exponential_buckets(1e-4, 2.0, 24));
        registry.register("request_seconds", "Arrival to last byte", e2e.clone());
        let routed = Family::<WorkerLabels, Counter>::default();
        registry.register("routed", "Requests sent to each worker", routed.clone());
        let retries = Counter::default();
        registry.register(
            "retries",
            "Requests retried on another worker",
            retries.clone(),
        );
        let worker_connections = Counter::default();
        registry.register(
            "worker_connections",
            "Connections opened to workers for requests (kept alive and reused after)",
            worker_connections.clone(),
        );
        let prompt_blocks = Counter::default();
        registry.register(
            "prompt_blocks",
            "Whole KV blocks in routed prompts",
            prompt_blocks.clone(),
        );
        let cached_prompt_blocks = Counter::default();
        registry.register(
            "cached_prompt_blocks",
            "Prompt blocks already cached on the worker that served them",
            cached_prompt_blocks.clone(),
        );
        Self {
            registry,
            requests,
            ttft,
            itl,
            e2e,
            routed,
            retries,
            worker_connections,
            prompt_blocks,
            cached_prompt_blocks,
        }
    }

    pub fn request_done(&self, outcome: RequestOutcome, seconds: f64) {
        self.requests
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
        if outcome == RequestOutcome::success {
            self.e2e.observe(seconds);
        }
    }

    pub fn first_token(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    pub fn next_token(&self, seconds: f64) {
        self.itl.observe(seconds);
    }

    pub fn routed(&self, worker: u32) {
        self.routed
            .get_or_create(&WorkerLabels {
                worker: worker.to_string(),
            })
            .inc();
    }

    pub fn retried(&self) {
        self.retries.inc();
    }

    pub fn worker_connection_opened(&self) {
        self.worker_connections.inc();
    }

    /// A request started on a worker that had `cached` of its `blocks`.
    pub fn kv_blocks(&self, blocks: u32, cached: u32) {
        self.prompt_blocks.inc_by(blocks.into());
        self.cached_prompt_blocks.inc_by(cached.into());
    }

    /// Requests that ended with `outcome` so far.
    pub fn requests(&self, outcome: RequestOutcome) -> u64 {
        self.requests
            .get_or_create(&OutcomeLabels { outcome })
            .get()
    }

    /// The OpenMetrics text of everything, plugin slots included.
    pub fn render(&self, slots: &[SlotStatus], shadow: &ShadowStatus) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode_registry(&mut out, &self.registry).is_err() {
            out.clear();
        }
        let blocks = self.prompt_blocks.get();
        let hit_rate = if blocks == 0 {
            0.0
        } else {
            self.cached_prompt_blocks.get() as f64 / blocks as f64
        };
        let _ = writeln!(
            out,
            "# HELP sluice_kv_hit_rate Cached prompt blocks / prompt blocks.\n# TYPE sluice_kv_hit_rate gauge\nsluice_kv_hit_rate {hit_rate}"
        );
        render_plugins(&mut out, slots);
        render_shadow(&mut out, shadow);
        prometheus_client::encoding::text::encode_eof(&mut out).ok();
        out
    }
}

/// The shadow router's comparison with the active one, labelled with the
/// candidate (nothing while no candidate runs).
fn render_shadow(out: &mut String, shadow: &ShadowStatus) {
    let Some(candidate) = &shadow.candidate else {
        return;
    };
    let labels = format!(
        "plugin=\"{}\",version=\"{}\"",
        candidate.name.replace(['"', '\\', '\n'], "_"),
        candidate.version
    );
    let c = &shadow.comparison;
    for (name, help, value) in [
        (
            "decisions",
            "Requests both the active and the shadow router decided.",
            c.decisions,
        ),
        (
            "disagreements",
            "Of those, the ones where they picked different workers.",
            c.disagreements,
        ),
        (
            "fallbacks",
            "Shadow calls answered by the built-in policy (deferred or failed).",
            c.candidate_fallbacks,
        ),
        (
            "active_overlap_blocks",
            "Prompt blocks cached on the workers the active router picked.",
            c.active_overlap_blocks,
        ),
        (
            "candidate_overlap_blocks",
            "Prompt blocks cached on the workers the shadow router would have picked.",
            c.candidate_overlap_blocks,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP sluice_shadow_{name} {help}\n# TYPE sluice_shadow_{name} counter\nsluice_shadow_{name}_total{{{labels}}} {value}"
        );
    }
}

/// The plugin slots' series, per version (the active one and the one kept
/// for rollback), labelled with slot, plugin and version.
fn render_plugins(out: &mut String, slots: &[SlotStatus]) {
    let versions = || {
        slots.iter().flat_map(|s| {
            s.versions.iter().map(move |v| {
                let labels = format!(
                    "slot=\"{}\",plugin=\"{}\",version=\"{}\"",
                    s.slot,
                    v.plugin.replace(['"', '\\', '\n'], "_"),
                    v.version
                );
                (labels, v)
            })
        })
    };
    out.push_str("# HELP sluice_plugin_calls Plugin calls.\n# TYPE sluice_plugin_calls counter\n");
    for (labels, v) in versions() {
        let _ = writeln!(out, "sluice_plugin_calls_total{{{labels}}} {}", v.calls);
    }
    out.push_str(
        "# HELP sluice_plugin_fallbacks Calls answered by the built-in policy after a plugin failure.\n# TYPE sluice_plugin_fallbacks counter\n",
    );
    for (labels, v) in versions() {
        for (class, n) in &v.errors {
            let _ = writeln!(
                out,
                "sluice_plugin_fallbacks_total{{{labels},class=\"{class}\"}} {n}"
            );
        }
    }
    out.push_str("# HELP sluice_plugin_call_seconds Plugin call time.\n# TYPE sluice_plugin_call_seconds summary\n");
    for (labels, v) in versions() {
        for (q, ns) in [("0.5", v.call_p50_ns), ("0.99", v.call_p99_ns)] {
            let _ = writeln!(
                out,
                "sluice_plugin_call_seconds{{{labels},quantile=\"{q}\"}} {}",
                ns / 1e9
            );
        }
    }
}
