//! Replays a trace through any OpenAI endpoint: sessions start at their
//! arrival times (scaled to the wanted rate), each turn is a streamed chat
//! request carrying the whole conversation so far (the answers as they came
//! back), and the next turn follows after the think time. Records what a
//! client sees of every request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio_stream::StreamExt;

use super::plan::chat_body;
use super::trace::Trace;

#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// The endpoint's base URL (`http://host:port`).
    pub base_url: String,
    pub model: String,
    /// Sessions per second of modelled time.
    pub session_rate: f64,
    /// Real seconds per modelled second (think times and arrivals stretch by it).
    pub time_scale: f64,
    /// A request running longer than this (real time) is given up.
    pub request_timeout: Duration,
}

/// What the client saw of one request (times in real seconds).
#[derive(Clone, Debug, serde::Serialize)]
pub struct RequestRecord {
    pub session: usize,
    pub turn: usize,
    /// Sent, seconds after the replay began.
    pub sent: f64,
    /// Until the first content token.
    pub ttft: Option<f64>,
    /// Until the stream ended.
    pub e2e: f64,
    pub output_chunks: u32,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Prompt tokens the worker served from its cache
    /// (`usage.prompt_tokens_details.cached_tokens`), when it said.
    pub cached_tokens: Option<u64>,
    /// `x-sluice-worker`, when the endpoint is sluice.
    pub worker: Option<String>,
    pub error: Option<String>,
    /// The answer's text.
    #[serde(skip)]
    pub answer: String,
}

/// Runs every session of `trace`; returns one record per request sent (a
/// session stops at its first failed turn: its history would be wrong).
pub async fn replay(trace: Arc<Trace>, options: ReplayOptions) -> Vec<RequestRecord> {
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1024)
        .build()
        .expect("a plain HTTP client builds");
    let began = Instant::now();
    let tasks: Vec<_> = (0..trace.sessions.len())
        .map(|si| {
            let (trace, options, client) = (trace.clone(), options.clone(), client.clone());
            tokio::spawn(async move { run_session(&trace, si, &options, &client, began).await })
        })
        .collect();
    let mut records = Vec::new();
    for task in tasks {
        if let Ok(mut r) = task.await {
            records.append(&mut r);
        }
    }
    records
}

async fn run_session(
    trace: &Trace,
    si: usize,
    options: &ReplayOptions,
    client: &reqwest::Client,
    began: Instant,
) -> Vec<RequestRecord> {
    let session = &trace.sessions[si];
    let start =
        Duration::from_secs_f64(session.arrival / options.session_rate * options.time_scale);
    tokio::time::sleep_until((began + start).into()).await;
    let mut answers: Vec<String> = Vec::new();
    let mut records = Vec::new();
    for (ti, turn) in session.turns.iter().enumerate() {
        let body = chat_body(trace, si, ti, &answers, &options.model);
        let record = send(client, options, si, ti, &body, began).await;
        let failed = record.error.is_some();
        answers.push(record.answer.clone());
        records.push(record);
        if failed {
            break;
        }
        tokio::time::sleep(Duration::from_secs_f64(turn.think * options.time_scale)).await;
    }
    records
}

/// Sends one streamed chat request and reads it to the end.
async fn send(
    client: &reqwest::Client,
    options: &ReplayOptions,
    session: usize,
    turn: usize,
    body: &Value,
    began: Instant,
) -> RequestRecord {
    let sent = Instant::now();
    let mut record = RequestRecord {
        session,
        turn,
        sent: sent.duration_since(began).as_secs_f64(),
        ttft: None,
        e2e: 0.0,
        output_chunks: 0,
        prompt_tokens: None,
        completion_tokens: None,
        cached_tokens: None,
        worker: None,
        error: None,
        answer: String::new(),
    };
    let mut answer = String::new();
    let result = tokio::time::timeout(options.request_timeout, async {
        let response = client
            .post(format!("{}/v1/chat/completions", options.base_url))
            .header("x-session-id", format!("session-{session}"))
            .json(body)
            .send()
            .await
            .map_err(|e| format!("send: {e}"))?;
        record.worker = response
            .headers()
            .get("x-sluice-worker")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        if !response.status().is_success() {
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            return Err(format!(
                "{status}: {}",
                text.chars().take(200).collect::<String>()
            ));
        }
        let mut stream = response.bytes_stream();
        let mut pending = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| format!("stream: {e}"))?;
            pending.extend_from_slice(&chunk);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let Some(data) = line.strip_prefix(b"data: ") else {
                    continue;
                };
                let data = data.trim_ascii();
                if data == b"[DONE]" {
                    return Ok(());
                }
                let event: Value =
                    serde_json::from_slice(data).map_err(|e| format!("bad event: {e}"))?;
                if let Some(error) = event.get("error") {
                    return Err(format!("error event: {error}"));
                }
                if let Some(text) = event["choices"][0]["delta"]["content"].as_str()
                    && !text.is_empty()
                {
                    record.ttft.get_or_insert(sent.elapsed().as_secs_f64());
                    record.output_chunks += 1;
                    answer.push_str(text);
                }
                if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
                    record.prompt_tokens = usage["prompt_tokens"].as_u64();
                    record.completion_tokens = usage["completion_tokens"].as_u64();
                    record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
                }
            }
        }
        Err("the stream ended without [DONE]".to_string())
    })
    .await;
    record.e2e = sent.elapsed().as_secs_f64();
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => record.error = Some(e),
        Err(_) => record.error = Some("timed out".into()),
    }
    record.answer = answer;
    record
}
