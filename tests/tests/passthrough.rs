//! The gateway in front of OpenAI-compatible engines (`kind = "openai"`):
//! routing by the engines' vLLM-format KV events, the fall back to
//! approximate mode and the resync, data-parallel ranks, and answers relayed
//! byte for byte. The engines are the tests' own (`openai_engine`), real
//! HTTP and real ZMQ; the gateway is the real one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use serde_json::{Value, json};
use sluice_gateway::config::{WorkerEntry, WorkerSpec};
use sluice_tests::cluster::{Cluster, model_path};
use sluice_tests::openai_engine::{OpenAiEngine, Recorded, Served};

fn tokenizer() -> Arc<sluice_backend::model::Tokenizer> {
    Arc::new(sluice_backend::model::load_tokenizer(&model_path()).expect("the SmolLM2 tokenizer"))
}

/// A worker entry for `engine`, with its KV events when `events`.
fn entry(engine: &OpenAiEngine, events: bool, ranks: u32) -> WorkerEntry {
    let mut spec = WorkerSpec::openai(&engine.url);
    if events {
        spec.kv_events = Some(engine.kv_events.clone());
        spec.kv_replay = Some(engine.kv_replay.clone());
    }
    spec.dp_ranks = ranks;
    WorkerEntry::Spec(spec)
}

/// A gateway with no model of its own (the SmolLM2 tokenizer for routing)
/// in front of these workers; waits until `n` are in service.
async fn gateway(workers: Vec<WorkerEntry>, n: usize) -> Cluster {
    let cluster = Cluster::start(0, |c| {
        c.model = None;
        c.tokenizer = Some(model_path());
        c.workers = workers;
    })
    .await;
    cluster.wait_for_workers(n).await;
    cluster
}

/// A conversation whose system prompt (several KV blocks) is `topic`'s.
fn conversation(topic: &str, question: &str) -> Value {
    let system = format!(
        "{topic} help desk. You are the help desk of the {topic}. You answer questions about the {topic} in short, \
         friendly sentences, you say so when you do not know, and you never invent facts about \
         the {topic} that nobody has told you about. Keep every answer under fifty words."
    );
    json!({
        "model": "test-engine",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
    })
}

async fn post_direct(url: &str, body: &Value, rank: Option<u32>) {
    let mut r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(body);
    if let Some(rank) = rank {
        r = r.header("x-data-parallel-rank", rank);
    }
    let r = r.send().await.expect("POST to the engine");
    assert_eq!(r.status(), 200);
}

/// The worker that served a request through the gateway, and its cached blocks.
async fn routed(cluster: &Cluster, body: &Value) -> (u64, u64) {
    let (status, headers, answer) = cluster.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{answer}");
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} header"))
    };
    (header("x-sluice-worker"), header("x-sluice-cached-blocks"))
}

async fn worker_field(cluster: &Cluster, id: u64, field: &str) -> Value {
    cluster
        .workers_status()
        .await
        .into_iter()
        .find(|w| w["id"] == id)
        .map(|w| w[field].clone())
        .unwrap_or(Value::Null)
}

/// Waits (at most 15 s) until worker `id`'s `kv_mode` is `mode`.
async fn wait_mode(cluster: &Cluster, id: u64, mode: &str) {
    let check = |workers: &[Value]| match workers
        .iter()
        .any(|w| w["id"] == id && w["kv_mode"] == mode)
    {
        true => Ok(()),
        false => Err(format!("worker {id} never went to {mode} mode")),
    };
    cluster
        .wait_workers(Duration::from_secs(15), Duration::from_millis(50), check)
        .await;
}

async fn ids(cluster: &Cluster) -> Vec<u64> {
    cluster
        .workers_status()
        .await
        .iter()
        .filter_map(|w| w["id"].as_u64())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_follows_the_engines_kv_events_falls_back_and_resyncs() {
    let tok = tokenizer();
    let a = OpenAiEngine::start(tok.clone(), 16, 1, HashMap::new()).await;
    let b = OpenAiEngine::start(tok.clone(), 16, 1, HashMap::new()).await;
    let cluster = gateway(vec![entry(&a, true, 1), entry(&b, true, 1)], 2).await;
    let (id_a, id_b) = (ids(&cluster).await[0], ids(&cluster).await[1]);
    wait_mode(&cluster, id_a, "events").await;
    wait_mode(&cluster, id_b, "events").await;
    // Each engine is sent a conversation directly, past the gateway: only
    // its KV events tell the gateway.
    let museum = conversation("city museum", "When do you open?");
    let zoo = conversation("city zoo", "When do you open?");
    post_direct(&a.url, &museum, None).await;
    post_direct(&b.url, &zoo, None).await;
    cluster.wait_cached_blocks(id_a, 4).await;
    cluster.wait_cached_blocks(id_b, 4).await;
    for _ in 0..3 {
        let (worker, cached) = routed(&cluster, &conversation("city museum", "Is it free?")).await;
        assert_eq!(worker, id_a, "the museum's prefix is cached on A");
        assert!(cached >= 3, "{cached} cached blocks");
        let (worker, _) = routed(&cluster, &conversation("city zoo", "Is it free?")).await;
        assert_eq!(worker, id_b, "the zoo's prefix is cached on B");
    }
    // B's publisher dies: B is in approximate mode, the rest still routes.
    b.kill_publisher();
    wait_mode(&cluster, id_b, "approximate").await;
    assert_eq!(worker_field(&cluster, id_a, "kv_mode").await, "events");
    let (worker, _) = routed(&cluster, &conversation("city zoo", "Can I feed them?")).await;
    assert_eq!(worker, id_b, "what B held is predicted there still");
    // Meanwhile B caches the aquarium's prompt; the gateway cannot know.
    let aquarium = conversation("city aquarium", "When do you open?");
    post_direct(&b.url, &aquarium, None).await;
    // Restored, B's events are replayed: exact again, the aquarium on B.
    b.restore_publisher().await;
    wait_mode(&cluster, id_b, "events").await;
    cluster.wait_cached_blocks(id_b, 8).await;
    let (worker, cached) = routed(&cluster, &conversation("city aquarium", "Is it free?")).await;
    assert_eq!(worker, id_b, "the replayed events put the aquarium on B");
    assert!(cached >= 3, "{cached} cached blocks");
    // SGLang's encoding (arrays, i64 hashes) is read alike.
    a.publish_as_sglang();
    let held = worker_field(&cluster, id_a, "cached_blocks").await;
    post_direct(&a.url, &conversation("city library", "Hi"), None).await;
    cluster
        .wait_cached_blocks(id_a, held.as_u64().unwrap() + 3)
        .await;
    let (worker, cached) = routed(&cluster, &conversation("city library", "Is it free?")).await;
    assert_eq!(worker, id_a, "SGLang-format events put the library on A");
    assert!(cached >= 3, "{cached} cached blocks");
    // A cleared cache is cleared in the index too.
    a.clear_cache();
    let started = Instant::now();
    while worker_field(&cluster, id_a, "cached_blocks").await != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "A's clear never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_in_sequence_numbers_is_replayed_or_else_approximate() {
    let tok = tokenizer();
    let replayed = OpenAiEngine::start(tok.clone(), 16, 1, HashMap::new()).await;
    let unreplayed = OpenAiEngine::start(tok.clone(), 16, 1, HashMap::new()).await;
    let mut no_replay = WorkerSpec::openai(&unreplayed.url);
    no_replay.kv_events = Some(unreplayed.kv_events.clone());
    let cluster = gateway(
        vec![entry(&replayed, true, 1), WorkerEntry::Spec(no_replay)],
        2,
    )
    .await;
    let (with, without) = (ids(&cluster).await[0], ids(&cluster).await[1]);
    // Without a replay socket, what an engine published before is unknown
    // until its batch 0 is heard.
    assert_eq!(
        worker_field(&cluster, without, "kv_mode").await,
        "approximate"
    );
    for engine in [&replayed, &unreplayed] {
        post_direct(&engine.url, &conversation("harbour", "Hi"), None).await;
    }
    wait_mode(&cluster, with, "events").await;
    wait_mode(&cluster, without, "events").await;
    for engine in [&replayed, &unreplayed] {
        // One batch is lost on the way; the next one shows the gap.
        engine.lose_batches(1);
        post_direct(&engine.url, &conversation("city museum", "Hi"), None).await;
        post_direct(&engine.url, &conversation("city zoo", "Hi"), None).await;
    }
    // Replayed: the lost museum blocks are in the index, still exact.
    cluster.wait_cached_blocks(with, 12).await;
    assert_eq!(worker_field(&cluster, with, "kv_mode").await, "events");
    let (worker, _) = routed(&cluster, &conversation("city museum", "Is it free?")).await;
    assert_eq!(worker, with, "the replayed batch put the museum there");
    // No replay socket: the history has a hole, the worker is approximate.
    wait_mode(&cluster, without, "approximate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_sends_each_session_back_where_it_went() {
    sessions_return_in_approximate_mode(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_tokenizer_sessions_are_routed_by_their_text() {
    sessions_return_in_approximate_mode(false).await;
}

/// Two engines with no KV events; the gateway routes with the tokenizer or
/// (without) by blocks of the prompt's characters.
async fn sessions_return_in_approximate_mode(with_tokenizer: bool) {
    let tok = tokenizer();
    let a = OpenAiEngine::start(tok.clone(), 16, 1, HashMap::new()).await;
    let b = OpenAiEngine::start(tok.clone(), 16, 1, HashMap::new()).await;
    let cluster = Cluster::start(0, |c| {
        c.model = None;
        c.tokenizer = with_tokenizer.then(model_path);
        c.workers = vec![entry(&a, false, 1), entry(&b, false, 1)];
    })
    .await;
    cluster.wait_for_workers(2).await;
    for id in ids(&cluster).await {
        assert_eq!(worker_field(&cluster, id, "kv_mode").await, "approximate");
    }
    let topics = [
        "harbour",
        "library",
        "stadium",
        "theatre",
        "airport",
        "observatory",
    ];
    // First turns held in flight (each takes 5 s), each sent only once the
    // gateway counts the ones before it in flight, so that the router sees
    // their load whatever the machine's timing: the load spreads them.
    // (Until 2026-12-01 the test engine ignored the delay on chat requests,
    // so whether the six overlapped was luck, and two CI runs sent all six
    // to one worker.)
    for engine in [&a, &b] {
        engine.set_delay(Duration::from_secs(5));
    }
    let first_turns = topics.iter().enumerate().map(|(k, topic)| {
        let body = conversation(topic, "When do you open?");
        let cluster = &cluster;
        async move {
            cluster.wait_in_flight(k as u64).await;
            routed(cluster, &body).await.0
        }
    });
    let first = futures_util::future::join_all(first_turns).await;
    for engine in [&a, &b] {
        engine.set_delay(Duration::ZERO);
    }
    assert!(
        first.contains(&ids(&cluster).await[0]) && first.contains(&ids(&cluster).await[1]),
        "new sessions spread over both workers: {first:?}"
    );
    for (topic, worker) in topics.iter().zip(&first) {
        let (again, cached) = routed(&cluster, &conversation(topic, "Is it free?")).await;
        assert_eq!(
            again, *worker,
            "{topic}'s follow-up goes where its prefix went"
        );
        assert!(cached >= 3, "{topic}: {cached} predicted blocks");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_and_openai_workers_serve_side_by_side() {
    let engine = OpenAiEngine::start(tokenizer(), 16, 1, HashMap::new()).await;
    // The gateway serves SmolLM2 (its own worker process registers) and
    // forwards to the OpenAI engine too.
    let mut cluster = Cluster::start(0, |c| c.workers = vec![entry(&engine, true, 1)]).await;
    cluster.add_worker();
    cluster.wait_for_workers(2).await;
    engine.set_delay(Duration::from_millis(1_500));
    let topics = ["harbour", "library", "stadium", "theatre"];
    let first_turns = topics.map(|topic| {
        let mut body = conversation(topic, "When do you open?");
        // Both kinds take it: no model name that only one of them serves.
        body.as_object_mut().unwrap().remove("model");
        let cluster = &cluster;
        async move {
            let (status, headers, answer) = cluster.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{answer}");
            assert!(
                answer["choices"][0]["message"]["content"].is_string(),
                "{answer}"
            );
            headers["x-sluice-worker"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        }
    });
    let served = futures_util::future::join_all(first_turns).await;
    let ids = ids(&cluster).await;
    assert!(
        ids.iter().all(|id| served.contains(id)),
        "both kinds of worker served: {served:?} of {ids:?}"
    );
    engine.set_delay(Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_data_parallel_rank_is_a_worker_of_its_own() {
    let tok = tokenizer();
    let engine = OpenAiEngine::start(tok.clone(), 16, 2, HashMap::new()).await;
    let cluster = gateway(vec![entry(&engine, true, 2)], 2).await;
    let workers = cluster.workers_status().await;
    let rank_of = |id: u64| {
        workers
            .iter()
            .find(|w| w["id"] == id)
            .and_then(|w| w["dp_rank"].as_u64())
            .expect("a rank")
    };
    for w in &workers {
        wait_mode(&cluster, w["id"].as_u64().unwrap(), "events").await;
    }
    // Rank 1 caches the museum, rank 0 the zoo.
    post_direct(&engine.url, &conversation("city museum", "Hi"), Some(1)).await;
    post_direct(&engine.url, &conversation("city zoo", "Hi"), Some(0)).await;
    for w in &workers {
        cluster
            .wait_cached_blocks(w["id"].as_u64().unwrap(), 4)
            .await;
    }
    let (worker, _) = routed(&cluster, &conversation("city museum", "Is it free?")).await;
    assert_eq!(rank_of(worker), 1);
    let (worker, _) = routed(&cluster, &conversation("city zoo", "Is it free?")).await;
    assert_eq!(rank_of(worker), 0);
    // The engine was asked for those ranks (X-data-parallel-rank).
    let served = engine.served();
    let last: Vec<u32> = served[served.len() - 2..]
        .iter()
        .map(|s: &Served| s.rank)
        .collect();
    assert_eq!(last, [1, 0]);
}

/// Answers written in vLLM's format (fields a gateway may not know
/// included): a streamed tool call with a usage chunk, streamed logprobs, a
/// JSON answer, and an error.
fn recordings() -> HashMap<String, Recorded> {
    let sse = |events: &[Value]| -> Vec<Bytes> {
        let mut text = String::new();
        for e in events {
            text.push_str(&format!("data: {e}\n\n"));
        }
        text.push_str("data: [DONE]\n\n");
        // Uneven chunks, cutting lines and UTF-8 sequences in two.
        let bytes = text.into_bytes();
        bytes.chunks(37).map(Bytes::copy_from_slice).collect()
    };
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "created": 1764460800,
               "model": "Qwen/Qwen3-8B", "system_fingerprint": null,
               "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish, "stop_reason": null}],
               "kv_transfer_params": null})
    };
    let tool_call = sse(&[
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(
            json!({"tool_calls": [{"id": "chatcmpl-tool-91c2", "type": "function", "index": 0,
                                     "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": \"Zürich\""}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": ", \"unit\": \"°C\"}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        json!({"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "created": 1764460800,
               "model": "Qwen/Qwen3-8B", "choices": [],
               "usage": {"prompt_tokens": 312, "total_tokens": 341, "completion_tokens": 29,
                         "prompt_tokens_details": {"cached_tokens": 288}}}),
    ]);
    let logprobs = sse(&[
        json!({"id": "cmpl-1b", "object": "text_completion", "created": 1764460800, "model": "m",
               "choices": [{"index": 0, "text": " Paris", "logprobs": {"text_offset": [0], "token_logprobs": [-0.01],
                            "tokens": [" Paris"], "top_logprobs": [{" Paris": -0.01, " Lyon": -5.2}]},
                            "finish_reason": null, "stop_reason": null, "prompt_logprobs": null}]}),
        json!({"id": "cmpl-1b", "object": "text_completion", "created": 1764460800, "model": "m",
               "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "length", "stop_reason": null}]}),
    ]);
    let body = json!({"id": "chatcmpl-c4", "object": "chat.completion", "created": 1764460800, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Ja, gern — 42.", "refusal": null,
                     "annotations": null, "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null},
                     "logprobs": null, "finish_reason": "stop", "stop_reason": null}],
        "service_tier": null, "system_fingerprint": null,
        "usage": {"prompt_tokens": 20, "total_tokens": 27, "completion_tokens": 7, "prompt_tokens_details": null},
        "prompt_logprobs": null, "kv_transfer_params": null});
    let error = json!({"error": {"message": "This model's maximum context length is 32768 tokens.",
                                 "type": "BadRequestError", "param": null, "code": 400}});
    let mut r = HashMap::new();
    r.insert(
        "tool-call".into(),
        Recorded {
            status: 200,
            content_type: "text/event-stream; charset=utf-8",
            chunks: tool_call,
        },
    );
    r.insert(
        "logprobs".into(),
        Recorded {
            status: 200,
            content_type: "text/event-stream; charset=utf-8",
            chunks: logprobs,
        },
    );
    r.insert(
        "json".into(),
        Recorded {
            status: 200,
            content_type: "application/json",
            chunks: vec![Bytes::from(body.to_string())],
        },
    );
    r.insert(
        "error".into(),
        Recorded {
            status: 400,
            content_type: "application/json",
            chunks: vec![Bytes::from(error.to_string())],
        },
    );
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_answers_are_byte_identical_to_going_direct() {
    let engine = OpenAiEngine::start(tokenizer(), 16, 1, recordings()).await;
    let cluster = gateway(vec![entry(&engine, false, 1)], 1).await;
    let client = reqwest::Client::new();
    let cases = [
        ("tool-call", "/v1/chat/completions", true),
        ("logprobs", "/v1/completions", true),
        ("json", "/v1/chat/completions", false),
        ("error", "/v1/chat/completions", false),
    ];
    for (name, path, stream) in cases {
        let body = match path {
            "/v1/completions" => {
                json!({"model": name, "prompt": "The capital of France is", "stream": stream, "logprobs": 2})
            }
            _ => {
                json!({"model": name, "stream": stream, "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                        "messages": [{"role": "user", "content": "Weather in Zürich?"}]})
            }
        };
        let fetch = |base: String| {
            let client = client.clone();
            let body = body.clone();
            async move {
                let r = client
                    .post(format!("{base}{path}"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
                (status, content_type, r.bytes().await.unwrap())
            }
        };
        let direct = fetch(engine.url.clone()).await;
        let relayed = fetch(cluster.url.clone()).await;
        assert_eq!(relayed.0, direct.0, "{name}: status");
        assert_eq!(relayed.1, direct.1, "{name}: content type");
        assert_eq!(
            String::from_utf8_lossy(&relayed.2),
            String::from_utf8_lossy(&direct.2),
            "{name}: body"
        );
        assert_eq!(relayed.2, direct.2, "{name}: bytes");
    }
    // The gateway's own refusals are still its own: not JSON is a 400.
    let r = client
        .post(format!("{}/v1/chat/completions", cluster.url))
        .body("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid request body")
    );
    // `/v1/models` without a model of its own: the engine's.
    let models: Value = client
        .get(format!("{}/v1/models", cluster.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "test-engine");
    // Usage from the relayed answers reaches the metrics.
    assert!(
        cluster
            .metric("sluice_requests_total{outcome=\"success\"}")
            .await
            >= 3.0
    );
}
