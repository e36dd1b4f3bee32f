//! The engine on the real model (SmolLM2-135M, `make model`): continuous
//! batching gives the same greedy tokens as one request at a time, prefixes are
//! reused, preemption recomputes correctly, stops and cancellation work.

mod common;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sluice_backend::engine::{
    Engine, EngineConfig, FinishReason, GenerateEvent, GenerateRequest, Usage,
};
use sluice_backend::kv::KvEvent;
use sluice_backend::model::{ChatMessage, Gguf, Llama, Tokenizer};

fn model() -> &'static (Arc<Llama>, Arc<Tokenizer>) {
    static MODEL: OnceLock<(Arc<Llama>, Arc<Tokenizer>)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = common::model_path();
        let gguf =
            Gguf::open(&path).unwrap_or_else(|e| panic!("{e}. Fetch the model with `make model`"));
        (
            Arc::new(Llama::from_gguf(&gguf).unwrap()),
            Arc::new(Tokenizer::from_gguf(&gguf).unwrap()),
        )
    })
}

fn engine(config: EngineConfig) -> Engine {
    let (m, t) = model();
    Engine::start(m.clone(), t.clone(), config)
}

fn chat(question: &str) -> Vec<u32> {
    common::chat_tokens(&model().1, question)
}

/// Everything a request produced.
#[derive(Debug, Default)]
struct Outcome {
    ids: Vec<u32>,
    text: String,
    reason: Option<FinishReason>,
    usage: Usage,
    cached: u32,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<GenerateEvent>) -> Outcome {
    let mut out = Outcome::default();
    while let Some(event) = rx.blocking_recv() {
        match event {
            GenerateEvent::Started { cached_tokens, .. } => out.cached = cached_tokens,
            GenerateEvent::Token(t) => {
                out.ids.push(t.id);
                out.text.push_str(&t.text);
            }
            GenerateEvent::Finished {
                reason,
                text,
                usage,
            } => {
                out.text.push_str(&text);
                out.reason = Some(reason);
                out.usage = usage;
                break;
            }
            GenerateEvent::Error { message, .. } => panic!("engine error: {message}"),
            GenerateEvent::AwaitingKv { .. } => panic!("not a remote-prefill request"),
        }
    }
    out
}

/// A greedy request (the API default is temperature 1).
fn greedy(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, max_tokens);
    r.sampling.temperature = 0.0;
    r
}

fn run(engine: &Engine, request: GenerateRequest) -> Outcome {
    collect(engine.submit(request).1)
}

const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 plus 2?",
    "Write a haiku about the sea.",
];

#[test]
fn greedy_answer_with_usage_and_stop_reason() {
    let e = engine(EngineConfig::default());
    let prompt = chat("What is the capital of France?");
    let out = run(&e, greedy(prompt.clone(), 32));
    assert_eq!(out.text, "The capital of France is Paris.");
    assert_eq!(out.reason, Some(FinishReason::Stop));
    assert_eq!(out.usage.prompt_tokens as usize, prompt.len());
    assert_eq!(out.usage.completion_tokens as usize, out.ids.len());
    // max_tokens cuts it short.
    let short = run(&e, greedy(prompt, 3));
    assert_eq!(
        (short.ids.len(), short.reason),
        (3, Some(FinishReason::Length))
    );
    assert_eq!(short.ids[..], out.ids[..3]);
}

#[test]
fn batched_requests_match_one_at_a_time() {
    let e = engine(EngineConfig::default());
    let alone: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| run(&e, greedy(chat(q), 24)).ids)
        .collect();
    let receivers: Vec<_> = QUESTIONS
        .iter()
        .map(|q| e.submit(greedy(chat(q), 24)).1)
        .collect();
    let together: Vec<Vec<u32>> = receivers.into_iter().map(|rx| collect(rx).ids).collect();
    assert_eq!(alone, together);
}

#[test]
fn a_repeated_prompt_reuses_its_prefix_and_reports_stored_blocks() {
    let e = engine(EngineConfig::default());
    let mut events = e.subscribe_kv_events();
    let prompt = chat("Name three colors.");
    let first = run(&e, greedy(prompt.clone(), 16));
    assert_eq!(first.cached, 0);
    let second = run(&e, greedy(prompt.clone(), 16));
    let full_blocks = (prompt.len() / 16 * 16) as u32;
    assert_eq!(second.cached, full_blocks.min(prompt.len() as u32 - 1));
    assert_eq!(second.usage.cached_tokens, second.cached);
    assert_eq!(first.ids, second.ids, "reused KV gives the same tokens");
    let first_event = events.try_recv().expect("a KV event");
    assert_eq!(first_event.seq, 1);
    assert!(matches!(
        first_event.event,
        KvEvent::Stored { parent: None, .. }
    ));
    let (seq, hashes) = e.cached_snapshot();
    assert!(seq >= 1 && hashes.len() >= prompt.len() / 16);
}

#[test]
fn preemption_under_a_tiny_cache_recomputes_the_same_tokens() {
    // 14 blocks of 16 tokens: not enough for four ~60-token prompts growing by
    // 24 tokens each at once, so sequences are preempted and recomputed.
    let small = engine(EngineConfig {
        kv_blocks: 14,
        ..EngineConfig::default()
    });
    let roomy = engine(EngineConfig::default());
    let receivers: Vec<_> = QUESTIONS
        .iter()
        .map(|q| small.submit(greedy(chat(q), 24)).1)
        .collect();
    let squeezed: Vec<Vec<u32>> = receivers.into_iter().map(|rx| collect(rx).ids).collect();
    let expected: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| run(&roomy, greedy(chat(q), 24)).ids)
        .collect();
    assert_eq!(squeezed, expected);
    assert_eq!(small.load().kv_blocks_used, 0, "every block came back");
}

#[test]
fn stop_strings_end_the_text_before_them() {
    let e = engine(EngineConfig::default());
    let mut request = greedy(chat("What is the capital of France?"), 32);
    request.stop_strings = vec![" Paris".into()];
    let out = run(&e, request);
    assert_eq!(out.text, "The capital of France is");
    assert_eq!(out.reason, Some(FinishReason::Stop));
}

#[test]
fn dropping_the_receiver_cancels_and_frees_the_blocks() {
    let e = engine(EngineConfig::default());
    let mut request = greedy(chat("Write a haiku about the sea."), 500);
    request.ignore_eos = true;
    let (_, mut rx) = e.submit(request);
    // Wait for the first token, then walk away.
    loop {
        if let Some(GenerateEvent::Token(_)) = rx.blocking_recv() {
            break;
        }
    }
    drop(rx);
    for _ in 0..200 {
        let load = e.load();
        if load.active_requests == 0 && load.kv_blocks_used == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the cancelled request still holds blocks: {:?}", e.load());
}

#[test]
fn bad_requests_get_an_error_event() {
    let e = engine(EngineConfig::default());
    let (_, mut rx) = e.submit(greedy(vec![], 4));
    assert!(matches!(
        rx.blocking_recv(),
        Some(GenerateEvent::Error { .. })
    ));
    let (_, mut rx) = e.submit(greedy(vec![1, 999_999], 4));
    match rx.blocking_recv() {
        Some(GenerateEvent::Error { message, .. }) => {
            assert!(message.contains("999999"), "{message}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn kv_events_replayed_give_the_cache_contents() {
    use std::collections::BTreeSet;
    // A small pool so that blocks are also evicted along the way.
    let e = engine(EngineConfig {
        kv_blocks: 8,
        ..EngineConfig::default()
    });
    let mut events = e.subscribe_kv_events();
    for q in QUESTIONS.iter().chain(QUESTIONS.iter().rev()) {
        run(&e, greedy(chat(q), 12));
    }
    // The snapshot is taken after the events it covers were sent: replay up
    // to its sequence number and compare.
    let (last_seq, snapshot) = e.cached_snapshot();
    let mut cache = BTreeSet::new();
    let mut expected_seq = 1;
    let mut removed = 0;
    while expected_seq <= last_seq {
        let ev = events.blocking_recv().expect("events up to the snapshot");
        assert_eq!(ev.seq, expected_seq, "no gaps");
        expected_seq += 1;
        match ev.event {
            KvEvent::Stored { hashes, .. } => cache.extend(hashes),
            KvEvent::Removed { hashes } => {
                removed += hashes.len();
                for h in hashes {
                    assert!(cache.remove(&h), "removed a block that was never stored");
                }
            }
            KvEvent::AllCleared => cache.clear(),
        }
    }
    assert!(removed > 0, "the small pool evicted something");
    assert_eq!(cache, snapshot.into_iter().collect::<BTreeSet<_>>());
}

#[test]
fn a_shared_prefix_is_computed_once() {
    let e = engine(EngineConfig::default());
    // A long shared system prompt, two different questions.
    let tok = &model().1;
    let system = "You are a careful assistant. ".repeat(30);
    let prompt = |q: &str| {
        let text = tok
            .apply_chat_template(
                &[
                    ChatMessage {
                        role: "system".into(),
                        content: system.clone(),
                    },
                    ChatMessage {
                        role: "user".into(),
                        content: q.into(),
                    },
                ],
                true,
            )
            .unwrap();
        tok.encode(&text).unwrap()
    };
    let (a, b) = (prompt("What is 2 plus 2?"), prompt("Name three colors."));
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let first = run(&e, greedy(a, 8));
    assert_eq!(first.cached, 0);
    let second = run(&e, greedy(b.clone(), 8));
    // Every full block of the shared prefix came from the cache.
    assert_eq!(second.cached as usize, shared / 16 * 16);
    assert!(
        second.cached >= 128,
        "a long prefix was reused ({})",
        second.cached
    );
    // And the answer is what a cold engine gives.
    let cold = run(&engine(EngineConfig::default()), greedy(b, 8));
    assert_eq!(second.ids, cold.ids);
}
