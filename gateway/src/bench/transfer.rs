//! `sluice bench transfer` without a GPU: the TCP KV transport on loopback
//! between two engines on the real model (MB/s of KV moved into the decode
//! engine's reserved blocks, the decode side's writes included), and the
//! time to first token of a disaggregated request split into prefill,
//! transfer tail and first decode step, against the same prompt served
//! aggregated.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_backend::engine::{Engine, EngineConfig, GenerateEvent, GenerateRequest, Reservation};
use sluice_backend::transfer::tcp::{TcpTransport, serve_kv};
use sluice_backend::transfer::{KvExport, KvTarget, KvTransport};
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Clone, Debug)]
pub struct TransferBenchOptions {
    pub model: std::path::PathBuf,
    /// Prompt length of the TTFT comparison.
    pub prompt_tokens: usize,
    /// Timed repetitions of each measurement (the median is reported).
    pub repeats: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum TransferBenchError {
    #[error("cannot load the model: {0}")]
    Model(#[from] sluice_backend::model::LoadError),
    #[error("{0}")]
    Run(String),
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    super::percentile(&v, 0.5)
}

/// Prompt `i` of `n` tokens: ids spread over the vocabulary, different for
/// every `i`, so nothing is cached.
fn prompt(i: usize, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|j| ((i * 7919 + j * 104_729 + 1) % (vocab - 1)) as u32)
        .collect()
}

/// Waits for the first token (or the end).
async fn first_token(rx: &mut UnboundedReceiver<GenerateEvent>) -> Result<(), TransferBenchError> {
    while let Some(event) = rx.recv().await {
        match event {
            GenerateEvent::Token(_) | GenerateEvent::Finished { .. } => return Ok(()),
            GenerateEvent::Error { message, .. } => return Err(TransferBenchError::Run(message)),
            _ => {}
        }
    }
    Err(TransferBenchError::Run("the engine stopped".into()))
}

pub async fn run_transfer_bench(
    options: &TransferBenchOptions,
) -> Result<serde_json::Value, TransferBenchError> {
    let loaded = sluice_backend::model::load(&options.model)?;
    let llama = Arc::new(loaded.llama);
    let tokenizer = Arc::new(loaded.tokenizer);
    let context = llama.config.context;
    let vocab = llama.config.vocab;
    // Room for the longest prompt the model takes, in 16-token blocks.
    let longest = (context - 16).min(8192);
    let config = EngineConfig {
        kv_blocks: (longest / 16 + 64) as u32,
        ..EngineConfig::default()
    };
    let start = |config: &EngineConfig| {
        Arc::new(Engine::start(
            llama.clone(),
            tokenizer.clone(),
            config.clone(),
        ))
    };
    let (prefill, decode, aggregated) = (start(&config), start(&config), start(&config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| TransferBenchError::Run(e.to_string()))?;
    let addr = listener
        .local_addr()
        .map_err(|e| TransferBenchError::Run(e.to_string()))?
        .to_string();
    tokio::spawn(serve_kv(listener, decode.clone(), Duration::from_secs(60)));
    let transport = TcpTransport::default();
    let layout = prefill.kv_layout;

    // 1. The transport alone: made-up KV for the longest prompt, in
    // chunks of one default prefill step (256 tokens, 16 blocks).
    let mut rates = Vec::new();
    let mut moved = 0u64;
    for i in 0..options.repeats + 1 {
        let mut request = GenerateRequest::new(prompt(1000 + i, longest, vocab), 1);
        request.ignore_eos = true;
        let Reservation {
            events: mut rx,
            handle,
            from_block,
            blocks,
        } = decode
            .reserve_kv(request)
            .await
            .map_err(TransferBenchError::Run)?;
        let (tx, chunks) = tokio::sync::mpsc::unbounded_channel();
        let per_chunk = 16u32;
        let mut first = from_block;
        while first < from_block + blocks {
            let n = per_chunk.min(from_block + blocks - first);
            let _ = tx.send(KvExport {
                first_block: first,
                n_blocks: n,
                data: vec![(i % 251) as u8; n as usize * layout.block_bytes()],
                in_place: false,
            });
            first += n;
        }
        drop(tx);
        let target = KvTarget {
            addr: addr.clone(),
            handle,
            from_block,
        };
        let pushed = transport
            .push(target, layout, chunks)
            .await
            .map_err(|e| TransferBenchError::Run(e.to_string()))?;
        first_token(&mut rx).await?;
        let mb_s = pushed.bytes as f64 / 1e6 / pushed.seconds;
        println!(
            "{}",
            json!({"bench": "transfer", "what": "tcp", "warmup": i == 0, "blocks": pushed.blocks,
                   "bytes": pushed.bytes, "seconds": pushed.seconds, "mb_s": mb_s})
        );
        if i > 0 {
            rates.push(mb_s);
            moved = pushed.bytes;
        }
    }
    let tcp_mb_s = median(rates);

    // 2. TTFT: aggregated against prefill + transfer + first decode step.
    let n = options.prompt_tokens.min(longest);
    let (mut aggregated_ms, mut disagg_ms) = (Vec::new(), Vec::new());
    let (mut prefill_ms, mut tail_ms, mut decode_ms) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..options.repeats + 1 {
        let mut request = GenerateRequest::new(prompt(2 * i, n, vocab), 1);
        request.ignore_eos = true;
        let t0 = Instant::now();
        let (_, mut rx) = aggregated.submit(request.clone());
        first_token(&mut rx).await?;
        let aggregated_ttft = t0.elapsed();

        let request = GenerateRequest {
            prompt: prompt(2 * i + 1, n, vocab),
            ..request
        };
        let t0 = Instant::now();
        let Reservation {
            events: mut rx,
            handle,
            from_block,
            ..
        } = decode
            .reserve_kv(request.clone())
            .await
            .map_err(TransferBenchError::Run)?;
        let (_, mut events, kv) = prefill.submit_prefill(request.clone(), from_block, None);
        let target = KvTarget {
            addr: addr.clone(),
            handle,
            from_block,
        };
        let push = tokio::spawn(transport.push(target, layout, kv));
        // The prefill is done when its engine says so.
        while let Some(e) = events.recv().await {
            if let GenerateEvent::Finished { .. } | GenerateEvent::Error { .. } = e {
                break;
            }
        }
        let prefilled = t0.elapsed();
        push.await
            .map_err(|e| TransferBenchError::Run(e.to_string()))?
            .map_err(|e| TransferBenchError::Run(e.to_string()))?;
        let landed = t0.elapsed();
        first_token(&mut rx).await?;
        let ttft = t0.elapsed();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{}",
            json!({"bench": "transfer", "what": "ttft", "warmup": i == 0, "prompt_tokens": n,
                   "aggregated_ms": ms(aggregated_ttft), "disaggregated_ms": ms(ttft),
                   "prefill_ms": ms(prefilled), "transfer_tail_ms": ms(landed - prefilled),
                   "first_decode_ms": ms(ttft - landed)})
        );
        if i > 0 {
            aggregated_ms.push(ms(aggregated_ttft));
            disagg_ms.push(ms(ttft));
            prefill_ms.push(ms(prefilled));
            tail_ms.push(ms(landed - prefilled));
            decode_ms.push(ms(ttft - landed));
        }
    }
    Ok(json!({
        "bench": "transfer",
        "summary": true,
        "transport": "tcp loopback",
        "kv_block_bytes": layout.block_bytes(),
        "tcp_bytes_per_transfer": moved,
        "tcp_mb_s": tcp_mb_s,
        "prompt_tokens": n,
        "ttft_aggregated_ms": median(aggregated_ms),
        "ttft_disaggregated_ms": median(disagg_ms),
        "prefill_ms": median(prefill_ms),
        "transfer_tail_ms": median(tail_ms),
        "first_decode_ms": median(decode_ms),
    }))
}
