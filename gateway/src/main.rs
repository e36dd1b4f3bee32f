//! The `sluice` command: `sluice serve` runs the gateway (by default with an
//! in-process worker); `sluice worker` serves a model with sluice's own engine;
//! `sluice sim` serves simulated workers (and calibrates their profile);
//! `sluice plugins check` loads a plugin component the way the gateway does and
//! reports the verdict; `sluice bench` measures the parts.

mod allocator;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use sluice_backend::engine::Device;
use sluice_backend::engine::EngineConfig;
use sluice_backend::server::{WorkerConfig, run_worker};
use sluice_gateway::bench::{
    CudaEngineBenchOptions, EngineBenchOptions, Fp4BenchOptions, GatewayBenchOptions,
    PluginBenchOptions, RoutingBenchOptions, TraceChoice, run_cuda_engine_bench, run_engine_bench,
    run_fp4_accuracy_bench, run_fp4_gpu_bench, run_gateway_bench, run_plugin_bench,
    run_routing_bench,
};

use sluice_backend::model::FETCHED_MODEL as DEFAULT_MODEL;
use sluice_gateway::config::{ProcessEnv, WorkerEntry, WorkerKind, WorkerSpec};
use sluice_gateway::plugins::{Admission, Cache, HostConfig, PluginKind, Router, Runtime, Slot};
use sluice_gateway::{Config, Gateway};

/// mimalloc instead of glibc's malloc. A gateway request allocates and
/// frees a few hundred small buffers (JSON, token ids, events, HTTP heads):
/// under callgrind, glibc's malloc and free took ~21% of the gateway's
/// instructions a request (BENCHMARKS.md, "Gateway overhead"). Asked through
/// its plain entry points where they give the alignment (`allocator`).
#[global_allocator]
static ALLOCATOR: allocator::Mimalloc = allocator::Mimalloc;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "An OpenAI-compatible LLM serving gateway with Wasm policy plugins"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway. Without a config: the OpenAI API on 127.0.0.1:8080
    /// in front of one in-process worker serving SmolLM2 (`--workers N` for N).
    Serve {
        /// A TOML config (see README); flags below override it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Where to listen [default: 127.0.0.1:8080]
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// The served model [default: as `sluice worker`]
        #[arg(long)]
        model: Option<PathBuf>,
        /// In-process workers [default: 1 when no worker is configured]
        #[arg(long)]
        workers: Option<u32>,
        /// A worker's base URL (repeatable).
        #[arg(long = "worker")]
        worker_urls: Vec<String>,
        /// An OpenAI-compatible server to forward to (vLLM, SGLang, ...;
        /// repeatable); its KV events and ranks are set in the config.
        #[arg(long = "openai-worker")]
        openai_urls: Vec<String>,
        /// The tokenizer OpenAI workers' prompts are routed by (GGUF, Hugging
        /// Face folder or tokenizer.json) [default: the model's; none: by text]
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Folder of plugin components (`router.wasm`, ...), watched for changes.
        #[arg(long)]
        plugins_dir: Option<PathBuf>,
        /// What in-process workers run on: auto, cpu, cuda, cuda:N [default: auto]
        #[arg(long)]
        device: Option<Device>,
        /// In-process prefill-only workers (disaggregation on one machine:
        /// with --decode M, an NPMD fleet)
        #[arg(long)]
        prefill: Option<u32>,
        /// In-process decode workers (KV from the prefill workers)
        #[arg(long)]
        decode: Option<u32>,
        /// Prompts with fewer uncached tokens skip the prefill hop [default:
        /// the config's disaggregation.min_prefill_tokens, 256]
        #[arg(long)]
        min_prefill_tokens: Option<u32>,
    },
    /// Serve a model: the OpenAI API, the internal token API and the event stream.
    Worker {
        /// A GGUF model file [default: $SLUICE_MODEL, else the SmolLM2 that
        /// `make model` fetches]
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        /// 0: any free port (the first line on stdout names the address)
        #[arg(long, default_value_t = 8081)]
        port: u16,
        /// The model name clients send [default: the file name]
        #[arg(long)]
        served_model_name: Option<String>,
        /// KV cache blocks (of 16 tokens).
        #[arg(long, default_value_t = 512)]
        kv_blocks: u32,
        /// Sequences running at once.
        #[arg(long, default_value_t = 16)]
        max_running: usize,
        /// Tokens per engine step (decode tokens plus prefill chunks).
        #[arg(long, default_value_t = 256)]
        step_tokens: usize,
        /// A gateway to register with (base URL); the admin token comes from
        /// $SLUICE_ADMIN_TOKEN.
        #[arg(long)]
        register: Option<String>,
        /// The URL the gateway should reach this worker at.
        #[arg(long)]
        advertise: Option<String>,
        /// auto (a CUDA GPU when there is one, else the CPU), cpu, cuda, cuda:N
        #[arg(long, default_value = "auto")]
        device: Device,
        /// The linear layers' precision: as-loaded, bf16, mxfp4, nvfp4 (FP4
        /// runs through the reference kernels on the CPU, as BF16 on the GPU)
        #[arg(long, default_value = "as-loaded")]
        weights: sluice_backend::model::WeightFormat,
        /// On a GPU: batch-invariant (an answer does not depend on what runs
        /// beside it) or fast (BENCHMARKS.md, "CUDA engine")
        #[arg(long, default_value = "batch-invariant")]
        numerics: sluice_backend::compute::cuda::Numerics,
        /// Disaggregation: prefill (for decode workers), decode (with KV from
        /// prefill workers, and whole short requests) or both
        #[arg(long, default_value = "both")]
        role: sluice_backend::transfer::Role,
        /// Where decode workers take KV from prefill workers (TCP) [default:
        /// the --host, any free port]
        #[arg(long)]
        kv_listen: Option<std::net::SocketAddr>,
        /// The host:port prefill workers should send KV to [default: the
        /// bound KV address]
        #[arg(long)]
        kv_advertise: Option<String>,
        /// When prefilling for a decode worker on this node whose cache can
        /// be mapped (CUDA IPC), copy the KV into it directly; with this
        /// flag, always send the KV as bytes over TCP.
        #[arg(long)]
        no_kv_direct: bool,
    },
    /// The CUDA kernels.
    Kernels {
        #[command(subcommand)]
        which: Kernels,
    },
    /// The simulated engine (no model runs: step times come from a timing
    /// profile), for fleet-scale routing experiments.
    Sim {
        #[command(subcommand)]
        which: Sim,
    },
    /// Work with policy plugin components.
    #[command(alias = "plugin")]
    Plugins {
        #[command(subcommand)]
        which: Plugins,
    },
    /// Run a benchmark; prints JSON lines, the last one a summary.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
}

#[derive(Subcommand)]
enum Kernels {
    /// Compile every kernel file with NVRTC for each architecture (no GPU
    /// needed; libnvrtc.so.13 on LD_LIBRARY_PATH). Prints one line per file
    /// and architecture; exits non-zero if any fails.
    Compile {
        /// Architectures, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "sm_90a,sm_100a,sm_103a")]
        arch: Vec<String>,
    },
}

#[derive(Subcommand)]
enum Sim {
    /// Serve N simulated workers from this process, each on its own port.
    Serve {
        /// Simulated workers.
        #[arg(long, default_value_t = 16)]
        workers: usize,
        /// The timing profile (h200-llama-8b, cpu-smollm2).
        #[arg(long, default_value = "h200-llama-8b")]
        profile: String,
        /// Real seconds per modelled second (10 = ten times slower).
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        /// The first worker's port; the others follow it.
        #[arg(long, default_value_t = 9100)]
        base_port: u16,
        /// The model whose tokenizer and chat template the workers use
        /// [default: as `sluice worker`]
        #[arg(long)]
        model: Option<PathBuf>,
        /// The model name clients send [default: the file name]
        #[arg(long)]
        served_model_name: Option<String>,
        /// Disaggregated: the first N workers only prefill, the rest only
        /// decode (KV over TCP, delayed for its modelled bytes)
        #[arg(long, default_value_t = 0)]
        prefill_workers: usize,
    },
    /// Time the real CPU forward pass on a set of batch shapes and fit the
    /// `cpu-smollm2` profile's constants to them.
    Calibrate {
        /// A GGUF model file [default: as `sluice worker`]
        #[arg(long)]
        model: Option<PathBuf>,
        /// Timed runs per shape (the median is used).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
    },
}

#[derive(Subcommand)]
enum Plugins {
    /// Ask a router plugin what it would have done with every decision of a
    /// decision log (the gateway's `[routing] decision_log`), and compare.
    Replay {
        /// The router component (`.wasm`).
        plugin: PathBuf,
        /// The decision log (JSON lines).
        log: PathBuf,
        /// The config string passed to the plugin's `init`.
        #[arg(long, default_value = "")]
        config: String,
        /// Replay at most this many records.
        #[arg(long)]
        limit: Option<u64>,
    },
    /// Load a component as the gateway would (compile, check imports and
    /// exports, init with the config, smoke call) and print the verdict.
    Check {
        /// The component (`.wasm`).
        file: PathBuf,
        /// The slot it is for.
        #[arg(long, value_enum)]
        kind: Kind,
        /// The config string passed to the plugin's `init`.
        #[arg(long, default_value = "")]
        config: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    Router,
    Admission,
    CachePolicy,
}

#[derive(Subcommand)]
enum Bench {
    /// Decode speed of the CPU engine at batch 1 and 8 (and llama.cpp's);
    /// with `--device cuda`, decode and prefill on a GPU against the roofline.
    Engine {
        /// A GGUF model file [default: as `sluice worker`; with --device cuda
        /// and no --model, --synthetic-model llama-3.1-8b]
        #[arg(long)]
        model: Option<PathBuf>,
        /// Tokens generated per request (CPU).
        #[arg(long, default_value_t = 64)]
        new_tokens: u32,
        /// Also run llama.cpp on the same GGUF (CPU; needs `pip install llama-cpp-python`).
        #[arg(long)]
        vs_llamacpp: bool,
        /// cpu, or cuda / cuda:N
        #[arg(long, default_value = "cpu")]
        device: Device,
        /// A Llama shape with generated weights (CUDA): llama-3.1-8b,
        /// llama-3.2-1b, llama-3.1-70b-tp8
        #[arg(long)]
        synthetic_model: Option<String>,
        /// Decode batch sizes (CUDA).
        #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
        batches: Vec<usize>,
        /// Tokens already in each sequence when decode is timed (CUDA).
        #[arg(long, default_value_t = 1024)]
        context: usize,
        /// Timed decode steps per batch size (CUDA).
        #[arg(long, default_value_t = 32)]
        steps: usize,
        /// Prefill prompt lengths (CUDA).
        #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
        prompts: Vec<usize>,
        /// Also run PyTorch + transformers on the same shape (CUDA; this script).
        #[arg(long)]
        vs_torch: Option<PathBuf>,
        /// The linear layers' format (CUDA): bf16, mxfp4 or nvfp4 (generated
        /// FP4 weights for a synthetic shape; a GGUF's quantized from its own).
        #[arg(long, default_value = "bf16")]
        weights: sluice_backend::model::WeightFormat,
        /// Leave out the decode GEMM and decode attention sweeps (CUDA): only
        /// the decode and prefill steps, e.g. under a profiler.
        #[arg(long)]
        no_sweeps: bool,
    },
    /// FP4 weights: with --accuracy, SmolLM2's perplexity and greedy agreement
    /// in BF16, MXFP4 and NVFP4 on MT-Bench's text (CPU; `make data` first).
    Fp4 {
        /// The comparison of formats: perplexity and greedy agreement (CPU).
        #[arg(long)]
        accuracy: bool,
        /// The Hopper FP4 kernels (GPU 0): weight-read bandwidth on a Llama
        /// shape's matrices at 1, 8, 16 and 64 tokens, MXFP4 and NVFP4; then
        /// the prefill regime (--prefill-tokens) in TFLOP/s against cuBLAS BF16.
        #[arg(long)]
        gemv: bool,
        /// Tokens of the prefill-regime measurement of --gemv (0: none).
        #[arg(long, default_value_t = 1024)]
        prefill_tokens: usize,
        /// The shape of --gemv.
        #[arg(long, default_value = "llama-3.1-8b")]
        synthetic_model: String,
        /// A GGUF model file [default: as `sluice worker`]
        #[arg(long)]
        model: Option<PathBuf>,
        /// Tokens scored in all.
        #[arg(long, default_value_t = 4096)]
        max_tokens: usize,
    },
    /// KV transfer for disaggregation. Without --device: the TCP transport on
    /// loopback between two engines on the real model (MB/s), and a
    /// disaggregated request's time to first token split into prefill,
    /// transfer and first decode step, against aggregated. With --device
    /// cuda: pages between two GPUs of one node (every layer, K and V, in one
    /// gather kernel over peer access).
    Transfer {
        /// cuda: GPU 0 to GPU 1 [default: the TCP transport, on the CPU]
        #[arg(long)]
        device: Option<Device>,
        /// The model of the TCP measurement [default: as `sluice worker`]
        #[arg(long)]
        model: Option<PathBuf>,
        /// Prompt length of the TTFT comparison.
        #[arg(long, default_value_t = 1024)]
        prompt_tokens: usize,
        /// Timed repetitions (medians are reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Pages to move (of 16 tokens).
        #[arg(long, default_value_t = 4096)]
        pages: usize,
        /// The shape whose pages move.
        #[arg(long, default_value = "llama-3.1-8b")]
        synthetic_model: String,
        /// With --device cuda: into another process's cache over CUDA IPC
        /// (a child `sluice` holding it on GPU 1 if there is one, else on
        /// GPU 0), as a prefill worker writes a decode worker's pages.
        #[arg(long)]
        ipc: bool,
        /// The child's half of --ipc: hold a cache on --device, print its
        /// share (JSON) and wait for standard input to close.
        #[arg(long, hide = true)]
        ipc_hold: bool,
    },
    /// What a gateway adds per request in front of a minimal fast upstream:
    /// direct vs `sluice serve` (kv-aware plugin) vs SGLang's gateway.
    Gateway {
        /// The model whose tokenizer the gateway uses [default: as `sluice worker`]
        #[arg(long)]
        model: Option<PathBuf>,
        /// Folder with the built plugin components (`make plugins`).
        #[arg(long, default_value = "plugins/target/wasm32-wasip2/release")]
        plugins_dir: PathBuf,
        /// Requests per second (open loop).
        #[arg(long, default_value_t = 200.0)]
        rate: f64,
        /// Measured seconds per target and mode.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Skip the peer gateways (SGLang's and vLLM's routers).
        #[arg(long)]
        no_peer: bool,
        /// What sluice takes the upstreams for: `sluice` (token ids in) or
        /// `openai` (bodies forwarded, answers relayed, as the peers do).
        #[arg(long, value_enum, default_value = "sluice")]
        upstream_kind: WorkerKind,
        /// The child's half of the relay target: relay bytes from LISTEN
        /// to UPSTREAM until killed.
        #[arg(long, hide = true, num_args = 2, value_names = ["LISTEN", "UPSTREAM"])]
        relay_child: Option<Vec<std::net::SocketAddr>>,
    },
    /// Routing quality at fleet scale: multi-turn traces replayed through
    /// each policy (ours, and SGLang's and vLLM's routers when installed) in
    /// front of simulated workers, at shares of the fleet's capacity.
    Routing {
        /// The small preset: agentic trace, 16 workers, 80% load, round-robin
        /// vs kv-aware vs session-affinity (other flags still apply).
        #[arg(long)]
        quick: bool,
        /// Traces: agentic, sharegpt, mt-bench (from `make data`), or a
        /// JSON-lines trace file (repeatable) [default: agentic]
        #[arg(long = "trace")]
        traces: Vec<String>,
        /// Offered loads as fractions of capacity, comma-separated [default: 0.5,0.8,0.95]
        #[arg(long, value_delimiter = ',')]
        loads: Vec<f64>,
        /// Policies, comma-separated: round-robin, least-load, kv-aware,
        /// session-affinity, sglang:<policy>, vllm:<policy>
        /// [default: our four, sglang:cache_aware, sglang:round_robin, vllm:cache_aware, vllm:round_robin]
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// Simulated workers [default: 16]
        #[arg(long)]
        workers: Option<usize>,
        /// Disaggregated fleet: of the workers, this many only prefill and
        /// the rest only decode (the offered load is the same fleet's)
        #[arg(long, default_value_t = 0)]
        prefill_workers: usize,
        /// With --prefill-workers: prompts with fewer tokens not cached on
        /// their decode worker skip the prefill hop
        #[arg(long, default_value_t = 256)]
        min_prefill_tokens: u32,
        /// Timing profile (h200-llama-8b, cpu-smollm2) [default: h200-llama-8b]
        #[arg(long)]
        profile: Option<String>,
        /// Real seconds per modelled second [default: 2]
        #[arg(long)]
        time_scale: Option<f64>,
        /// Real seconds over which sessions arrive in each run [default: 25]
        #[arg(long)]
        window: Option<f64>,
        /// The model whose tokenizer everything uses [default: as `sluice worker`]
        #[arg(long)]
        model: Option<PathBuf>,
        /// Folder with the built plugin components (`make plugins`).
        #[arg(long, default_value = "plugins/target/wasm32-wasip2/release")]
        plugins_dir: PathBuf,
        /// Where routing.md, routing.json and the SVG plots go.
        #[arg(long, default_value = "target/bench-routing")]
        out: PathBuf,
    },
    /// Cost of a KV-aware routing decision through Wasm vs native, and of swaps.
    Plugins {
        /// Folder with the built plugin components (`make plugins`).
        #[arg(long, default_value = "plugins/target/wasm32-wasip2/release")]
        plugins_dir: PathBuf,
        /// Calls per timed round at 64 workers.
        #[arg(long, default_value_t = 200_000)]
        calls: u64,
        /// Timed rounds per figure; the median is reported.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// A short run (fewer calls and swaps), for smoke checks.
        #[arg(long)]
        quick: bool,
    },
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let command = Cli::parse().command;
    // `sluice serve` may export spans (its config names the endpoint).
    let mut serve_config = None;
    let endpoint = match &command {
        Command::Serve {
            config: Some(path), ..
        } => {
            let config = Config::from_file(path)?;
            let endpoint = config.telemetry.otlp_endpoint.clone();
            serve_config = Some(config);
            endpoint
        }
        _ => None,
    };
    let _telemetry = sluice_gateway::telemetry::init(endpoint.as_deref(), "sluice-gateway")
        .map_err(anyhow::Error::msg)?;
    match command {
        Command::Worker {
            model,
            host,
            port,
            served_model_name,
            kv_blocks,
            max_running,
            step_tokens,
            register,
            advertise,
            device,
            weights,
            numerics,
            role,
            kv_listen,
            kv_advertise,
            no_kv_direct,
        } => {
            let config = WorkerConfig {
                kv_direct: !no_kv_direct,
                role,
                kv_listen: kv_listen.unwrap_or(std::net::SocketAddr::new(host, 0)),
                kv_advertise,
                device,
                weights,
                numerics,
                register,
                advertise,
                register_token: std::env::var("SLUICE_ADMIN_TOKEN").ok(),
                model: model_path(model),
                served_name: served_model_name,
                engine: EngineConfig {
                    kv_blocks,
                    max_running,
                    step_tokens,
                    ..EngineConfig::default()
                },
            };
            tokio::runtime::Runtime::new()?.block_on(async {
                let addr = std::net::SocketAddr::new(host, port);
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on {addr}"))?;
                // The first line on stdout names the address (for --port 0).
                println!("listening on http://{}", listener.local_addr()?);
                anyhow::Ok(run_worker(listener, config).await?)
            })?;
        }
        Command::Serve {
            config,
            listen,
            model,
            workers,
            worker_urls,
            openai_urls,
            tokenizer,
            plugins_dir,
            device,
            prefill,
            decode,
            min_prefill_tokens,
        } => {
            let mut config = match (serve_config, config) {
                (Some(c), _) => c,
                (None, Some(path)) => Config::from_file(&path)?,
                (None, None) => Config::default(),
            };
            if let Some(listen) = listen {
                config.listen = listen;
            }
            config
                .workers
                .extend(worker_urls.iter().map(|u| WorkerEntry::from(u.as_str())));
            config.workers.extend(
                openai_urls
                    .iter()
                    .map(|u| WorkerEntry::Spec(WorkerSpec::openai(u))),
            );
            if tokenizer.is_some() {
                config.tokenizer = tokenizer;
            }
            if let Some(dir) = plugins_dir {
                config.plugins_dir = Some(dir);
            }
            if let Some(device) = device {
                config.device = device.to_string();
            }
            if let Some(n) = prefill {
                config.embedded_prefill = n;
            }
            if let Some(n) = decode {
                config.embedded_decode = n;
            }
            if let Some(n) = min_prefill_tokens {
                config.disaggregation.min_prefill_tokens = n;
            }
            match workers {
                Some(n) => config.embedded_workers = n,
                None if config.workers.is_empty() && config.in_process_workers() == 0 => {
                    config.embedded_workers = 1;
                }
                None => {}
            }
            // A gateway in front of OpenAI workers only needs no model.
            config.model = match model.or(config.model.take()) {
                Some(m) => Some(model_path(Some(m))),
                None if config.forwards_only() => None,
                None => Some(model_path(None)),
            };
            config.apply_env(&ProcessEnv)?;
            // Requests are served by the server threads' own runtimes; this
            // one runs the gateway's background tasks (worker monitors, the
            // plugins-folder watcher) and any in-process workers. Without
            // those, one thread: two would wake each other to share work
            // that one does in a fraction of its time.
            let runtime = match config.in_process_workers() {
                0 => tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()?,
                _ => tokio::runtime::Runtime::new()?,
            };
            runtime.block_on(async {
                let running = Gateway::start(config)
                    .await
                    .map_err(|e| anyhow::anyhow!(sluice_gateway::error_chain(&e)))?;
                let mut server = running.server;
                // Until SIGINT or SIGTERM; then stop accepting and let open
                // requests finish.
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                tracing::info!("shutting down");
                server.shutdown();
                tokio::task::spawn_blocking(move || server.join()).await??;
                anyhow::Ok(())
            })?;
        }
        Command::Sim { which } => run_sim(which)?,
        Command::Kernels {
            which: Kernels::Compile { arch },
        } => compile_kernels(&arch)?,
        Command::Plugins {
            which:
                Plugins::Replay {
                    plugin,
                    log,
                    config,
                    limit,
                },
        } => replay(&plugin, &log, &config, limit)?,
        Command::Plugins {
            which: Plugins::Check { file, kind, config },
        } => match kind {
            Kind::Router => check::<Router>(&file, &config),
            Kind::Admission => check::<Admission>(&file, &config),
            Kind::CachePolicy => check::<Cache>(&file, &config),
        }?,
        Command::Bench {
            which:
                Bench::Engine {
                    model,
                    device: Device::Cuda(ordinal),
                    synthetic_model,
                    batches,
                    context,
                    steps,
                    prompts,
                    vs_torch,
                    weights,
                    no_sweeps,
                    ..
                },
        } => {
            let synthetic = match (&model, synthetic_model) {
                (None, None) => Some("llama-3.1-8b".to_string()),
                (_, s) => s,
            };
            let options = CudaEngineBenchOptions {
                model,
                synthetic,
                ordinal,
                batches,
                context,
                steps,
                prompts,
                torch_script: vs_torch,
                weights,
                sweeps: !no_sweeps,
            };
            let summary = run_cuda_engine_bench(&options, |line| println!("{line}"))
                .context("sluice bench engine --device cuda")?;
            println!("{summary}");
        }
        Command::Bench {
            which:
                Bench::Engine {
                    model,
                    new_tokens,
                    vs_llamacpp,
                    ..
                },
        } => {
            let options = EngineBenchOptions {
                model: model_path(model),
                new_tokens,
                vs_llamacpp,
            };
            let summary = run_engine_bench(&options, |line| println!("{line}"))
                .context("sluice bench engine")?;
            println!("{summary}");
        }
        Command::Bench {
            which:
                Bench::Fp4 {
                    accuracy,
                    gemv,
                    prefill_tokens,
                    synthetic_model,
                    model,
                    max_tokens,
                },
        } => {
            anyhow::ensure!(accuracy || gemv, "say --accuracy, --gemv or both");
            if gemv {
                let summary =
                    run_fp4_gpu_bench(&synthetic_model, prefill_tokens, |line| println!("{line}"))
                        .context("sluice bench fp4 --gemv")?;
                println!("{summary}");
                if !accuracy {
                    return Ok(());
                }
            }
            let options = Fp4BenchOptions {
                model: model_path(model),
                texts: PathBuf::from(MT_BENCH),
                max_tokens,
            };
            let summary = run_fp4_accuracy_bench(&options, |line| println!("{line}"))
                .context("sluice bench fp4")?;
            println!("{summary}");
        }
        Command::Bench {
            which:
                Bench::Transfer {
                    device,
                    model,
                    prompt_tokens,
                    repeats,
                    pages,
                    synthetic_model,
                    ipc,
                    ipc_hold,
                },
        } => {
            use sluice_backend::compute::cuda::{Gpu, bench::peer_transfer};
            let Some(device) = device else {
                let options = sluice_gateway::bench::TransferBenchOptions {
                    model: model_path(model),
                    prompt_tokens,
                    repeats: repeats.max(1),
                };
                let summary = tokio::runtime::Runtime::new()?
                    .block_on(sluice_gateway::bench::run_transfer_bench(&options))
                    .context("sluice bench transfer")?;
                println!("{summary}");
                return Ok(());
            };
            let config = sluice_backend::model::LlamaConfig::preset(&synthetic_model)
                .with_context(|| format!("unknown shape {synthetic_model:?}"))?;
            if ipc_hold {
                let Device::Cuda(n) = device else {
                    anyhow::bail!("--ipc-hold needs --device cuda:N");
                };
                return hold_shared_cache(n, &config, pages);
            }
            anyhow::ensure!(
                device == Device::Cuda(0),
                "--device cuda (GPU 0 to GPU 1, or with --ipc to another process), or no --device for the TCP transport"
            );
            let src = Gpu::open(0)?;
            let (f, way) = if ipc {
                let (share, child) = spawn_shared_cache(&synthetic_model, pages)?;
                let f = sluice_backend::compute::cuda::bench::ipc_transfer(
                    &src, share, &config, pages, 16,
                )?;
                drop(child);
                (f, "cuda-ipc")
            } else {
                let dst = Gpu::open(1)?;
                (peer_transfer(&src, &dst, &config, pages, 16)?, "peer")
            };
            let mut line = serde_json::to_value(&f)?;
            line["bench"] = serde_json::json!("transfer");
            line["way"] = serde_json::json!(way);
            line["from"] = serde_json::json!(src.name);
            line["shape"] = serde_json::json!(synthetic_model);
            line["summary"] = serde_json::json!(true);
            println!("{line}");
        }
        Command::Bench {
            which:
                Bench::Gateway {
                    model,
                    plugins_dir,
                    rate,
                    seconds,
                    no_peer,
                    upstream_kind,
                    relay_child,
                },
        } => {
            if let Some(&[listen, upstream]) = relay_child.as_deref() {
                return Ok(sluice_gateway::bench::run_relay(listen, upstream)?);
            }
            let options = GatewayBenchOptions {
                model: model_path(model),
                plugins_dir,
                rate,
                seconds,
                peer: !no_peer,
                upstream_kind,
                ..GatewayBenchOptions::default()
            };
            let summary = run_gateway_bench(&options, |line| println!("{line}"))
                .context("sluice bench gateway")?;
            println!("{summary}");
        }
        Command::Bench {
            which:
                Bench::Routing {
                    quick,
                    traces,
                    loads,
                    policies,
                    workers,
                    prefill_workers,
                    min_prefill_tokens,
                    profile,
                    time_scale,
                    window,
                    model,
                    plugins_dir,
                    out,
                },
        } => {
            let mut options = RoutingBenchOptions::quick(model_path(model));
            options.prefill_workers = prefill_workers;
            options.min_prefill_tokens = min_prefill_tokens;
            if !quick {
                options.loads = vec![0.5, 0.8, 0.95];
                options.policies = [
                    "round-robin",
                    "least-load",
                    "kv-aware",
                    "session-affinity",
                    "sglang:cache_aware",
                    "sglang:round_robin",
                    "vllm:cache_aware",
                    "vllm:round_robin",
                ]
                .map(String::from)
                .to_vec();
            }
            options.plugins_dir = plugins_dir;
            options.out_dir = out;
            if !traces.is_empty() {
                let agentic = options.traces[0].clone();
                options.traces = traces
                    .iter()
                    .map(|t| match t.as_str() {
                        "agentic" => agentic.clone(),
                        "sharegpt" => TraceChoice::ShareGpt(PathBuf::from(SHAREGPT)),
                        "mt-bench" => TraceChoice::MtBench(PathBuf::from(MT_BENCH)),
                        file => TraceChoice::File(PathBuf::from(file)),
                    })
                    .collect();
            }
            if !loads.is_empty() {
                options.loads = loads;
            }
            if !policies.is_empty() {
                options.policies = policies;
            }
            if let Some(n) = workers {
                options.workers = n;
            }
            if let Some(name) = profile {
                options.profile = sluice_backend::sim::Profile::by_name(&name)
                    .with_context(|| format!("no profile {name}"))?;
            }
            if let Some(s) = time_scale {
                options.time_scale = s;
            }
            if let Some(w) = window {
                options.window_s = w;
            }
            let summary = run_routing_bench(&options, |line| println!("{line}"))
                .context("sluice bench routing")?;
            println!("{summary}");
        }
        Command::Bench {
            which:
                Bench::Plugins {
                    plugins_dir,
                    calls,
                    rounds,
                    quick,
                },
        } => {
            let mut options = PluginBenchOptions {
                plugins_dir,
                calls,
                rounds,
                ..PluginBenchOptions::default()
            };
            if quick {
                options.calls = options.calls.min(10_000);
                options.rounds = options.rounds.min(3);
                options.swaps = 3;
            }
            let summary = run_plugin_bench(&options, |line| println!("{line}"))
                .context("sluice bench plugins")?;
            println!("{summary}");
        }
    }
    Ok(())
}

/// Where `make data` puts ShareGPT and MT-Bench (../shared/DATA.md).
const SHAREGPT: &str = ".cache/data/ShareGPT_V3_unfiltered_cleaned_split.json";
const MT_BENCH: &str = ".cache/data/mt_bench_question.jsonl";

/// `sluice sim serve` and `sluice sim calibrate`.
fn run_sim(which: Sim) -> anyhow::Result<()> {
    use sluice_backend::sim::{Profile, SimFleet, SimOptions, calibrate};
    match which {
        Sim::Serve {
            workers,
            profile,
            time_scale,
            host,
            base_port,
            model,
            served_model_name,
            prefill_workers,
        } => {
            let profile = Profile::by_name(&profile).with_context(|| {
                format!(
                    "no profile {profile}; known: {}",
                    Profile::names().join(", ")
                )
            })?;
            let path = model_path(model);
            let info = sluice_backend::model::describe(&path)
                .with_context(|| format!("loading the tokenizer of {}", path.display()))?;
            let options = SimOptions {
                time_scale,
                host,
                base_port,
                model_name: served_model_name.unwrap_or(info.name),
                prefill_workers,
                ..SimOptions::new(profile, workers)
            };
            tokio::runtime::Runtime::new()?.block_on(async {
                let fleet = SimFleet::start(Arc::new(info.tokenizer), &options).await?;
                for url in &fleet.urls {
                    println!("{url}");
                }
                tokio::signal::ctrl_c().await?;
                anyhow::Ok(())
            })?;
        }
        Sim::Calibrate { model, rounds } => {
            let path = model_path(model);
            let loaded = sluice_backend::model::load(&path)
                .with_context(|| format!("loading {}", path.display()))?;
            let result = calibrate::calibrate(Arc::new(loaded.llama), 16, rounds);
            for point in &result.points {
                println!("{}", serde_json::to_string(point)?);
            }
            println!("{}", serde_json::to_string(&result.profile)?);
            println!(
                "{}",
                serde_json::json!({
                    "overhead_s": result.profile.overhead_s,
                    "token_s": result.profile.token_s,
                    "pair_s": result.profile.pair_s,
                    "kv_token_s": result.profile.kv_token_s,
                    "rms_relative_error": result.rms_relative_error,
                })
            );
        }
    }
    Ok(())
}

/// `--model`, else `$SLUICE_MODEL`, else the model `make model` fetches: in
/// the current folder's `.cache`, or in the checkout this binary was built in
/// (`target/release/sluice` -> the repository root).
fn model_path(model: Option<PathBuf>) -> PathBuf {
    if let Some(path) = model.or_else(|| std::env::var_os("SLUICE_MODEL").map(PathBuf::from)) {
        return path;
    }
    let here = PathBuf::from(DEFAULT_MODEL);
    if here.exists() {
        return here;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.ancestors().nth(3).map(|root| root.join(DEFAULT_MODEL)))
        .filter(|p| p.exists())
        .unwrap_or(here)
}

/// `sluice plugins replay`: prints the comparison as one JSON object.
fn replay(plugin: &Path, log: &Path, config: &str, limit: Option<u64>) -> anyhow::Result<()> {
    use sluice_gateway::plugins::WasmRouter;
    let bytes = std::fs::read(plugin).with_context(|| format!("reading {}", plugin.display()))?;
    let name = plugin
        .file_stem()
        .map_or_else(|| "plugin".into(), |s| s.to_string_lossy().into_owned());
    let runtime =
        Arc::new(Runtime::new(HostConfig::default()).map_err(|e| anyhow::anyhow!("{e:#}"))?);
    let router = WasmRouter::new(Arc::new(Slot::<Router>::new(runtime)));
    let (identity, _) = router.slot().load(&name, &bytes, config)?;
    let file = std::fs::File::open(log).with_context(|| format!("opening {}", log.display()))?;
    let report = sluice_gateway::routing::decision_log::replay(
        std::io::BufReader::new(file),
        |request, fleet| {
            let (decision, version) = router.route_traced(request, fleet);
            (decision, version.is_some())
        },
        limit,
    )
    .with_context(|| format!("reading {}", log.display()))?;
    if report.records == 0 {
        anyhow::bail!(
            "{} holds no decision records ({} malformed lines)",
            log.display(),
            report.malformed
        );
    }
    println!(
        "{}",
        serde_json::json!({"plugin": identity, "replay": report})
    );
    Ok(())
}

/// `sluice plugins check`: prints the identity and load time, or the refusal.
fn check<K: PluginKind>(file: &Path, config: &str) -> anyhow::Result<()> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let name = file
        .file_stem()
        .map_or_else(|| "plugin".into(), |s| s.to_string_lossy().into_owned());
    let runtime =
        Arc::new(Runtime::new(HostConfig::default()).map_err(|e| anyhow::anyhow!("{e:#}"))?);
    let slot = Slot::<K>::new(runtime);
    let (identity, timings) = slot.load(&name, &bytes, config)?;
    println!(
        "{}",
        serde_json::json!({
            "ok": true,
            "slot": K::INTERFACE,
            "plugin": identity.name,
            "digest": identity.digest,
            "validate_ms": timings.validate.as_secs_f64() * 1e3,
        })
    );
    Ok(())
}

/// `sluice kernels compile`: every kernel file for every architecture asked for.
fn compile_kernels(archs: &[String]) -> anyhow::Result<()> {
    use sluice_backend::compute::cuda::nvrtc::{KERNEL_FILES, compile, nvrtc_version};
    let (major, minor) = nvrtc_version()?;
    println!("NVRTC {major}.{minor}");
    let mut failed = 0;
    for file in KERNEL_FILES {
        for arch in archs {
            if !file.builds_for(arch) {
                println!(
                    "skip  {:<16} {arch:<8} (built for {} only)",
                    file.name,
                    file.only_for.join(", ")
                );
                continue;
            }
            let started = std::time::Instant::now();
            match compile(file, arch) {
                Ok(cubin) => println!(
                    "ok    {:<16} {arch:<8} {:>7} bytes  {:>5} ms",
                    file.name,
                    cubin.len(),
                    started.elapsed().as_millis()
                ),
                Err(e) => {
                    failed += 1;
                    println!("FAIL  {:<16} {arch:<8}\n{e}", file.name);
                }
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} kernel compilations failed");
    }
    Ok(())
}

/// `sluice bench transfer --ipc-hold`: a KV cache of `pages` pages on GPU
/// `n`, its share printed as one JSON line; held until standard input ends.
fn hold_shared_cache(
    n: usize,
    config: &sluice_backend::model::LlamaConfig,
    pages: usize,
) -> anyhow::Result<()> {
    use sluice_backend::compute::cuda::{CudaKvCache, Gpu, transfer::share_of};
    let gpu = Gpu::open(n)?;
    let cache = CudaKvCache::new(&gpu, config, pages, 16)?;
    println!("{}", serde_json::to_string(&share_of(&gpu, &cache)?)?);
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())?;
    drop(cache);
    Ok(())
}

/// A child `sluice` holding a shared cache (GPU 1 if there is one, else GPU
/// 0) and its share; the child ends when the returned handle is dropped
/// (its standard input closes).
fn spawn_shared_cache(
    shape: &str,
    pages: usize,
) -> anyhow::Result<(sluice_backend::transfer::KvShare, HeldCache)> {
    use std::io::BufRead;
    let gpu = usize::from(sluice_backend::compute::cuda::gpu_count() > 1);
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["bench", "transfer", "--ipc-hold", "--device"])
        .arg(format!("cuda:{gpu}"))
        .args(["--pages", &pages.to_string(), "--synthetic-model", shape])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the cache-holding child")?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("the child's stdout")?)
        .read_line(&mut line)?;
    let share =
        serde_json::from_str(&line).with_context(|| format!("the child's share line {line:?}"))?;
    Ok((share, HeldCache(child)))
}

/// The cache-holding child: dropped, its standard input closes and it ends.
struct HeldCache(std::process::Child);

impl Drop for HeldCache {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}
