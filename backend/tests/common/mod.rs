//! Shared by the worker's integration tests: where the real model is (and
//! the model, loaded once), JSON
//! over HTTP, a request's generated ids, a KV listener. Not every test file
//! calls every helper.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `$SLUICE_MODEL`, else the SmolLM2 GGUF that `make model` fetches.
pub fn model_path() -> PathBuf {
    sluice_backend::model::fetched_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}

/// SmolLM2 and its tokenizer, loaded once per test binary.
pub fn loaded_model() -> &'static (
    std::sync::Arc<sluice_backend::model::Llama>,
    std::sync::Arc<sluice_backend::model::Tokenizer>,
) {
    use std::sync::{Arc, OnceLock};
    type Loaded = (
        Arc<sluice_backend::model::Llama>,
        Arc<sluice_backend::model::Tokenizer>,
    );
    static MODEL: OnceLock<Loaded> = OnceLock::new();
    MODEL.get_or_init(|| {
        let loaded = sluice_backend::model::load(&model_path())
            .unwrap_or_else(|e| panic!("{e}. Fetch the model with `make model`"));
        (Arc::new(loaded.llama), Arc::new(loaded.tokenizer))
    })
}

/// POSTs JSON; returns the status and the JSON answer (`null` if none).
pub async fn post(url: &str, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// The token ids of `question` as a user turn under the model's chat template.
pub fn chat_tokens(tok: &sluice_backend::model::Tokenizer, question: &str) -> Vec<u32> {
    let text = tok
        .apply_chat_template(
            &[sluice_backend::model::ChatMessage {
                role: "user".into(),
                content: question.into(),
            }],
            true,
        )
        .unwrap();
    tok.encode(&text).unwrap()
}

/// The ids a request generated up to its last event, or the error it ended
/// with; a cancelled request is a test failure.
pub async fn tokens(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<sluice_backend::engine::GenerateEvent>,
) -> Result<Vec<u32>, String> {
    use sluice_backend::engine::{FinishReason, GenerateEvent};
    let mut ids = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            GenerateEvent::Token(t) => ids.push(t.id),
            GenerateEvent::Finished { reason, .. } => {
                assert_ne!(reason, FinishReason::Cancelled);
                return Ok(ids);
            }
            GenerateEvent::Error { message, .. } => return Err(message),
            GenerateEvent::Started { .. } | GenerateEvent::AwaitingKv { .. } => {}
        }
    }
    Err("the stream ended without a last event".into())
}

/// A KV listener for `engine` on a free loopback port (inside a tokio
/// runtime); its address.
pub async fn kv_listener(engine: &std::sync::Arc<sluice_backend::engine::Engine>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(sluice_backend::transfer::tcp::serve_kv(
        listener,
        engine.clone(),
        std::time::Duration::from_secs(30),
    ));
    addr
}

/// Writes `bytes` to a KV listener at `addr` as one connection and reads
/// the frame it answers (a refusal, say).
pub async fn kv_answer(addr: &str, bytes: &[u8]) -> sluice_backend::transfer::wire::Frame {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    sluice_backend::transfer::wire::Frame::read(&mut &answer[..])
        .await
        .unwrap()
        .expect("an answer frame")
}
