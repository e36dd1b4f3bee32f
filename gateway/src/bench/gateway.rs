//! `sluice bench gateway`: what a gateway adds to a request. A minimal fast
//! upstream (`super::upstream`, two instances) answers canned tokens; the
//! same paced load goes to it directly, through `sluice serve` (a child
//! process, with the kv-aware router plugin loaded), through a byte relay
//! (`super::relay`: the floor any second process adds), and through SGLang's
//! model gateway (`sglang-router`) and vLLM's router (`vllm-router`), both
//! cache-aware, when they are installed. `sluice serve` treats the upstreams
//! as sluice workers (token ids in) or, with `--upstream-kind openai`, as
//! plain OpenAI servers (the body forwarded, the answer relayed), as the peers
//! do. Reported per target and mode: latency percentiles and the gateway
//! process's CPU time per request (from /proc schedstat, in ns); and, one
//! kept-alive connection streaming replies back to back, the added latency
//! per reply (where Nagle's algorithm and delayed ACKs would show).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{ChildGuard, free_port, percentile, wait_ready};

/// What `sluice bench gateway` runs.
#[derive(Clone, Debug)]
pub struct GatewayBenchOptions {
    /// The model whose tokenizer and chat template the gateway uses.
    pub model: PathBuf,
    /// The built plugin components (for `kv_aware.wasm`).
    pub plugins_dir: PathBuf,
    /// Requests per second, paced evenly (open loop).
    pub rate: f64,
    /// Measured seconds per target and mode (after one second of warm-up).
    pub seconds: f64,
    /// Tokens the upstream answers per request.
    pub tokens: u32,
    /// Run the peer gateways too (those installed).
    pub peer: bool,
    /// What `sluice serve` takes the upstreams for.
    pub upstream_kind: crate::config::WorkerKind,
}

impl Default for GatewayBenchOptions {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            plugins_dir: PathBuf::from("plugins/target/wasm32-wasip2/release"),
            rate: 200.0,
            seconds: 5.0,
            tokens: 16,
            peer: true,
            upstream_kind: crate::config::WorkerKind::Sluice,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayBenchError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("cannot read the router plugin {path}: {source} (build the plugins: make plugins)")]
    Plugin {
        path: String,
        source: std::io::Error,
    },
    #[error("{what} did not become ready: {why}")]
    NotReady { what: &'static str, why: String },
}

/// CPU time of every thread of `pid`, in ns (Linux schedstat).
pub fn process_cpu_ns(pid: u32) -> Option<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let path = task.ok()?.path().join("schedstat");
        let text = std::fs::read_to_string(path).unwrap_or_default();
        total += text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(total)
}

/// User and system CPU time of `pid` so far, in µs (`/proc/<pid>/stat`,
/// clock ticks: 10 ms resolution, fine over a phase of a thousand requests).
fn process_user_sys_us(pid: u32) -> Option<(f64, f64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = text.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file: 12 and 13 after ')'.
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((ticks(11)? * 1e6 / hz, ticks(12)? * 1e6 / hz))
}

/// The system prompt every request of the run shares (also in
/// `bench/gateway_load.py`, the callgrind procedure's load: a test keeps the
/// two the same).
const SYSTEM_PROMPT: &str = "You are the support assistant of a bicycle shop. Answer questions about \
                             repairs, spare parts, opening hours and prices briefly and politely. If you \
                             do not know an answer, say so and suggest calling the shop during opening hours.";

/// The user's question of request `i` (one more place kept the same in
/// `bench/gateway_load.py`).
fn question(i: u64) -> String {
    format!(
        "Customer {i} asks: how much does it cost to replace a chain and {} brake pads on a road bike?",
        i % 5 + 1
    )
}

/// A long shared system prompt and a question that differs in every request
/// of the run, as in a chat service.
fn request_body(stream: bool) -> Value {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let i = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    json!({
        "model": "bench",
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question(i)},
        ],
        "max_tokens": 16,
        "stream": stream,
    })
}

/// What the summary is computed from.
struct Figures {
    mode: &'static str,
    target: &'static str,
    p50: f64,
    p99: f64,
    cpu: Option<f64>,
    user: Option<f64>,
}

/// One measured phase against one target.
#[derive(Debug)]
struct Phase {
    latencies_us: Vec<f64>,
    errors: u64,
    cpu_ns: Option<u64>,
    /// User and system CPU over the phase, in µs.
    user_sys_us: Option<(f64, f64)>,
}

/// Sends `rate` requests a second for `seconds` to `url`; measures each one's
/// time to its last byte, and `pid`'s CPU time over the phase.
async fn run_phase(
    client: &reqwest::Client,
    url: &str,
    stream: bool,
    rate: f64,
    seconds: f64,
    pid: Option<u32>,
) -> Phase {
    let n = (rate * seconds).round() as u64;
    let results = Arc::new(Mutex::new(Vec::with_capacity(n as usize)));
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let cpu_before = pid.and_then(process_cpu_ns);
    let split_before = pid.and_then(process_user_sys_us);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let (client, url, results, errors) = (
            client.clone(),
            url.to_string(),
            results.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let ok = match client.post(&url).json(&request_body(stream)).send().await {
                Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                _ => false,
            };
            if ok {
                results
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(sent.elapsed().as_secs_f64() * 1e6);
            } else {
                errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let cpu_after = pid.and_then(process_cpu_ns);
    let split_after = pid.and_then(process_user_sys_us);
    let mut latencies_us = std::mem::take(&mut *results.lock().unwrap_or_else(|e| e.into_inner()));
    latencies_us.sort_by(f64::total_cmp);
    Phase {
        latencies_us,
        errors: errors.load(std::sync::atomic::Ordering::Relaxed),
        cpu_ns: cpu_before.zip(cpu_after).map(|(a, b)| b.saturating_sub(a)),
        user_sys_us: split_before
            .zip(split_after)
            .map(|((u0, s0), (u1, s1))| (u1 - u0, s1 - s0)),
    }
}

/// Replies a kept-alive connection streams back to back.
const KEEPALIVE_REPLIES: usize = 300;

/// Sends `n` streaming requests one after another on `client` (one
/// connection); returns each one's time to its last byte, in µs, sorted.
async fn run_back_to_back(client: &reqwest::Client, url: &str, n: usize) -> Vec<f64> {
    let mut latencies = Vec::with_capacity(n);
    for _ in 0..n {
        let sent = Instant::now();
        let ok = match client.post(url).json(&request_body(true)).send().await {
            Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
            _ => false,
        };
        if !ok {
            return Vec::new();
        }
        latencies.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(f64::total_cmp);
    latencies
}

/// Starts `sluice serve` on the two upstreams with the kv-aware router plugin.
fn start_sluice(
    options: &GatewayBenchOptions,
    upstreams: &[String],
    port: u16,
    dir: &Path,
) -> Result<ChildGuard, GatewayBenchError> {
    let plugin = options.plugins_dir.join("kv_aware.wasm");
    let bytes = std::fs::read(&plugin).map_err(|source| GatewayBenchError::Plugin {
        path: plugin.display().to_string(),
        source,
    })?;
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    std::fs::write(plugins.join("router.wasm"), bytes)?;
    let model = options.model.display().to_string();
    let (model_line, workers) = match options.upstream_kind {
        crate::config::WorkerKind::Sluice => (
            format!("model = {model:?}\nserved_model_name = \"bench\""),
            format!("{upstreams:?}"),
        ),
        // As in front of vLLM: no model, its tokenizer for routing.
        crate::config::WorkerKind::Openai => (
            format!("tokenizer = {model:?}"),
            format!(
                "[{}]",
                upstreams
                    .iter()
                    .map(|u| format!("{{ url = {u:?}, kind = \"openai\" }}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    };
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\n{model_line}\nworkers = {workers}\nplugins_dir = {plugins:?}\nadmin_token = \"bench-admin-token-0123456789\"\n",
        plugins = plugins.display().to_string(),
    );
    let config_path = dir.join("gateway.toml");
    std::fs::write(&config_path, config)?;
    let child = Command::new(std::env::current_exe()?)
        .arg("serve")
        .arg("--config")
        .arg(&config_path)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()?;
    Ok(ChildGuard(child))
}

/// Starts the floor target (`super::relay`) on `port`, relaying to `upstream`
/// (`http://host:port`).
fn start_relay(upstream: &str, port: u16) -> Result<ChildGuard, GatewayBenchError> {
    let to = upstream.trim_start_matches("http://");
    let child = Command::new(std::env::current_exe()?)
        .args(["bench", "gateway", "--relay-child"])
        .arg(format!("127.0.0.1:{port}"))
        .arg(to)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()?;
    Ok(ChildGuard(child))
}

/// The peer gateways: name, program and arguments before the common ones.
const PEERS: [(&str, &str, &[&str]); 2] = [
    (
        "sglang_router",
        "python3",
        &[
            "-m",
            "sglang_router.launch_router",
            "--policy",
            "cache_aware",
            "--log-level",
            "warn",
        ],
    ),
    (
        "vllm_router",
        "vllm-router",
        &["--policy", "cache_aware", "--log-level", "warning"],
    ),
];

/// Starts a peer gateway, if it is installed.
fn start_peer(program: &str, args: &[&str], upstreams: &[String], port: u16) -> Option<ChildGuard> {
    let child = Command::new(program)
        .args(args)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        // Both default their metrics to port 29000: one would not start.
        .args(["--prometheus-port", &free_port().ok()?.to_string()])
        .arg("--worker-urls")
        .args(upstreams)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    Some(ChildGuard(child))
}

/// Runs the benchmark; `line` gets each JSON line; returns the summary.
pub fn run_gateway_bench(
    options: &GatewayBenchOptions,
    mut line: impl FnMut(&Value),
) -> Result<Value, GatewayBenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut upstreams = Vec::new();
        for _ in 0..2 {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            upstreams.push(format!("http://{}", listener.local_addr()?));
            tokio::spawn(super::upstream::serve(listener, options.tokens, "bench".into()));
        }
        let client = reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(512).build().map_err(|e| std::io::Error::other(e.to_string()))?;
        let dir = std::env::temp_dir().join(format!("sluice-bench-gateway-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let sluice_port = free_port()?;
        let sluice = start_sluice(options, &upstreams, sluice_port, &dir)?;
        let sluice_url = format!("http://127.0.0.1:{sluice_port}");
        wait_ready(&client, &format!("{sluice_url}/health"), Duration::from_secs(60))
            .await
            .map_err(|why| GatewayBenchError::NotReady { what: "sluice serve", why })?;
        let relay_port = free_port()?;
        let relay = start_relay(&upstreams[0], relay_port)?;
        let relay_url = format!("http://127.0.0.1:{relay_port}");
        wait_ready(&client, &format!("{relay_url}/health"), Duration::from_secs(10))
            .await
            .map_err(|why| GatewayBenchError::NotReady { what: "the relay", why })?;
        let mut targets: Vec<(&str, String, Option<u32>)> = vec![
            ("direct", format!("{}/v1/chat/completions", upstreams[0]), None),
            ("relay", format!("{relay_url}/v1/chat/completions"), Some(relay.0.id())),
            ("sluice", format!("{sluice_url}/v1/chat/completions"), Some(sluice.0.id())),
        ];
        let mut notes = Vec::new();
        let mut peers = Vec::new();
        for (name, program, args) in PEERS.iter().filter(|_| options.peer) {
            let port = free_port()?;
            let Some(peer) = start_peer(program, args, &upstreams, port) else {
                notes.push(format!("{name} is not installed"));
                continue;
            };
            let url = format!("http://127.0.0.1:{port}");
            match wait_ready(&client, &format!("{url}/health"), Duration::from_secs(60)).await {
                Ok(()) => {
                    targets.push((name, format!("{url}/v1/chat/completions"), Some(peer.0.id())));
                    peers.push(peer);
                }
                Err(e) => notes.push(format!("{name} did not start: {e}")),
            }
        }
        let mut figures: Vec<Figures> = Vec::new();
        for (mode, stream) in [("non_streaming", false), ("streaming", true)] {
            for (name, url, pid) in &targets {
                // Warm-up: connections, caches, the plugin's pool.
                run_phase(&client, url, stream, options.rate, 1.0, None).await;
                let phase = run_phase(&client, url, stream, options.rate, options.seconds, *pid).await;
                let n = phase.latencies_us.len() as f64;
                let cpu = phase.cpu_ns.map(|ns| ns as f64 / 1e3 / (n + phase.errors as f64).max(1.0));
                let per_req = (n + phase.errors as f64).max(1.0);
                let (user, sys) = phase
                    .user_sys_us
                    .map_or((None, None), |(u, s)| (Some(u / per_req), Some(s / per_req)));
                let p50 = percentile(&phase.latencies_us, 0.5);
                let p99 = percentile(&phase.latencies_us, 0.99);
                let row = json!({
                    "bench": "gateway", "mode": mode, "target": name,
                    "rate_per_s": options.rate, "requests": n, "errors": phase.errors,
                    "p50_us": p50, "p99_us": p99,
                    "mean_us": phase.latencies_us.iter().sum::<f64>() / n.max(1.0),
                    "cpu_us_per_req": cpu,
                    "user_us_per_req": user, "sys_us_per_req": sys,
                });
                line(&row);
                figures.push(Figures {
                    mode,
                    target: name,
                    p50,
                    p99,
                    cpu,
                    user,
                });
            }
        }
        // One kept-alive connection, streaming replies back to back.
        for (name, url, _) in &targets {
            let one = reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(1).build().map_err(|e| std::io::Error::other(e.to_string()))?;
            // 50 replies of warm-up, then the measured ones.
            let warm = run_back_to_back(&one, url, 50).await;
            let latencies = match warm.is_empty() {
                true => warm,
                false => run_back_to_back(&one, url, KEEPALIVE_REPLIES).await,
            };
            let p50 = percentile(&latencies, 0.5);
            let p99 = percentile(&latencies, 0.99);
            line(&json!({"bench": "gateway", "mode": "keepalive_streaming", "target": name,
                         "requests": latencies.len(), "p50_us": p50, "p99_us": p99}));
            figures.push(Figures { mode: "keepalive_streaming", target: name, p50, p99, cpu: None, user: None });
        }
        drop(peers);
        drop(sluice);
        drop(relay);
        let _ = std::fs::remove_dir_all(&dir);
        let get = |mode: &str, target: &str| {
            figures
                .iter()
                .find(|f| f.mode == mode && f.target == target)
        };
        let kind = match options.upstream_kind {
            crate::config::WorkerKind::Sluice => "sluice",
            crate::config::WorkerKind::Openai => "openai",
        };
        let mut summary = json!({"bench": "gateway", "summary": true, "rate_per_s": options.rate, "upstream_tokens": options.tokens, "upstream_kind": kind});
        let modes = [("non_streaming", ""), ("streaming", "stream_"), ("keepalive_streaming", "keepalive_")];
        for (mode, prefix) in modes {
            let Some(direct) = get(mode, "direct") else { continue };
            let others = std::iter::once(("relay", "relay")).chain(PEERS.iter().map(|(p, _, _)| (*p, *p)));
            for (target, name) in std::iter::once(("sluice", "")).chain(others) {
                let Some(f) = get(mode, target) else { continue };
                let key = |what: &str| match name {
                    "" => format!("{prefix}{what}"),
                    peer => format!("{prefix}{peer}_{what}"),
                };
                summary[key("added_p50_us")] = json!(f.p50 - direct.p50);
                summary[key("added_p99_us")] = json!(f.p99 - direct.p99);
                if f.cpu.is_some() {
                    summary[key("cpu_us_per_req")] = json!(f.cpu);
                    summary[key("user_us_per_req")] = json!(f.user);
                }
                if let (Some(ours), false) = (get(mode, "sluice"), matches!(name, "" | "relay"))
                    && let (Some(a), Some(b)) = (ours.cpu, f.cpu)
                {
                    summary[format!("{prefix}cpu_ratio_vs_{name}")] = json!(a / b);
                }
            }
        }
        // What sluice adds beyond the floor: its own share of the added latency.
        for (mode, prefix) in modes {
            if let (Some(ours), Some(floor)) = (get(mode, "sluice"), get(mode, "relay")) {
                summary[format!("{prefix}added_p50_over_relay_us")] = json!(ours.p50 - floor.p50);
            }
        }
        if !notes.is_empty() {
            summary["peers"] = json!(notes);
        }
        Ok(summary)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bench/gateway_load.py` sends the request this benchmark sends, so
    /// that its instruction counts and this benchmark's CPU describe one
    /// request.
    #[test]
    fn the_callgrind_load_sends_this_benchmarks_request() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/gateway_load.py");
        let script = std::fs::read_to_string(path).unwrap();
        assert!(script.contains(&format!("SYSTEM = \"{SYSTEM_PROMPT}\"")));
        // Request 5 asks about 1 brake pad: both numbers put back as the
        // script's f-string writes them.
        let template = question(5)
            .replace("Customer 5 ", "Customer {i} ")
            .replace(" and 1 brake", " and {i % 5 + 1} brake");
        assert!(template.contains("{i} asks") && template.contains("{i % 5 + 1} brake"));
        assert!(script.contains(&format!("f\"{template}\"")), "{template}");
        assert!(script.contains("\"max_tokens\": 16"));
    }
}
