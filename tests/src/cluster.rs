//! A real fleet for end-to-end tests: the gateway in this process, and
//! `sluice worker` processes serving SmolLM2 that register with it over HTTP
//! (`--register`), each of which a test can kill.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_gateway::{Config, Gateway, Running};

/// The admin token the test gateways use.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// The SmolLM2 GGUF that `make model` fetches (or `$SLUICE_MODEL`).
pub fn model_path() -> PathBuf {
    sluice_backend::model::fetched_model(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
}

/// The `sluice` binary of this build (`cargo test --workspace` builds it for
/// the gateway's own tests); built here if it is missing.
pub fn sluice_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> -> target/<profile>/sluice
    let profile_dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = profile_dir.join("sluice");
    if !bin.exists() {
        let release = profile_dir.ends_with("release");
        let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cargo.args(["build", "-p", "sluice-gateway", "--bin", "sluice"]);
        if release {
            cargo.arg("--release");
        }
        let status = cargo.status().expect("running cargo build");
        assert!(status.success(), "cargo build of the sluice binary failed");
    }
    bin
}

/// A gateway and its worker processes; dropping it kills the workers.
#[derive(Debug)]
pub struct Cluster {
    pub gateway: Running,
    /// `http://127.0.0.1:<port>` of the gateway.
    pub url: String,
    /// (worker URL, process); `None` once killed.
    workers: Vec<(String, Option<Child>)>,
    pub client: reqwest::Client,
    /// Sent as the bearer token of `/v1` requests.
    pub api_key: Option<String>,
}

impl Cluster {
    /// Starts the gateway (after `configure` edits its config) and `workers`
    /// worker processes, and waits until all of them are in service.
    pub async fn start(workers: usize, configure: impl FnOnce(&mut Config)) -> Cluster {
        let mut config = Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            model: Some(model_path()),
            admin_token: Some(ADMIN_TOKEN.into()),
            ..Config::default()
        };
        config.fleet.heartbeat_timeout_ms = 1_500;
        config.fleet.reconnect_ms = 200;
        configure(&mut config);
        let gateway = Gateway::start(config).await.expect("gateway starts");
        let url = format!("http://{}", gateway.addr);
        let mut cluster = Cluster {
            gateway,
            url,
            workers: Vec::new(),
            client: reqwest::Client::new(),
            api_key: None,
        };
        for _ in 0..workers {
            cluster.add_worker();
        }
        cluster.wait_for_workers(workers).await;
        cluster
    }

    /// Starts one more worker process that registers itself.
    pub fn add_worker(&mut self) -> String {
        self.add_worker_with(&[])
    }

    /// [`Cluster::add_worker`] with more `sluice worker` arguments.
    ///
    /// The worker binds any free port itself (`--port 0`) and names it on its
    /// first line of stdout: a port picked here and handed over could be
    /// taken by another test's socket in between.
    pub fn add_worker_with(&mut self, args: &[&str]) -> String {
        let mut child = Command::new(sluice_bin())
            .args(["worker", "--port", "0", "--kv-blocks", "256"])
            .args(args)
            .arg("--model")
            .arg(model_path())
            .args(["--register", &self.url])
            .env("SLUICE_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting a sluice worker");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut first = String::new();
        stdout
            .read_line(&mut first)
            .expect("reading the worker's stdout");
        let url = match first.trim().strip_prefix("listening on ") {
            Some(url) => url.to_string(),
            None => {
                let _ = child.kill();
                panic!("the worker did not say where it listens (stdout: {first:?})")
            }
        };
        // The rest of its stdout, passed on (a closed pipe would fail its writes).
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                println!("{line}");
            }
        });
        self.workers.push((url.clone(), Some(child)));
        url
    }

    /// Polls `GET /admin/workers` every `every` until `check` accepts the
    /// list; fails with `check`'s last complaint once `limit` has passed.
    pub async fn wait_workers(
        &self,
        limit: Duration,
        every: Duration,
        check: impl Fn(&[Value]) -> Result<(), String>,
    ) {
        let started = Instant::now();
        loop {
            let complaint = match check(&self.workers_status().await) {
                Ok(()) => return,
                Err(complaint) => complaint,
            };
            assert!(started.elapsed() < limit, "{complaint}");
            tokio::time::sleep(every).await;
        }
    }

    /// Waits until `n` workers are in service (at most 60 s).
    pub async fn wait_for_workers(&self, n: usize) {
        let check = |workers: &[Value]| {
            let healthy = workers.iter().filter(|w| w["healthy"] == true).count();
            match healthy >= n {
                true => Ok(()),
                false => Err(format!("only {healthy} of {n} workers came up in 60 s")),
            }
        };
        self.wait_workers(Duration::from_secs(60), Duration::from_millis(50), check)
            .await;
    }

    /// Waits (at most 10 s) until the gateway's KV index holds at least
    /// `blocks` blocks of worker `id` (its KV events have arrived).
    pub async fn wait_cached_blocks(&self, id: u64, blocks: u64) {
        let check = |workers: &[Value]| {
            let cached = workers
                .iter()
                .find(|w| w["id"] == id)
                .map_or(0, |w| w["cached_blocks"].as_u64().unwrap_or(0));
            match cached >= blocks {
                true => Ok(()),
                false => Err(format!(
                    "worker {id}'s KV events never arrived ({cached} of {blocks} blocks)"
                )),
            }
        };
        self.wait_workers(Duration::from_secs(10), Duration::from_millis(20), check)
            .await;
    }

    /// Waits (at most 4 s) until the gateway counts `n` requests in flight.
    pub async fn wait_in_flight(&self, n: u64) {
        let check = |workers: &[Value]| {
            let in_flight: u64 = workers.iter().filter_map(|w| w["in_flight"].as_u64()).sum();
            match in_flight >= n {
                true => Ok(()),
                false => Err(format!("{in_flight} requests in flight, waited for {n}")),
            }
        };
        self.wait_workers(Duration::from_secs(4), Duration::from_millis(5), check)
            .await;
    }

    /// `GET /admin/workers`.
    pub async fn workers_status(&self) -> Vec<Value> {
        self.admin_get("/admin/workers").await["workers"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    pub async fn admin_get(&self, path: &str) -> Value {
        self.client
            .get(format!("{}{path}", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("admin GET")
            .json()
            .await
            .expect("admin JSON")
    }

    /// `PUT /admin/plugins/{slot}`: the answer's status and body.
    pub async fn put_plugin(&self, slot: &str, name: &str, config: &str) -> (u16, Value) {
        let r = self
            .client
            .put(format!("{}/admin/plugins/{slot}", self.url))
            .query(&[("config", config), ("name", name)])
            .bearer_auth(ADMIN_TOKEN)
            .body(crate::plugin_wasm(name))
            .send()
            .await
            .expect("PUT plugin");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// The gateway id of the worker at `url`.
    pub async fn worker_id(&self, url: &str) -> u64 {
        self.workers_status()
            .await
            .iter()
            .find(|w| w["url"] == url)
            .and_then(|w| w["id"].as_u64())
            .unwrap_or_else(|| panic!("no worker {url} in the fleet"))
    }

    /// The URL of the worker with gateway id `id`.
    pub async fn worker_url(&self, id: u64) -> String {
        self.workers_status()
            .await
            .iter()
            .find(|w| w["id"] == id)
            .and_then(|w| w["url"].as_str().map(String::from))
            .unwrap_or_else(|| panic!("no worker {id} in the fleet"))
    }

    /// Kills (SIGKILL) the worker process at `url`.
    pub fn kill_worker(&mut self, url: &str) {
        let (_, child) = self
            .workers
            .iter_mut()
            .find(|(u, _)| u == url)
            .unwrap_or_else(|| panic!("no worker process at {url}"));
        if let Some(mut c) = child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A POST to the gateway with the cluster's API key, if any.
    pub fn request(&self, path: &str) -> reqwest::RequestBuilder {
        let r = self
            .client
            .post(format!("{}{path}", self.url))
            .timeout(Duration::from_secs(120));
        match &self.api_key {
            Some(key) => r.bearer_auth(key),
            None => r,
        }
    }

    /// Sends a signal (`libc::SIGSTOP`, `libc::SIGCONT`, ...) to the worker
    /// process at `url`.
    pub fn signal_worker(&self, url: &str, signal: libc::c_int) {
        let pid = self
            .workers
            .iter()
            .find(|(u, _)| u == url)
            .and_then(|(_, c)| c.as_ref())
            .map(|c| c.id())
            .unwrap_or_else(|| panic!("no live worker process at {url}"));
        // SAFETY: kill(2) on a child process id this cluster started and still
        // owns (it has not been waited for, so the id is not reused).
        let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal}) failed");
    }

    /// Waits (at most 30 s) until the worker `id` is in service or not.
    pub async fn wait_health(&self, id: u64, healthy: bool) {
        let started = Instant::now();
        loop {
            let now = self
                .workers_status()
                .await
                .iter()
                .find(|w| w["id"] == id)
                .is_some_and(|w| w["healthy"] == healthy);
            if now {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "worker {id} never became healthy={healthy}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// POSTs `body` to `path` and returns (status, headers, JSON body).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
        let r = self.request(path).json(body).send().await.expect("POST");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        (status, headers, r.json().await.unwrap_or(Value::Null))
    }

    /// A streaming POST: (status, headers, each `data:` payload in order).
    pub async fn post_stream(
        &self,
        path: &str,
        body: &Value,
    ) -> (u16, reqwest::header::HeaderMap, Vec<String>) {
        let r = self.request(path).json(body).send().await.expect("POST");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap_or_default();
        (status, headers, sse_data(&text))
    }

    /// `GET /metrics`' value of `series` (exact name with labels), or 0.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self
            .client
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.workers {
            if let Some(c) = child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.gateway.server.shutdown();
    }
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(String::from)
        .collect()
}

/// The system prompt of the multi-turn tests: long enough for several KV blocks.
pub const LIBRARY_SYSTEM: &str = "You are a careful assistant for a library. You answer \
    questions about opening hours, loans, renewals and fines in short, friendly sentences, \
    and you never invent facts that the library has not told you about.";

/// The second turn of a conversation: `question` answered with `reply`, then
/// a follow-up.
pub fn follow_up(question: &str, reply: &str, max_tokens: u32) -> Value {
    chat(
        &[
            ("system", LIBRARY_SYSTEM),
            ("user", question),
            ("assistant", reply),
            ("user", "And on Sunday?"),
        ],
        max_tokens,
    )
}

/// A chat request body.
pub fn chat(messages: &[(&str, &str)], max_tokens: u32) -> Value {
    json!({
        "messages": messages.iter().map(|(role, content)| json!({"role": role, "content": content})).collect::<Vec<_>>(),
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}
