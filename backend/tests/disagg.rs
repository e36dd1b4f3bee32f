//! Disaggregated prefill/decode between two engines on the real model
//! (SmolLM2-135M, `make model`), KV over the real TCP transport on loopback:
//! greedy outputs equal aggregated ones token for token, a prefix cached on
//! the decode worker is not sent again, and transfers broken at random
//! points leak no block on either side.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::tokens;
use sluice_backend::engine::{Engine, EngineConfig, GenerateEvent, GenerateRequest};
use sluice_backend::transfer::tcp::{TcpTransport, serve_kv};
use sluice_backend::transfer::wire::Frame;
use sluice_backend::transfer::{KvTarget, KvTransport, TransferError};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc::UnboundedReceiver;

fn engine(config: EngineConfig) -> Arc<Engine> {
    let (m, t) = common::loaded_model();
    Arc::new(Engine::start(m.clone(), t.clone(), config))
}

/// A decode engine with its KV listener; returns it and the listener's address.
async fn decode_worker(config: EngineConfig) -> (Arc<Engine>, String) {
    let engine = engine(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(serve_kv(listener, engine.clone(), Duration::from_secs(10)));
    (engine, addr)
}

fn chat(question: &str) -> Vec<u32> {
    common::chat_tokens(&common::loaded_model().1, question)
}

fn greedy(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, max_tokens);
    r.sampling.temperature = 0.0;
    r
}

/// Reserves `request`'s blocks on `decode`: its events, the handle, the
/// first block wanted and the block count.
async fn reserve(
    decode: &Engine,
    request: &GenerateRequest,
) -> (UnboundedReceiver<GenerateEvent>, u64, u32, u32) {
    let r = decode.reserve_kv(request.clone()).await.unwrap();
    (r.events, r.handle, r.from_block, r.blocks)
}

/// 1P1D: prefill on `prefill`, KV over TCP, decode on `decode`.
async fn disaggregated(
    prefill: &Engine,
    decode: &Engine,
    kv_addr: &str,
    request: &GenerateRequest,
) -> (Vec<u32>, u32) {
    let (mut rx, handle, from_block, blocks) = reserve(decode, request).await;
    if blocks > 0 {
        let (_, _events, kv) = prefill.submit_prefill(request.clone(), from_block, None);
        let target = KvTarget {
            addr: kv_addr.to_string(),
            handle,
            from_block,
        };
        let pushed = TcpTransport::default()
            .push(target, prefill.kv_layout, kv)
            .await
            .unwrap();
        assert_eq!(pushed.blocks, blocks, "every reserved block was sent");
        assert_eq!(
            pushed.bytes,
            u64::from(blocks) * prefill.kv_layout.block_bytes() as u64
        );
    }
    (tokens(&mut rx).await.unwrap(), from_block)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_greedy_equals_aggregated() {
    let aggregated = engine(EngineConfig::default());
    // Small steps on the prefill side: the KV leaves in several chunks.
    let prefill = engine(EngineConfig {
        step_tokens: 24,
        ..EngineConfig::default()
    });
    let (decode, kv_addr) = decode_worker(EngineConfig::default()).await;
    let long = "Explain, step by step and in detail, how a bill becomes a law in a \
                parliamentary democracy, and what can stop it on the way.";
    for question in [
        "What is the capital of France?",
        "Name three colors.",
        "Write a haiku about the sea.",
        long,
    ] {
        let request = greedy(chat(question), 24);
        let (_, mut rx) = aggregated.submit(request.clone());
        let want = tokens(&mut rx).await.unwrap();
        let (got, from_block) = disaggregated(&prefill, &decode, &kv_addr, &request).await;
        assert_eq!(got, want, "{question:?}");
        assert!(!want.is_empty());
        // Every question starts with the same system prompt, cached on the
        // decode worker after the first: only the rest is sent.
        if question != "What is the capital of France?" {
            assert!(
                from_block > 0,
                "{question:?}: the shared prefix was sent again"
            );
        }
    }
    // Nothing is held once every request has finished.
    wait_idle(&prefill).await;
    wait_idle(&decode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_cached_on_the_decode_worker_needs_no_transfer() {
    let (decode, _) = decode_worker(EngineConfig::default()).await;
    // Whole blocks and one token: the full blocks are cached after the first
    // run, and the last token is the decode worker's own to run.
    let mut prompt = chat("Name three colors, and say which one you like best.");
    prompt.truncate((prompt.len() - 1) / 16 * 16 + 1);
    let request = greedy(prompt, 12);
    let (_, mut rx) = decode.submit(request.clone());
    let want = tokens(&mut rx).await.unwrap();
    let (mut rx, _, _, blocks) = reserve(&decode, &request).await;
    assert_eq!(blocks, 0, "the whole prompt is cached there");
    assert_eq!(tokens(&mut rx).await.unwrap(), want);
}

/// Waits until the engine holds no block and runs nothing.
async fn wait_idle(engine: &Engine) {
    for _ in 0..200 {
        let load = engine.load();
        if load.kv_blocks_used == 0 && load.active_requests == 0 && load.waiting_requests == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("blocks leaked: {:?}", engine.load());
}

/// A tiny seeded generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// 100 transfers, each broken at a random point in one of five ways; every
/// decode request ends with an error (or, when its client left, quietly),
/// and afterwards neither engine holds a block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_killed_at_random_points_leak_no_block() {
    let prefill = engine(EngineConfig {
        step_tokens: 16,
        ..EngineConfig::default()
    });
    let (decode, kv_addr) = decode_worker(EngineConfig {
        kv_wait: Duration::from_millis(300),
        ..EngineConfig::default()
    })
    .await;
    let questions = [
        "What is the capital of France?",
        "Name three colors.",
        "Write a haiku about the sea.",
        "What is 2 plus 2?",
    ];
    let mut rng = Rng(2026);
    let mut ways = [0u32; 5];
    for i in 0..100 {
        // A different prompt each time (nothing cached on the decode side
        // beyond the shared system prompt).
        let question = format!("{} ({i})", questions[i % questions.len()]);
        let request = greedy(chat(&question), 4);
        let (mut rx, handle, from_block, blocks) = reserve(&decode, &request).await;
        assert!(blocks > 0);
        let target = KvTarget {
            addr: kv_addr.clone(),
            handle,
            from_block,
        };
        let way = rng.below(5) as usize;
        ways[way] += 1;
        match way {
            // The prefill worker dies mid-transfer: its push (and export)
            // are dropped after a random time.
            0 => {
                let (_, events, kv) = prefill.submit_prefill(request.clone(), from_block, None);
                let push = TcpTransport::default().push(target, prefill.kv_layout, kv);
                let after = Duration::from_millis(rng.below(40));
                let finished = tokio::time::timeout(after, push).await;
                drop(events);
                match finished {
                    // It finished first: the request decodes normally.
                    Ok(Ok(_)) => {
                        tokens(&mut rx).await.unwrap();
                        continue;
                    }
                    Ok(Err(e)) => panic!("an unbroken push failed: {e}"),
                    Err(_) => {}
                }
            }
            // A sender that sends a random prefix of a valid transfer's
            // bytes, then closes (a crash anywhere, mid-frame included).
            1 => {
                let bytes = valid_transfer(&target, &decode, blocks).await;
                let cut = rng.below(bytes.len() as u64) as usize;
                let mut s = tokio::net::TcpStream::connect(&kv_addr).await.unwrap();
                s.write_all(&bytes[..cut]).await.unwrap();
                drop(s);
            }
            // A flipped bit: the checksum catches it.
            2 => {
                let mut bytes = valid_transfer(&target, &decode, blocks).await;
                let at =
                    sluice_backend::transfer::wire::HEADER_BYTES * 2 + 8 + rng.below(1000) as usize;
                bytes[at] ^= 1;
                let ack = common::kv_answer(&kv_addr, &bytes).await;
                assert!(
                    matches!(&ack, Frame::Ack { ok: false, message, .. } if message.contains("checksum")),
                    "{ack:?}"
                );
            }
            // Nobody comes: the reservation times out.
            3 => {}
            // The client goes away mid-transfer.
            4 => {
                let (_, _events, kv) = prefill.submit_prefill(request.clone(), from_block, None);
                drop(rx);
                let r = TcpTransport::default()
                    .push(target, prefill.kv_layout, kv)
                    .await;
                // Refused (no such request) unless the push won the race.
                if let Err(e) = r {
                    assert!(
                        matches!(e, TransferError::Refused(_) | TransferError::Io(_)),
                        "{e}"
                    );
                }
                continue;
            }
            _ => unreachable!(),
        }
        let error = tokens(&mut rx)
            .await
            .expect_err("a broken transfer must fail");
        assert!(
            error.contains("KV") || error.contains("transfer"),
            "{error}"
        );
    }
    assert!(ways.iter().all(|&n| n > 5), "every way was tried: {ways:?}");
    wait_idle(&prefill).await;
    wait_idle(&decode).await;
    // Both still work.
    let request = greedy(chat("Name three colors."), 6);
    let (_, mut rx) = prefill.submit(request.clone());
    let want = tokens(&mut rx).await.unwrap();
    let (got, _) = disaggregated(&prefill, &decode, &kv_addr, &request).await;
    assert_eq!(got, want);
}

/// The bytes of a whole valid transfer of `blocks` zeroed blocks.
async fn valid_transfer(target: &KvTarget, decode: &Engine, blocks: u32) -> Vec<u8> {
    let layout = decode.kv_layout;
    let mut out = Vec::new();
    let frames = [
        Frame::Hello {
            handle: target.handle,
            layout,
        },
        Frame::Chunk {
            handle: target.handle,
            first_block: target.from_block,
            n_blocks: blocks,
            data: vec![0; blocks as usize * layout.block_bytes()],
        },
        Frame::Done {
            handle: target.handle,
            blocks,
        },
    ];
    for f in &frames {
        f.write(&mut out).await.unwrap();
    }
    out
}
