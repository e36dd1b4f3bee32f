//! Disaggregated serving end to end: `sluice serve` with in-process prefill
//! and decode workers on the real model (SmolLM2), the router plugin asked
//! for each hop, KV over the TCP transport. Greedy answers through 1P1D and
//! 1P2D equal aggregated ones; KV-aware prefill routing reuses a
//! conversation's prefix; transfers killed at random points leave every
//! client answered and no block held. On a GPU (skipped without one): a
//! prefill and a decode `sluice worker` process on one GPU copy the KV over
//! CUDA IPC, and answer exactly as when the KV goes as bytes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_backend::engine::{Engine, EngineConfig};
use sluice_backend::server::WorkerState;
use sluice_backend::transfer::wire::Frame;
use sluice_backend::transfer::{
    KvExport, KvLayout, KvTarget, KvTransport, Pushed, Role, TransferError,
};
use sluice_gateway::routing::Origin;
use sluice_tests::Rng;
use sluice_tests::cluster::{Cluster, LIBRARY_SYSTEM, chat, follow_up, model_path};
use tokio::io::AsyncWriteExt;

const CHAT: &str = "/v1/chat/completions";

fn header<'a>(h: &'a reqwest::header::HeaderMap, name: &str) -> &'a str {
    h.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
}

const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
];

/// The answers to QUESTIONS (odd ones streamed), with each answer's
/// (worker, prefill worker) headers.
async fn answers(cluster: &Cluster) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (i, q) in QUESTIONS.iter().enumerate() {
        let body = chat(&[("user", q)], 24);
        let (text, headers) = if i % 2 == 0 {
            let (status, h, r) = cluster.post(CHAT, &body).await;
            assert_eq!(status, 200, "{r}");
            let text = r["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            (text, h)
        } else {
            let mut body = body;
            body["stream"] = true.into();
            let (status, h, data) = cluster.post_stream(CHAT, &body).await;
            assert_eq!(status, 200);
            let text: String = data
                .iter()
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str::<Value>(d).unwrap())
                .filter_map(|c| {
                    c["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(String::from)
                })
                .collect();
            (text, h)
        };
        out.push((
            text,
            header(&headers, "x-sluice-worker").to_string(),
            header(&headers, "x-sluice-prefill-worker").to_string(),
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_worker_and_one_or_two_decode_workers_answer_as_aggregated() {
    let reference: Vec<String> = {
        let cluster = Cluster::start(0, |c| c.embedded_workers = 1).await;
        cluster.wait_for_workers(1).await;
        answers(&cluster).await.into_iter().map(|a| a.0).collect()
    };
    assert!(reference.iter().all(|a| !a.is_empty()));
    for decode in [1, 2] {
        let cluster = Cluster::start(0, |c| {
            c.embedded_prefill = 1;
            c.embedded_decode = decode;
            c.disaggregation.min_prefill_tokens = 0;
        })
        .await;
        cluster.wait_for_workers(1 + decode as usize).await;
        let got = answers(&cluster).await;
        for ((text, worker, prefill), want) in got.iter().zip(&reference) {
            assert_eq!(text, want, "1P{decode}D");
            assert!(
                !prefill.is_empty() && prefill != worker,
                "prefilled on {prefill:?}, decoded on {worker}"
            );
        }
        // The decode workers hold nothing afterwards.
        wait_idle(&cluster).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_prefill_routing_reuses_a_conversations_prefix() {
    let cluster = Cluster::start(0, |c| {
        c.embedded_prefill = 2;
        c.embedded_decode = 1;
        c.disaggregation.min_prefill_tokens = 0;
    })
    .await;
    cluster.wait_for_workers(3).await;
    let question = "When do you open on Saturday?";
    let turn1 = [("system", LIBRARY_SYSTEM), ("user", question)];
    let (status, h1, r1) = cluster.post(CHAT, &chat(&turn1, 8)).await;
    assert_eq!(status, 200, "{r1}");
    let prefill = header(&h1, "x-sluice-prefill-worker").to_string();
    assert!(!prefill.is_empty(), "turn 1 took the prefill hop");
    let prompt_blocks = r1["usage"]["prompt_tokens"].as_u64().unwrap() / 16;
    // The prefill worker's KV events reach the gateway's index (its prompt
    // there lacks the last token, so its last block may be partial).
    cluster
        .wait_cached_blocks(prefill.parse().unwrap(), prompt_blocks - 1)
        .await;
    let reply = r1["choices"][0]["message"]["content"].as_str().unwrap();
    let (status, h2, r2) = cluster.post(CHAT, &follow_up(question, reply, 8)).await;
    assert_eq!(status, 200, "{r2}");
    assert_eq!(
        header(&h2, "x-sluice-prefill-worker"),
        prefill,
        "turn 2 is prefilled where turn 1's blocks are"
    );
    let cached: u64 = header(&h2, "x-sluice-cached-blocks").parse().unwrap();
    assert!(
        cached + 1 >= prompt_blocks,
        "{cached} of turn 1's {prompt_blocks} blocks reused"
    );
    assert!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= cached * 16
    );
}

/// A counter of a worker's `/metrics`.
async fn worker_counter(worker_url: &str, name: &str) -> u64 {
    let text = reqwest::get(format!("{worker_url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_on_one_gpu_move_kv_over_cuda_ipc_with_the_same_answers() {
    if !sluice_backend::compute::cuda::cuda_available() {
        eprintln!("skipped: no CUDA GPU");
        return;
    }
    let mut texts = Vec::new();
    for direct in [false, true] {
        let mut cluster = Cluster::start(0, |c| c.disaggregation.min_prefill_tokens = 0).await;
        let mut args = vec!["--device", "cuda:0", "--role", "prefill"];
        if !direct {
            args.push("--no-kv-direct");
        }
        let prefill = cluster.add_worker_with(&args);
        cluster.add_worker_with(&["--device", "cuda:0", "--role", "decode"]);
        cluster.wait_for_workers(2).await;
        let got = answers(&cluster).await;
        for (text, worker, prefilled) in &got {
            assert!(!text.is_empty());
            assert!(
                !prefilled.is_empty() && prefilled != worker,
                "prefilled on {prefilled:?}, decoded on {worker}"
            );
        }
        let in_place =
            worker_counter(&prefill, "sluice_worker_kv_blocks_pushed_in_place_total").await;
        let bytes = worker_counter(&prefill, "sluice_worker_kv_blocks_pushed_as_bytes_total").await;
        eprintln!("direct {direct}: {in_place} blocks copied in place, {bytes} sent as bytes");
        if direct {
            assert!(
                in_place > 0 && bytes == 0,
                "{in_place} in place, {bytes} as bytes"
            );
        } else {
            assert!(
                in_place == 0 && bytes > 0,
                "{in_place} in place, {bytes} as bytes"
            );
        }
        wait_idle(&cluster).await;
        texts.push(got.into_iter().map(|a| a.0).collect::<Vec<_>>());
    }
    // The same KV bits either way: the same greedy answers, exactly.
    assert_eq!(texts[0], texts[1]);
}

/// Waits until every worker reports no block in use.
async fn wait_idle(cluster: &Cluster) {
    let started = Instant::now();
    loop {
        let workers = cluster.workers_status().await;
        if workers
            .iter()
            .all(|w| w["load"]["kv_blocks_used"] == 0 && w["load"]["active_requests"] == 0)
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "blocks still held: {workers:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A transport that dies: it speaks the real protocol but stops after a
/// random number of bytes (mid-frame, between frames, or never), then
/// drops the connection, as a prefill worker killed mid-transfer would.
#[derive(Debug)]
struct DyingTransport {
    rng: Mutex<Rng>,
}

impl KvTransport for DyingTransport {
    fn push(
        &self,
        target: KvTarget,
        layout: KvLayout,
        mut chunks: tokio::sync::mpsc::UnboundedReceiver<KvExport>,
    ) -> futures_util::future::BoxFuture<'static, Result<Pushed, TransferError>> {
        // A chat prompt here is 2-4 blocks of 737,280 bytes: some pushes
        // get through whole.
        let cut = self.rng.lock().unwrap().below(3_500_000) as usize;
        Box::pin(async move {
            let mut s = tokio::net::TcpStream::connect(&target.addr).await?;
            let mut budget = cut;
            let handle = target.handle;
            let mut blocks = 0;
            let mut frame = Some(Frame::Hello { handle, layout });
            while let Some(f) = frame.take() {
                let mut bytes = Vec::new();
                f.write(&mut bytes).await?;
                if bytes.len() > budget {
                    s.write_all(&bytes[..budget]).await?;
                    return Err(TransferError::Io(
                        std::io::ErrorKind::ConnectionReset.into(),
                    ));
                }
                s.write_all(&bytes).await?;
                budget -= bytes.len();
                if matches!(f, Frame::Done { .. }) {
                    break;
                }
                frame = Some(match chunks.recv().await {
                    Some(c) => {
                        blocks += c.n_blocks;
                        Frame::Chunk {
                            handle,
                            first_block: c.first_block,
                            n_blocks: c.n_blocks,
                            data: c.data,
                        }
                    }
                    None => Frame::Done { handle, blocks },
                });
            }
            match Frame::read(&mut s).await? {
                Some(Frame::Ack { ok: true, .. }) => Ok(Pushed {
                    blocks,
                    ..Pushed::default()
                }),
                other => Err(TransferError::Protocol(format!("{other:?}"))),
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_killed_at_random_points_leave_every_client_answered_and_no_block_held() {
    let cluster = Cluster::start(0, |c| {
        c.embedded_decode = 1;
        c.disaggregation.min_prefill_tokens = 0;
    })
    .await;
    // A prefill worker (in this process) whose transfers die.
    let loaded = sluice_backend::model::load(&model_path()).unwrap();
    let engine = Arc::new(Engine::start(
        Arc::new(loaded.llama),
        Arc::new(loaded.tokenizer),
        EngineConfig {
            step_tokens: 16,
            ..EngineConfig::default()
        },
    ));
    let mut state = WorkerState::new(engine.clone(), loaded.name)
        .with_role(Role::Prefill, "127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    state.transport = Arc::new(DyingTransport {
        rng: Mutex::new(Rng(7)),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(sluice_backend::server::serve(listener, Arc::new(state)));
    let prefill_id = cluster.gateway.gateway.add_worker(&url, Origin::Static);
    cluster.wait_for_workers(2).await;

    // 100 requests, four at a time, each prompt new to both workers.
    let mut prefilled = 0;
    let cluster = &cluster;
    for round in 0..25 {
        let mut calls = Vec::new();
        for (j, q) in QUESTIONS.iter().enumerate() {
            let question = format!("{q} (case {})", round * 4 + j);
            let body = chat(&[("user", &question)], 4);
            calls.push(async move { cluster.post(CHAT, &body).await });
        }
        for (status, h, r) in futures_util::future::join_all(calls).await {
            assert_eq!(status, 200, "every client gets its answer: {r}");
            assert!(
                !r["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .is_empty()
            );
            if header(&h, "x-sluice-prefill-worker") == prefill_id.to_string() {
                prefilled += 1;
            }
        }
    }
    // Some transfers got through whole; most died and were retried on the
    // decode worker alone.
    assert!(
        prefilled > 0 && prefilled < 100,
        "{prefilled} prefilled remotely"
    );
    assert!(cluster.metric("sluice_retries_total").await >= (100 - prefilled) as f64);
    wait_idle(cluster).await;
    let load = engine.load();
    assert_eq!(
        (load.kv_blocks_used, load.active_requests),
        (0, 0),
        "the prefill worker holds nothing"
    );
}
