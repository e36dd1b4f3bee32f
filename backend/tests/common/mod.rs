//! Shared by the worker's integration tests: where the real model is, and
//! JSON over HTTP. Not every test file calls every helper.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `$SLUICE_MODEL`, else the SmolLM2 GGUF that `make model` fetches.
pub fn model_path() -> PathBuf {
    sluice_backend::model::fetched_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
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
