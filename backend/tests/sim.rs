//! The simulated engine behind the worker's real HTTP API: it says it is
//! simulated, answers deterministically with exactly `max_tokens` word
//! tokens, reuses cached prefixes, takes the time its profile gives, and
//! answers the endpoints peer routers ask of a worker.

mod common;

use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use sluice_backend::model::Tokenizer;
use sluice_backend::sim::{Profile, SimFleet, SimOptions, StepShape, word_tokens};

use common::post;

fn tokenizer() -> Arc<Tokenizer> {
    let path = common::model_path();
    let info = sluice_backend::model::describe(&path)
        .unwrap_or_else(|e| panic!("{e}. Fetch the model with `make model`"));
    Arc::new(info.tokenizer)
}

async fn fleet(workers: usize, time_scale: f64) -> SimFleet {
    let options = SimOptions {
        time_scale,
        ..SimOptions::new(Profile::h200_llama_8b(), workers)
    };
    SimFleet::start(tokenizer(), &options)
        .await
        .expect("starts")
}

async fn get(url: &str, path: &str) -> Value {
    reqwest::get(format!("{url}{path}"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn chat(system: &str, max_tokens: u32) -> Value {
    json!({
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Read src/main.rs and list its functions."},
        ],
        "max_tokens": max_tokens,
    })
}

#[test]
fn word_tokens_are_words_that_encode_to_themselves() {
    let t = tokenizer();
    let words = word_tokens(&t);
    assert!(words.len() > 1000, "{} words", words.len());
    for &id in words.iter().take(200) {
        let text = t.decode(&[id], false).unwrap();
        assert!(text.starts_with(' ') && text[1..].bytes().all(|b| b.is_ascii_lowercase()));
        assert_eq!(t.encode(&text).unwrap(), vec![id]);
    }
    // So a run of them re-tokenizes to the same ids.
    let text = t.decode(&words[..50], false).unwrap();
    assert_eq!(t.encode(&text).unwrap(), words[..50].to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn says_it_is_simulated() {
    let f = fleet(2, 1.0).await;
    assert_eq!(f.urls.len(), 2);
    for url in &f.urls {
        let models = get(url, "/v1/models").await;
        assert_eq!(models["data"][0]["owned_by"], "sluice-sim");
        assert_eq!(models["data"][0]["simulated"], "h200-llama-8b");
        let health = get(url, "/health").await;
        assert_eq!(health["simulated"], "h200-llama-8b");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_deterministic_exact_length_and_reuse_the_cache() {
    let f = fleet(1, 1.0).await;
    let url = &f.urls[0];
    let system = "You are a coding agent. ".repeat(40);
    let (status, first) = post(url, "/v1/chat/completions", chat(&system, 24)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["completion_tokens"], 24);
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let (_, second) = post(url, "/v1/chat/completions", chat(&system, 24)).await;
    assert_eq!(
        first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"],
        "the same prompt gets the same answer"
    );
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= prompt - 16 && cached < prompt,
        "{cached} of {prompt}"
    );
    let metrics = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("sluice_worker_cached_prompt_tokens_total"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_takes_the_time_the_profile_gives() {
    // Ten times slower than the profile, so the modelled time dominates.
    let f = fleet(1, 10.0).await;
    let system = "alpha beta gamma delta ".repeat(300); // over 1,000 tokens
    let started = Instant::now();
    let (status, answer) = post(&f.urls[0], "/v1/chat/completions", chat(&system, 1)).await;
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(status, 200, "{answer}");
    let n = answer["usage"]["prompt_tokens"].as_f64().unwrap();
    let modelled = Profile::h200_llama_8b().step_seconds(StepShape {
        tokens: n,
        pairs: n * (n + 1.0) / 2.0,
        kv_reads: 0.0,
    }) * 10.0;
    assert!(
        elapsed >= modelled * 0.95,
        "{elapsed:.3} s for a {modelled:.3} s prefill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_what_peer_routers_ask() {
    let f = fleet(1, 1.0).await;
    let url = &f.urls[0];
    let info = get(url, "/get_server_info").await;
    assert_eq!(info["block_size"], 16);
    assert_eq!(info["page_size"], 16);
    assert_eq!(info["simulated"], "h200-llama-8b");
    assert!(info["max_total_num_tokens"].as_u64().unwrap() > 100_000);
    assert_eq!(get(url, "/get_model_info").await["is_generation"], true);
    assert_eq!(get(url, "/health_generate").await["status"], "ok");

    let (status, text) = post(url, "/tokenize", json!({"prompt": "hello world"})).await;
    assert_eq!(status, 200);
    assert_eq!(text["count"], text["tokens"].as_array().unwrap().len());
    let messages = chat("Be brief.", 8);
    let (_, by_messages) = post(url, "/tokenize", messages.clone()).await;
    let (status, rendered) = post(url, "/v1/chat/completions/render", messages).await;
    assert_eq!(status, 200, "{rendered}");
    assert_eq!(rendered["token_ids"], by_messages["tokens"]);
    let (status, bad) = post(url, "/tokenize", json!({"text": 1})).await;
    assert_eq!(status, 400);
    assert_eq!(bad["error"]["param"], "prompt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_and_twenty_eight_workers_serve_from_one_process() {
    let f = fleet(128, 1.0).await;
    let distinct: std::collections::HashSet<&String> = f.urls.iter().collect();
    assert_eq!(distinct.len(), 128, "each worker on its own port");
    for url in &f.urls {
        assert_eq!(get(url, "/health").await["status"], "ok", "{url}");
    }
    // And each one generates.
    let (status, body) = post(&f.urls[127], "/v1/chat/completions", chat("Hi.", 3)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 3);
}

/// A 1P1D simulated fleet over the worker API: roles in `/health`, a
/// remote-prefill request on the decode worker, the prefill worker pushing
/// into it over TCP with the modelled link delay, and the same answer as an
/// aggregated simulated worker gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_fleet_moves_kv_in_the_modelled_time_and_answers_the_same() {
    let mut profile = Profile::h200_llama_8b();
    // A slow link, so its time shows: 20 ms per 16-token block.
    profile.kv_link_bytes_s = profile.kv_bytes_per_token * 16.0 / 0.020;
    let options = SimOptions {
        prefill_workers: 1,
        ..SimOptions::new(profile.clone(), 2)
    };
    let t = tokenizer();
    let fleet = SimFleet::start(t.clone(), &options).await.unwrap();
    let (prefill, decode) = (&fleet.urls[0], &fleet.urls[1]);
    assert_eq!(get(prefill, "/health").await["role"], "prefill");
    assert_eq!(get(decode, "/health").await["role"], "decode");
    let aggregated = fleet_of(profile).await;

    // 80 tokens: 5 blocks, of which 79 tokens' worth come from the prefill worker.
    let words = word_tokens(&t);
    let prompt: Vec<u32> = (0..80).map(|i| words[i * 7 % words.len()]).collect();
    let request = json!({"prompt": prompt, "max_tokens": 6, "ignore_eos": true});
    let want = generated(&aggregated.urls[0], &request).await;

    let mut remote = request.clone();
    remote["remote_prefill"] = true.into();
    let response = reqwest::Client::new()
        .post(format!("{decode}/internal/generate"))
        .json(&remote)
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    let mut lines = String::new();
    let awaiting = loop {
        let chunk = tokio_stream::StreamExt::next(&mut body)
            .await
            .unwrap()
            .unwrap();
        lines.push_str(std::str::from_utf8(&chunk).unwrap());
        if let Some(line) = lines.lines().find(|l| l.contains("awaiting_kv")) {
            break serde_json::from_str::<Value>(line).unwrap();
        }
    };
    assert_eq!(
        (awaiting["from_block"].clone(), awaiting["blocks"].clone()),
        (json!(0), json!(5))
    );
    let started = Instant::now();
    let target = json!({"addr": awaiting["addr"], "handle": awaiting["handle"], "from_block": 0});
    let (status, done) = post(
        prefill,
        "/internal/prefill",
        json!({"request": request, "target": target}),
    )
    .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["pushed"]["blocks"], 5);
    // Five blocks over the modelled link: at least 100 ms.
    assert!(
        started.elapsed().as_secs_f64() >= 0.1,
        "{:?}",
        started.elapsed()
    );
    while let Some(chunk) = tokio_stream::StreamExt::next(&mut body).await {
        lines.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert_eq!(token_ids(&lines), want);
}

async fn fleet_of(profile: Profile) -> SimFleet {
    SimFleet::start(tokenizer(), &SimOptions::new(profile, 1))
        .await
        .unwrap()
}

/// The token ids `/internal/generate` answers.
async fn generated(url: &str, request: &Value) -> Vec<u64> {
    let text = reqwest::Client::new()
        .post(format!("{url}/internal/generate"))
        .json(request)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    token_ids(&text)
}

/// The token ids of an `/internal/generate` answer (NDJSON events).
fn token_ids(ndjson: &str) -> Vec<u64> {
    ndjson
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["event"] == "token")
        .map(|e| e["id"].as_u64().unwrap())
        .collect()
}

/// Chunked prefill makes a block reusable (prefix cache, KV event) only once
/// its K and V are computed. The engine answers a snapshot between steps: one
/// asked for while the first 16-token chunk of a 96-token prompt runs sees
/// exactly that chunk's block, not the whole prompt's.
#[test]
fn a_chunked_prefill_caches_only_the_blocks_it_has_computed() {
    use sluice_backend::engine::{Engine, EngineConfig, GenerateEvent, GenerateRequest};
    use sluice_backend::sim::SimExecutor;
    let t = tokenizer();
    let words: Arc<[u32]> = word_tokens(&t).into();
    let mut profile = Profile::h200_llama_8b();
    profile.overhead_s = 0.05; // every step takes 50 ms or more
    let executor = SimExecutor::new(profile, 1.0, words.clone(), t.vocab_size());
    let engine = Engine::start_with(
        Box::new(executor),
        t.clone(),
        EngineConfig {
            step_tokens: 16,
            ..EngineConfig::default()
        },
    );
    let prompt: Vec<u32> = (0..96).map(|i| words[i * 13 % words.len()]).collect();
    let (_, mut rx) = engine.submit(GenerateRequest::new(prompt, 1));
    // `started` is sent at admission, in the first step, before its chunk runs.
    assert!(matches!(
        rx.blocking_recv(),
        Some(GenerateEvent::Started { .. })
    ));
    let (_, cached) = engine.cached_snapshot();
    assert_eq!(cached.len(), 1, "after one 16-token chunk: {cached:?}");
    while rx.blocking_recv().is_some() {}
    let (_, cached) = engine.cached_snapshot();
    assert_eq!(cached.len(), 6, "the whole 96-token prompt, after it ran");
}
