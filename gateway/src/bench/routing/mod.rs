//! `sluice bench routing`: replays multi-turn traces (`trace`) through a
//! router in front of a fleet of simulated workers (`sluice_backend::sim`) at
//! a share of the fleet's capacity, for each policy: our plugins behind
//! `sluice serve`, and peer routers (SGLang's model gateway, vLLM's router)
//! when installed. Every run gets a fresh fleet (empty caches). Reports TTFT
//! and end-to-end percentiles, throughput, the workers' prefix-cache hit rate
//! and load imbalance, next to the trace's oracle hit rate (`plan`); JSON
//! lines, a markdown table and an SVG plot (`report`). Times are modelled
//! time: real time divided by the time scale.

mod plan;
mod replay;
mod report;
pub mod trace;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_backend::server::Frontend;
use sluice_backend::sim::{Profile, SimFleet, SimOptions, word_tokens};

use super::{ChildGuard, free_port, percentile, wait_ready};
use plan::Plan;
use replay::{ReplayOptions, RequestRecord, replay};
pub use report::RunFigures;
use trace::{AgenticParams, Trace};

/// Where a run's trace comes from.
#[derive(Clone, Debug)]
pub enum TraceChoice {
    Agentic(AgenticParams),
    /// ShareGPT's JSON file (`make data`).
    ShareGpt(PathBuf),
    /// MT-Bench's `question.jsonl` (`make data`).
    MtBench(PathBuf),
    /// A trace saved as JSON lines.
    File(PathBuf),
}

#[derive(Clone, Debug)]
pub struct RoutingBenchOptions {
    /// The model whose tokenizer and chat template everything uses.
    pub model: PathBuf,
    /// Built plugin components (`make plugins`).
    pub plugins_dir: PathBuf,
    pub profile: Profile,
    pub workers: usize,
    /// Of the workers, this many only prefill and the rest only decode
    /// (disaggregation); 0 = all do both.
    pub prefill_workers: usize,
    /// Disaggregated: prompts with fewer tokens not cached on their decode
    /// worker skip the prefill hop.
    pub min_prefill_tokens: u32,
    /// Real seconds per modelled second.
    pub time_scale: f64,
    pub traces: Vec<TraceChoice>,
    /// Offered loads, as fractions of the fleet's capacity.
    pub loads: Vec<f64>,
    /// `round-robin`, `least-load`, `kv-aware`, `session-affinity` (our
    /// plugins, each optionally with `?<plugin config>`), `sglang:<policy>`,
    /// `vllm:<policy>` (peers).
    pub policies: Vec<String>,
    /// Real seconds over which sessions arrive in each run.
    pub window_s: f64,
    /// Where the table, plots and JSON go.
    pub out_dir: PathBuf,
    /// The `sluice` binary that serves our policies (default: this one).
    pub sluice: PathBuf,
}

impl RoutingBenchOptions {
    /// The `--quick` preset: the agentic trace, 16 workers, 80% load,
    /// round-robin vs kv-aware vs session-affinity.
    pub fn quick(model: PathBuf) -> Self {
        Self {
            model,
            plugins_dir: PathBuf::from("plugins/target/wasm32-wasip2/release"),
            profile: Profile::h200_llama_8b(),
            workers: 16,
            prefill_workers: 0,
            min_prefill_tokens: 256,
            time_scale: 2.0,
            traces: vec![TraceChoice::Agentic(AgenticParams {
                sessions: 1000,
                turns: (3, 6),
                think_mean: 0.3,
                ..AgenticParams::default()
            })],
            loads: vec![0.8],
            policies: vec![
                "round-robin".into(),
                "kv-aware".into(),
                "session-affinity".into(),
            ],
            window_s: 25.0,
            out_dir: PathBuf::from("target/bench-routing"),
            sluice: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("sluice")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RoutingBenchError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Setup(String),
}

fn setup(e: impl std::fmt::Display) -> RoutingBenchError {
    RoutingBenchError::Setup(e.to_string())
}

/// A router under test, started in front of the fleet (stopped when dropped).
struct Router {
    _process: ChildGuard,
    /// `sluice serve` (else a peer).
    ours: bool,
}

/// Our plugin's file name for a policy name.
fn plugin_file(policy: &str) -> Option<&'static str> {
    Some(match policy {
        "round-robin" => "round_robin.wasm",
        "least-load" => "least_load.wasm",
        "kv-aware" => "kv_aware.wasm",
        "session-affinity" => "session_affinity.wasm",
        _ => return None,
    })
}

/// How many runs have made their folder under `dir` (a fresh name per run).
fn runs_so_far(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

/// Starts the router for `policy` on `port`.
fn start_router(
    options: &RoutingBenchOptions,
    policy: &str,
    urls: &[String],
    port: u16,
    dir: &Path,
) -> Result<Router, RoutingBenchError> {
    // `kv-aware?overlap_weight=2`: a plugin with its config.
    let (name, plugin_config) = policy.split_once('?').unwrap_or((policy, ""));
    if let Some(file) = plugin_file(name) {
        let source = options.plugins_dir.join(file);
        let plugins = dir.join(format!("plugins-{}", runs_so_far(dir)));
        std::fs::create_dir_all(&plugins)?;
        std::fs::copy(&source, plugins.join("router.wasm")).map_err(|e| {
            setup(format!(
                "cannot copy {} ({e}); build the plugins: make plugins",
                source.display()
            ))
        })?;
        std::fs::write(plugins.join("router.conf"), plugin_config)?;
        let p = &options.profile;
        let config = format!(
            "listen = \"127.0.0.1:{port}\"\nmodel = {model:?}\nserved_model_name = \"sim\"\n\
             context = {context}\nblock_size = {block}\nworkers = {urls:?}\nplugins_dir = {plugins:?}\n\
             admin_token = \"bench-admin-token-0123456789\"\n[limits]\nmax_running_per_worker = {running}\n\
             request_timeout_ms = 3600000\nidle_stream_timeout_ms = 600000\n\
             [disaggregation]\nmin_prefill_tokens = {min_prefill}\n",
            min_prefill = options.min_prefill_tokens,
            model = options.model.display().to_string(),
            context = p.context,
            block = p.block_size,
            plugins = plugins.display().to_string(),
            running = p.max_running,
        );
        let config_path = plugins.join("gateway.toml");
        std::fs::write(&config_path, config)?;
        let child = Command::new(&options.sluice)
            .args(["serve", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()?;
        return Ok(Router {
            _process: ChildGuard(child),
            ours: true,
        });
    }
    let (program, args): (&str, Vec<String>) = match policy.split_once(':') {
        Some(("sglang", p)) => (
            "python3",
            vec![
                "-m".into(),
                "sglang_router.launch_router".into(),
                "--policy".into(),
                p.into(),
                "--log-level".into(),
                "warn".into(),
            ],
        ),
        Some(("vllm", p)) => (
            "vllm-router",
            vec![
                "--policy".into(),
                p.into(),
                "--log-level".into(),
                "warning".into(),
            ],
        ),
        _ => return Err(setup(format!("unknown policy {policy}"))),
    };
    let child = Command::new(program)
        .args(&args)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--worker-urls")
        .args(urls)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| setup(format!("cannot start {program} for {policy}: {e}")))?;
    Ok(Router {
        _process: ChildGuard(child),
        ours: false,
    })
}

/// Waits until the router answers and (ours) sees every worker healthy.
async fn wait_router(
    client: &reqwest::Client,
    router: &Router,
    url: &str,
    workers: usize,
) -> Result<(), RoutingBenchError> {
    let limit = Duration::from_secs(60);
    match router.ours {
        true => {
            let started = Instant::now();
            loop {
                let healthy = match client.get(format!("{url}/health")).send().await {
                    Ok(r) => r
                        .json::<Value>()
                        .await
                        .ok()
                        .and_then(|v| v["healthy_workers"].as_u64()),
                    Err(_) => None,
                };
                if healthy == Some(workers as u64) {
                    return Ok(());
                }
                if started.elapsed() > limit {
                    return Err(setup(format!(
                        "sluice serve at {url} saw {healthy:?} healthy workers of {workers}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        false => {
            wait_ready(client, &format!("{url}/v1/models"), limit)
                .await
                .map_err(setup)?;
            // Peers probe their workers on their own schedule.
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok(())
        }
    }
}

/// The tokenizer everything uses and the simulator's word tokens for it,
/// worked out once per benchmark (every run starts a fleet with them).
struct Vocabulary {
    tokenizer: Arc<sluice_backend::model::Tokenizer>,
    words: Arc<[u32]>,
}

/// A trace with its plan and capacity.
struct Prepared {
    trace: Trace,
    plan: Plan,
    capacity_rps: f64,
    mean_turns: f64,
}

fn load_trace(choice: &TraceChoice) -> Result<Trace, RoutingBenchError> {
    match choice {
        TraceChoice::Agentic(p) => Ok(trace::agentic(p)),
        TraceChoice::ShareGpt(path) => trace::sharegpt(path, 600, 1.0, 1).map_err(setup),
        TraceChoice::MtBench(path) => trace::mt_bench(path, 1.0, 1).map_err(setup),
        TraceChoice::File(path) => Trace::from_jsonl(
            &std::fs::read_to_string(path)
                .map_err(|e| setup(format!("cannot read {}: {e}", path.display())))?,
        )
        .map_err(setup),
    }
}

/// The first `n` sessions of a trace.
fn first_sessions(trace: &Trace, n: usize) -> Trace {
    Trace {
        name: trace.name.clone(),
        sessions: trace.sessions[..n.min(trace.sessions.len())].to_vec(),
    }
}

/// Runs the benchmark; `line` gets each JSON line; returns the summary.
pub fn run_routing_bench(
    options: &RoutingBenchOptions,
    mut line: impl FnMut(&Value),
) -> Result<Value, RoutingBenchError> {
    let info = sluice_backend::model::describe(&options.model).map_err(|e| {
        setup(format!(
            "cannot load the tokenizer of {}: {e}",
            options.model.display()
        ))
    })?;
    let tokenizer = Arc::new(info.tokenizer);
    let frontend = Frontend {
        model_name: "sim".into(),
        tokenizer: tokenizer.clone(),
        context: options.profile.context,
        vocab: tokenizer.vocab_size() as u32,
        created: 0,
        max_tokens_limit: None,
        simulated: Some(options.profile.name.clone()),
    };
    let vocabulary = Vocabulary {
        words: word_tokens(&tokenizer).into(),
        tokenizer: tokenizer.clone(),
    };
    let words = &vocabulary.words;
    std::fs::create_dir_all(&options.out_dir)?;
    let dir = std::env::temp_dir().join(format!("sluice-bench-routing-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;

    let mut runs: Vec<RunFigures> = Vec::new();
    let mut oracle = serde_json::Map::new();
    for choice in &options.traces {
        let pool = load_trace(choice)?;
        // Saved, so that the run can be replayed (`--trace FILE`).
        std::fs::write(
            options.out_dir.join(format!("trace-{}.jsonl", pool.name)),
            pool.to_jsonl(),
        )?;
        let started = Instant::now();
        let plan = Plan::new(&pool, &frontend, words, options.profile.block_size).map_err(setup)?;
        let prepared = Prepared {
            capacity_rps: plan.capacity_rps(&options.profile, options.workers),
            mean_turns: pool.requests() as f64 / pool.sessions.len().max(1) as f64,
            trace: pool,
            plan,
        };
        line(&json!({
            "trace": prepared.trace.name,
            "sessions_available": prepared.trace.sessions.len(),
            "requests_available": prepared.plan.requests.len(),
            "mean_turns": prepared.mean_turns,
            "capacity_rps": prepared.capacity_rps,
            "plan_ms": started.elapsed().as_millis() as u64,
        }));
        for &load in &options.loads {
            let session_rate = load * prepared.capacity_rps / prepared.mean_turns;
            let sessions = ((session_rate / options.time_scale * options.window_s).ceil() as usize)
                .clamp(1, prepared.trace.sessions.len());
            let trace = Arc::new(first_sessions(&prepared.trace, sessions));
            let oracle_hit = prepared.plan.oracle_hit_rate(sessions);
            oracle.insert(
                format!("{}@{:.0}", trace.name, load * 100.0),
                json!(oracle_hit),
            );
            line(&json!({
                "trace": trace.name,
                "load": load,
                "sessions": sessions,
                "requests": trace.requests(),
                "session_rate_per_s": session_rate,
                "oracle_hit_rate": oracle_hit,
            }));
            for policy in &options.policies {
                let (figures, records) = run_one(
                    options,
                    &vocabulary,
                    &trace,
                    policy,
                    load,
                    session_rate,
                    &dir,
                )?;
                // The simulator's answers must be the plan's, or the oracle
                // and capacity were worked out for another conversation.
                let unexpected = records
                    .iter()
                    .filter(|r| {
                        r.error.is_none()
                            && prepared.plan.answers[r.session].get(r.turn) != Some(&r.answer)
                    })
                    .count();
                let mut fig = serde_json::to_value(&figures).unwrap_or_default();
                fig["answers_unlike_plan"] = json!(unexpected);
                fig["hit_shortfall"] = prepared.plan.shortfall(sessions, &records);
                fig["ttft_by_part"] = plan::ttft_by_part(&records, options.time_scale);
                if let Some(e) = records.iter().find_map(|r| r.error.as_ref()) {
                    fig["first_error"] = json!(e);
                }
                line(&fig);
                runs.push(figures);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);

    let table = report::markdown(&runs);
    std::fs::write(options.out_dir.join("routing.md"), &table)?;
    std::fs::write(
        options.out_dir.join("routing.json"),
        serde_json::to_string_pretty(&runs).unwrap_or_default(),
    )?;
    let mut plots = Vec::new();
    let mut names: Vec<&str> = runs.iter().map(|r| r.trace.as_str()).collect();
    names.dedup();
    for name in names {
        let path = options.out_dir.join(format!("routing-{name}.svg"));
        report::plot(&runs, name, &path).map_err(setup)?;
        plots.push(path.display().to_string());
    }
    eprint!("{table}");
    Ok(summary(&runs, oracle, plots))
}

/// The last line: per policy (at the first trace's 80% load, else its
/// highest load), TTFT p90 and hit rate, and the oracle hit rates.
fn summary(
    runs: &[RunFigures],
    oracle: serde_json::Map<String, Value>,
    plots: Vec<String>,
) -> Value {
    let mut ttft = serde_json::Map::new();
    let mut hit = serde_json::Map::new();
    if let Some(first) = runs.first() {
        let of_trace: Vec<&RunFigures> = runs.iter().filter(|r| r.trace == first.trace).collect();
        let load = if of_trace.iter().any(|r| (r.load - 0.8).abs() < 1e-9) {
            0.8
        } else {
            of_trace.iter().map(|r| r.load).fold(0.0, f64::max)
        };
        for r in of_trace.iter().filter(|r| (r.load - load).abs() < 1e-9) {
            ttft.insert(r.policy.clone(), json!(r.ttft_p90_ms));
            hit.insert(r.policy.clone(), json!(r.hit_rate));
        }
    }
    let first_oracle = oracle.values().next().cloned().unwrap_or(Value::Null);
    json!({
        "summary": "routing",
        "ttft_p90_ms": ttft,
        "hit_rate": hit,
        "oracle_hit_rate": first_oracle,
        "oracle_hit_rate_by_run": oracle,
        "plots": plots,
    })
}

/// One (trace, load, policy) run on a fresh fleet.
async fn run_async(
    options: &RoutingBenchOptions,
    vocabulary: &Vocabulary,
    trace: &Arc<Trace>,
    policy: &str,
    session_rate: f64,
    dir: &Path,
) -> Result<(Vec<RequestRecord>, Vec<(u64, u64, u64)>, f64), RoutingBenchError> {
    let sim = SimOptions {
        time_scale: options.time_scale,
        model_name: "sim".into(),
        prefill_workers: options.prefill_workers,
        ..SimOptions::new(options.profile.clone(), options.workers)
    };
    let mut fleet =
        SimFleet::start_with_words(vocabulary.tokenizer.clone(), vocabulary.words.clone(), &sim)
            .await?;
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let router = start_router(options, policy, &fleet.urls, port, dir)?;
    let client = reqwest::Client::new();
    wait_router(&client, &router, &url, options.workers).await?;
    let began = Instant::now();
    let records = replay(
        trace.clone(),
        ReplayOptions {
            base_url: url,
            model: "sim".into(),
            session_rate,
            time_scale: options.time_scale,
            request_timeout: Duration::from_secs_f64(120.0 * options.time_scale),
        },
    )
    .await;
    let span = began.elapsed().as_secs_f64();
    let counters = fleet
        .states
        .iter()
        .map(|s| {
            let m = &s.metrics;
            (
                m.requests.load(Ordering::Relaxed),
                m.prompt_tokens.load(Ordering::Relaxed),
                m.cached_prompt_tokens.load(Ordering::Relaxed),
            )
        })
        .collect();
    drop(router);
    fleet.stop();
    Ok((records, counters, span))
}

fn run_one(
    options: &RoutingBenchOptions,
    vocabulary: &Vocabulary,
    trace: &Arc<Trace>,
    policy: &str,
    load: f64,
    session_rate: f64,
    dir: &Path,
) -> Result<(RunFigures, Vec<RequestRecord>), RoutingBenchError> {
    // A runtime per run: when it goes, every task of the fleet goes with it.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (records, counters, span) = runtime.block_on(run_async(
        options,
        vocabulary,
        trace,
        policy,
        session_rate,
        dir,
    ))?;
    runtime.shutdown_timeout(Duration::from_secs(2));
    let figures = report::figures(
        &records,
        &counters,
        span,
        options.time_scale,
        &trace.name,
        policy,
        load,
    );
    Ok((figures, records))
}
