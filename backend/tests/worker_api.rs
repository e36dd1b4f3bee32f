//! The worker's HTTP API, served in-process on a loopback port and called over
//! real HTTP: OpenAI chat and completions (streaming and not), errors, the
//! internal token endpoint, the event stream, health and metrics.

mod common;

use std::sync::Arc;

use serde_json::{Value, json};
use sluice_backend::engine::{Engine, EngineConfig};
use sluice_backend::server::{WorkerState, serve};

use common::post;

/// Starts a worker on 127.0.0.1:<free port>; returns its base URL.
async fn start() -> String {
    let path = common::model_path();
    let loaded = sluice_backend::model::load(&path)
        .unwrap_or_else(|e| panic!("{e}. Fetch the model with `make model`"));
    let engine = Engine::start(
        Arc::new(loaded.llama),
        Arc::new(loaded.tokenizer),
        EngineConfig::default(),
    );
    let state = Arc::new(WorkerState::new(Arc::new(engine), loaded.name));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener, state));
    url
}

fn question() -> Value {
    json!([{"role": "user", "content": "What is the capital of France?"}])
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_and_not_agree() {
    let url = start().await;
    let (status, full) = post(
        &url,
        "/v1/chat/completions",
        json!({"messages": question(), "temperature": 0, "max_tokens": 20}),
    )
    .await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    let answer = full["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(answer, "The capital of France is Paris.");
    assert_eq!(full["choices"][0]["finish_reason"], "stop");
    let usage = &full["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        )
    );

    let body = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(
            &json!({"messages": question(), "temperature": 0, "max_tokens": 20,
                      "stream": true, "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, answer);
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect::<Vec<_>>();
    assert_eq!(finish, vec!["stop"]);
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["completion_tokens"],
        usage["completion_tokens"]
    );
    // The repeated prompt was served from the prefix cache.
    assert!(
        usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_with_logprobs_stops_and_seeds() {
    let url = start().await;
    let (status, r) = post(
        &url,
        "/v1/completions",
        json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert!(lp["token_logprobs"][0].as_f64().unwrap() <= 0.0);
    assert_eq!(r["choices"][0]["finish_reason"], "length");

    let (_, stopped) = post(
        &url,
        "/v1/chat/completions",
        json!({"messages": question(), "temperature": 0, "stop": [" Paris"]}),
    )
    .await;
    assert_eq!(
        stopped["choices"][0]["message"]["content"],
        "The capital of France is"
    );
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    let sampled = |seed: u64| {
        let url = url.clone();
        async move {
            let (_, r) = post(
                &url,
                "/v1/completions",
                json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": seed}),
            )
            .await;
            r["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    assert_eq!(
        sampled(7).await,
        sampled(7).await,
        "a seed makes sampling reproducible"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let url = start().await;
    let cases = [
        (json!({"messages": []}), 400, "messages"),
        (
            json!({"messages": question(), "model": "gpt-4"}),
            404,
            "model",
        ),
        (json!({"messages": question(), "n": 2}), 400, "n"),
        (
            json!({"messages": question(), "tools": [{"type": "function", "function": {"name": "f"}}]}),
            400,
            "tools",
        ),
        (
            json!({"messages": question(), "max_tokens": 0}),
            400,
            "max_tokens",
        ),
        (
            json!({"messages": question(), "max_tokens": 100_000}),
            400,
            "max_tokens",
        ),
        (
            json!({"messages": question(), "temperature": 5}),
            400,
            "temperature",
        ),
        (
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            400,
            "messages",
        ),
    ];
    for (body, status, field) in cases {
        let (got, err) = post(&url, "/v1/chat/completions", body.clone()).await;
        assert_eq!(got, status, "{body} -> {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(field) || err["error"]["param"] == field,
            "{body} -> {err}"
        );
        assert!(err["error"]["type"].is_string());
    }
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["type"], "invalid_request_error");
    let (status, _) = post(
        &url,
        "/v1/completions",
        json!({"prompt": [1, 99_999_999], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 400);
    let r = reqwest::get(format!("{url}/v2/nothing")).await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // An oversize body gets a 413 in OpenAI's shape.
    let huge = "x".repeat(9 << 20);
    let (status, err) = post(
        &url,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": huge}]}),
    )
    .await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["type"], "invalid_request_error");
    // And after all that, the worker still serves.
    let (status, ok) = post(
        &url,
        "/v1/chat/completions",
        json!({"messages": question(), "temperature": 0, "max_tokens": 8}),
    )
    .await;
    assert_eq!(status, 200, "{ok}");
    assert!(
        ok["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Paris")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_generate_events_health_and_metrics() {
    let url = start().await;
    // Follow the event stream while a request runs.
    let events = reqwest::get(format!("{url}/events")).await.unwrap();
    assert_eq!(events.status().as_u16(), 200);
    let mut events = events.bytes_stream();

    let body = reqwest::Client::new()
        .post(format!("{url}/internal/generate"))
        .json(
            &json!({"prompt": (1..=40).collect::<Vec<u32>>(), "max_tokens": 3,
                      "sampling": {"temperature": 0}, "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let lines: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["event"], "started");
    assert_eq!(lines.iter().filter(|l| l["event"] == "token").count(), 3);
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "finished");
    assert_eq!(last["usage"]["prompt_tokens"], 40);

    // 40 prompt tokens fill two blocks of 16: a `kv` event says they are stored.
    use tokio_stream::StreamExt;
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !seen.contains("event: kv") && tokio::time::Instant::now() < deadline {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(Ok(chunk))) => seen.push_str(&String::from_utf8_lossy(&chunk)),
            _ => break,
        }
    }
    assert!(
        seen.contains("event: kv") && seen.contains("\"stored\""),
        "{seen}"
    );
    assert!(seen.contains("\"seq\":1"), "{seen}");

    let snapshot: Value = reqwest::get(format!("{url}/internal/kv"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(snapshot["hashes"].as_array().unwrap().len() >= 2);
    let health: Value = reqwest::get(format!("{url}/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ok");
    let metrics = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("sluice_worker_requests_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sluice_worker_completion_tokens_total 3"),
        "{metrics}"
    );
}

/// A client still writing an oversize body when the worker has read enough
/// gets the 413 once it is done: the rest of the body is read and dropped
/// rather than the connection closed under the client's writes (which gave
/// it a broken pipe and no answer in a CI run of the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_sending_an_oversize_body_reads_the_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = start().await;
    let limit = sluice_backend::server::MAX_BODY_BYTES;
    let total = limit + (2 << 20);
    let mut s = tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: worker\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {total}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b'x'; 256 << 10];
    let mut sent = 0;
    while sent < total {
        let n = chunk.len().min(total - sent);
        s.write_all(&chunk[..n])
            .await
            .unwrap_or_else(|e| panic!("writing byte {sent} of {total}: {e}"));
        sent += n;
        if sent > limit {
            // Past the limit, slowly: the worker has decided by now.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    let mut answer = String::new();
    s.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("invalid_request_error"), "{answer}");
}
