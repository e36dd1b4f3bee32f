//! A test engine, only for the tests (not a product path): it speaks the
//! OpenAI API as vLLM does and publishes vLLM-format KV events over ZMQ
//! (frames `[topic, seq, msgpack batch]`, events as maps with a `type`, u64
//! block hashes of its own scheme, a ROUTER replay socket), one publisher
//! per data-parallel rank at the base port plus the rank. It caches every
//! full block of every prompt it serves (per rank, selected by the
//! `X-data-parallel-rank` header; SGLang's event encoding on request) and
//! answers with canned text, or, for a
//! request whose `model` names a recorded answer, with those bytes exactly.
//! Its publisher can be killed and restored while it keeps serving (the
//! batches published meanwhile are kept for replay, as vLLM's buffer does).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rmpv::Value as Msgpack;
use serde_json::{Value, json};
use sluice_backend::model::Tokenizer;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// One request the engine served: the rank and the prompt's token count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Served {
    pub rank: u32,
    pub prompt_tokens: usize,
}

/// A running test engine.
#[derive(Debug)]
pub struct OpenAiEngine {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// `tcp://127.0.0.1:<port>` of rank 0's publisher (rank r: port + r).
    pub kv_events: String,
    /// Rank 0's replay socket (rank r: port + r).
    pub kv_replay: String,
    state: Arc<EngineState>,
}

#[derive(Debug)]
struct EngineState {
    tokenizer: Arc<Tokenizer>,
    block_size: usize,
    ranks: Vec<Rank>,
    served: Mutex<Vec<Served>>,
    /// Recorded answers by name (the request's `model`).
    recorded: HashMap<String, Recorded>,
    /// How long a canned answer takes, in milliseconds.
    delay_ms: std::sync::atomic::AtomicU64,
    /// Events as SGLang writes them (arrays with the tag first, i64 hashes)
    /// instead of vLLM's maps.
    sglang: std::sync::atomic::AtomicBool,
}

/// A recorded answer: its content type and the chunks it arrives in.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub status: u16,
    pub content_type: &'static str,
    pub chunks: Vec<Bytes>,
}

#[derive(Debug)]
struct Rank {
    cached: Mutex<HashSet<u64>>,
    publisher: Mutex<Publisher>,
}

/// One rank's KV event publisher: batches numbered from 0, all kept for
/// replay; live sockets only while not killed.
#[derive(Debug)]
struct Publisher {
    next_seq: u64,
    /// Every batch published, for replay.
    sent: Arc<Mutex<Vec<(u64, Bytes)>>>,
    live: Option<mpsc::UnboundedSender<(u64, Bytes)>>,
    events_port: u16,
    replay_port: u16,
    rank: u32,
    /// Stops the replay socket's task.
    replay_stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// Batches still to keep off the live socket (they stay replayable): a
    /// subscriber sees a gap.
    drop_live: u32,
}

/// The ends of an open publisher's sockets.
type Sockets = (
    mpsc::UnboundedSender<(u64, Bytes)>,
    tokio::sync::oneshot::Sender<()>,
);

impl OpenAiEngine {
    /// Starts an engine with `ranks` data-parallel ranks, KV blocks of
    /// `block_size` tokens, and these recorded answers.
    pub async fn start(
        tokenizer: Arc<Tokenizer>,
        block_size: usize,
        ranks: u32,
        recorded: HashMap<String, Recorded>,
    ) -> OpenAiEngine {
        let (events_port, replay_port) = (free_ports(ranks), free_ports(ranks));
        let mut rank_states = Vec::new();
        for rank in 0..ranks {
            let sent = Arc::new(Mutex::new(Vec::new()));
            let (events_port, replay_port) = (events_port + rank as u16, replay_port + rank as u16);
            let (live, stop) = open_sockets(events_port, replay_port, sent.clone()).await;
            let publisher = Publisher {
                next_seq: 0,
                sent,
                live: Some(live),
                events_port,
                replay_port,
                rank,
                replay_stop: Some(stop),
                drop_live: 0,
            };
            rank_states.push(Rank {
                cached: Mutex::new(HashSet::new()),
                publisher: Mutex::new(publisher),
            });
        }
        let state = Arc::new(EngineState {
            tokenizer,
            block_size,
            ranks: rank_states,
            served: Mutex::new(Vec::new()),
            recorded,
            delay_ms: std::sync::atomic::AtomicU64::new(0),
            sglang: std::sync::atomic::AtomicBool::new(false),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/health", get(|| async { "" }))
            .route(
                "/v1/models",
                get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "test-engine", "object": "model"}]})) }),
            )
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        OpenAiEngine {
            url,
            kv_events: format!("tcp://127.0.0.1:{events_port}"),
            kv_replay: format!("tcp://127.0.0.1:{replay_port}"),
            state,
        }
    }

    /// Closes every rank's publisher and replay socket (the engine keeps
    /// serving; its batches are kept).
    pub fn kill_publisher(&self) {
        for rank in &self.state.ranks {
            let mut p = rank.publisher.lock().unwrap();
            p.live = None;
            p.replay_stop = None;
        }
    }

    /// Opens the publishers again on the same ports.
    pub async fn restore_publisher(&self) {
        for rank in &self.state.ranks {
            let (events, replay, sent) = {
                let p = rank.publisher.lock().unwrap();
                (p.events_port, p.replay_port, p.sent.clone())
            };
            // Opened outside the lock (binding awaits).
            let (live, stop) = open_sockets(events, replay, sent).await;
            let mut p = rank.publisher.lock().unwrap();
            p.live = Some(live);
            p.replay_stop = Some(stop);
        }
    }

    /// The next `n` batches of every rank are not sent live (as a slow
    /// subscriber loses them), only kept for replay.
    pub fn lose_batches(&self, n: u32) {
        for rank in &self.state.ranks {
            rank.publisher.lock().unwrap().drop_live = n;
        }
    }

    /// Empties every rank's cache (`AllBlocksCleared`).
    pub fn clear_cache(&self) {
        for rank in &self.state.ranks {
            rank.cached.lock().unwrap().clear();
            let event = self.state.event("AllBlocksCleared", vec![]);
            rank.publisher.lock().unwrap().publish(vec![event]);
        }
    }

    /// From now on, events are written as SGLang writes them.
    pub fn publish_as_sglang(&self) {
        self.state
            .sglang
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Canned answers (chat and completions) take `delay` from now on.
    pub fn set_delay(&self, delay: Duration) {
        self.state.delay_ms.store(
            delay.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Requests served so far.
    pub fn served(&self) -> Vec<Served> {
        self.state.served.lock().unwrap().clone()
    }
}

/// `n` consecutive free ports (the first of them).
fn free_ports(n: u32) -> u16 {
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if u32::from(port) + n >= 65_535 {
            continue;
        }
        let rest: Result<Vec<_>, _> = (1..n)
            .map(|i| std::net::TcpListener::bind(("127.0.0.1", port + i as u16)))
            .collect();
        if rest.is_ok() {
            return port;
        }
    }
}

/// Binds a PUB socket and a replay ROUTER socket; a task owns each. The
/// PUB closes when its sender is dropped, the ROUTER when its stop is.
async fn open_sockets(
    events_port: u16,
    replay_port: u16,
    sent: Arc<Mutex<Vec<(u64, Bytes)>>>,
) -> Sockets {
    let mut publisher = zeromq::PubSocket::new();
    bind_retrying(&mut publisher, events_port).await;
    let (live, mut rx) = mpsc::unbounded_channel::<(u64, Bytes)>();
    tokio::spawn(async move {
        while let Some((seq, payload)) = rx.recv().await {
            let message = ZmqMessage::try_from(vec![
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ])
            .unwrap();
            let _ = publisher.send(message).await;
        }
    });
    let mut router = zeromq::RouterSocket::new();
    bind_retrying(&mut router, replay_port).await;
    let (stop_tx, mut stop) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        loop {
            let request = tokio::select! {
                r = router.recv() => r,
                _ = &mut stop => break,
            };
            let Ok(request) = request else { continue };
            // [client identity, "", from] as vLLM's replay socket reads it.
            let frames = request.into_vec();
            let [client, _, from] = &frames[..] else {
                continue;
            };
            let from = u64::from_be_bytes(from.as_ref().try_into().unwrap_or([0; 8]));
            let batches: Vec<(u64, Bytes)> = sent
                .lock()
                .unwrap()
                .iter()
                .filter(|(s, _)| *s >= from)
                .cloned()
                .collect();
            for (seq, payload) in batches {
                let reply = ZmqMessage::try_from(vec![
                    client.clone(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ])
                .unwrap();
                let _ = router.send(reply).await;
            }
            let end = ZmqMessage::try_from(vec![
                client.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                Bytes::new(),
            ])
            .unwrap();
            let _ = router.send(end).await;
        }
    });
    (live, stop_tx)
}

impl Publisher {
    /// Numbers, keeps and (when live) sends one batch of events.
    fn publish(&mut self, events: Vec<Msgpack>) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let batch = Msgpack::Array(vec![
            Msgpack::from(ts),
            Msgpack::Array(events),
            Msgpack::from(self.rank),
        ]);
        let mut payload = Vec::new();
        rmpv::encode::write_value(&mut payload, &batch).unwrap();
        let payload = Bytes::from(payload);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.sent.lock().unwrap().push((seq, payload.clone()));
        if self.drop_live > 0 {
            self.drop_live -= 1;
        } else if let Some(live) = &self.live {
            let _ = live.send((seq, payload));
        }
    }
}

/// Binds a socket to a loopback port, retrying while the port is still
/// held by the socket closed before it.
async fn bind_retrying<S: Socket>(socket: &mut S, port: u16) {
    let endpoint = format!("tcp://127.0.0.1:{port}");
    for _ in 0..100 {
        if socket.bind(&endpoint).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("cannot bind {endpoint}");
}

/// The engine's own block hash (not the gateway's scheme, as vLLM's is
/// not): FNV-1a over the parent hash and the tokens.
fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = parent.unwrap_or(0).to_le_bytes().to_vec();
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    fnv1a(&bytes) | (1 << 63) // past i64::MAX, as vLLM's u64 hashes often are
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl EngineState {
    fn sglang(&self) -> bool {
        self.sglang.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One event: vLLM's map with a `type`, or SGLang's array with the tag
    /// first and the fields in order (it has no `lora_name`).
    fn event(&self, kind: &str, fields: Vec<(&str, Msgpack)>) -> Msgpack {
        if self.sglang() {
            let mut items = vec![Msgpack::from(kind)];
            items.extend(
                fields
                    .into_iter()
                    .filter(|(k, _)| *k != "lora_name")
                    .map(|(_, v)| v),
            );
            return Msgpack::Array(items);
        }
        let mut map = vec![(Msgpack::from("type"), Msgpack::from(kind))];
        map.extend(fields.into_iter().map(|(k, v)| (Msgpack::from(k), v)));
        Msgpack::Map(map)
    }

    /// A block hash as the engine writes it: u64 (vLLM) or i64 (SGLang).
    fn hash_value(&self, hash: u64) -> Msgpack {
        match self.sglang() {
            true => Msgpack::from(hash as i64),
            false => Msgpack::from(hash),
        }
    }

    async fn pause(&self) {
        let ms = self.delay_ms.load(std::sync::atomic::Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// Caches the prompt's full blocks on `rank` and publishes the new ones
    /// as one `BlockStored` (with the parent of the first new block).
    fn cache_prompt(&self, rank: u32, prompt: &[u32]) {
        let Some(r) = self.ranks.get(rank as usize) else {
            return;
        };
        let mut cached = r.cached.lock().unwrap();
        let mut parent = None;
        let mut new_hashes = Vec::new();
        let mut new_tokens = Vec::new();
        let mut new_parent = None;
        for block in prompt.chunks_exact(self.block_size) {
            let hash = engine_hash(parent, block);
            if cached.insert(hash) {
                if new_hashes.is_empty() {
                    new_parent = parent;
                }
                new_hashes.push(self.hash_value(hash));
                new_tokens.extend(block.iter().map(|&t| Msgpack::from(t)));
            }
            parent = Some(hash);
        }
        if new_hashes.is_empty() {
            return;
        }
        let event = self.event(
            "BlockStored",
            vec![
                ("block_hashes", Msgpack::Array(new_hashes)),
                (
                    "parent_block_hash",
                    new_parent.map_or(Msgpack::Nil, |p| self.hash_value(p)),
                ),
                ("token_ids", Msgpack::Array(new_tokens)),
                ("block_size", Msgpack::from(self.block_size as u64)),
                ("lora_id", Msgpack::Nil),
                ("medium", Msgpack::from("GPU")),
                ("lora_name", Msgpack::Nil),
            ],
        );
        r.publisher.lock().unwrap().publish(vec![event]);
    }
}

/// The rank a request names (`X-data-parallel-rank`), else 0.
fn rank_of(headers: &HeaderMap) -> u32 {
    headers
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn chat(State(state): State<Arc<EngineState>>, headers: HeaderMap, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": {"message": "bad JSON"}})),
        )
            .into_response();
    };
    let messages: Vec<Value> = request["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|mut m| {
            if let Some(parts) = m["content"].as_array() {
                let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
                m["content"] = Value::String(text.join("\n"));
            }
            m
        })
        .collect();
    let text = state
        .tokenizer
        .apply_chat_template_json(&Value::Array(messages), request.get("tools"), true)
        .unwrap_or_default();
    let prompt = state
        .tokenizer
        .encode_without_bos(&text)
        .unwrap_or_default();
    state.pause().await;
    answer(&state, &headers, &request, &prompt, "chat.completion")
}

async fn completions(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": {"message": "bad JSON"}})),
        )
            .into_response();
    };
    let prompt = state
        .tokenizer
        .encode(request["prompt"].as_str().unwrap_or_default())
        .unwrap_or_default();
    state.pause().await;
    answer(&state, &headers, &request, &prompt, "text_completion")
}

fn answer(
    state: &EngineState,
    headers: &HeaderMap,
    request: &Value,
    prompt: &[u32],
    object: &str,
) -> Response {
    let rank = rank_of(headers);
    state.cache_prompt(rank, prompt);
    state.served.lock().unwrap().push(Served {
        rank,
        prompt_tokens: prompt.len(),
    });
    if let Some(recorded) = request["model"]
        .as_str()
        .and_then(|m| state.recorded.get(m))
    {
        // Chunk by chunk, with pauses, so chunk boundaries are exercised.
        let chunks = recorded.chunks.clone();
        let stream = async_stream(chunks);
        return Response::builder()
            .status(recorded.status)
            .header(header::CONTENT_TYPE, recorded.content_type)
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let usage = json!({"prompt_tokens": prompt.len(), "completion_tokens": 2, "total_tokens": prompt.len() + 2});
    if request["stream"] == true {
        let mut text = String::new();
        for piece in ["Hel", "lo"] {
            let chunk = json!({"id": "cmpl-test", "object": format!("{object}.chunk"), "model": "test-engine",
                "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": null}]});
            text.push_str(&format!("data: {chunk}\n\n"));
        }
        let last = json!({"id": "cmpl-test", "object": format!("{object}.chunk"), "model": "test-engine", "choices": [], "usage": usage});
        text.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
        return ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response();
    }
    axum::Json(json!({"id": "cmpl-test", "object": object, "model": "test-engine",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}],
        "usage": usage}))
    .into_response()
}

/// The chunks as a body stream, 2 ms apart.
fn async_stream(
    chunks: Vec<Bytes>,
) -> impl tokio_stream::Stream<Item = Result<Bytes, std::io::Error>> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        for c in chunks {
            if tx.send(Ok(c)).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
}
