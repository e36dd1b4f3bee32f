//! The tokenizer and chat template stored in a GGUF file, built with the
//! `tokenizers` crate (byte-level BPE; SmolLM2's pre-tokenizer splits digits one
//! by one) and rendered with minijinja (compiled once; the known ChatML
//! templates written natively, `super::chatml`). Prompts are encoded in
//! segments between added tokens, long ones cached (`super::segments`).

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use super::byte_level::ByteLevelEncoder;
use super::chatml::{ChatMl, DEFAULT_TEMPLATE};
use super::gguf::{Gguf, GgufError};
use super::segments::SegmentEncoder;

/// Why a tokenizer or template could not be built or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer model `{0}` is not supported (gpt2 byte-level BPE is)")]
    Model(String),
    #[error("tokenizer: {0}")]
    Build(String),
    #[error("chat template: {0}")]
    Template(String),
}

/// A chat message for the template.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A model's tokenizer, special tokens and chat template.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    pub eos: u32,
    /// Token ids that end generation (eos, and `<|im_end|>`-style control tokens).
    pub stop_ids: Vec<u32>,
    /// Adds bos before a prompt.
    pub add_bos: bool,
    /// The compiled chat template (`chat`), or why it did not compile.
    template: Result<minijinja::Environment<'static>, String>,
    /// The same template rendered natively, when it is a known ChatML one.
    chatml: Option<ChatMl>,
    /// Segment-wise encoding with a cache, when it is exact for this tokenizer.
    segments: Option<SegmentEncoder>,
    bos_text: String,
    eos_text: String,
}

/// Compiles a chat template once (ChatML when the model has none), with its
/// native renderer when it is a known ChatML template.
fn chat_template(
    source: Option<&str>,
) -> (
    Result<minijinja::Environment<'static>, String>,
    Option<ChatMl>,
) {
    let source = source.unwrap_or(DEFAULT_TEMPLATE);
    (compile_template(source), ChatMl::recognise(source))
}

/// Compiles `source` as the template `chat`, with the functions and Python
/// string methods that Hugging Face templates call.
pub(super) fn compile_template(source: &str) -> Result<minijinja::Environment<'static>, String> {
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template_owned("chat", source.to_string())
        .map_err(|e| e.to_string())?;
    Ok(env)
}

/// ggml token type of control tokens (`<|im_start|>`, ...).
const TOKEN_TYPE_CONTROL: u64 = 3;

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::Model(model.into()));
        }
        let strings = |key: &str| -> Result<Vec<String>, TokenizerError> {
            let values = g.get(key)?.as_array().ok_or_else(|| GgufError::Metadata {
                key: key.into(),
                reason: "not an array".into(),
            })?;
            Ok(values
                .iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect())
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
            .iter()
            .filter_map(|m| m.split_once(' '))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let types: Vec<u64> = g
            .get("tokenizer.ggml.token_type")
            .ok()
            .and_then(|v| v.as_array())
            .map(|a| a.iter().map(|t| t.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let byte_level: PreTokenizerWrapper = ByteLevel::new(false, true, true).into();
        // SmolLM2 (and other "smollm"/"starcoder"-style vocabularies) split
        // every digit on its own before the GPT-2 split.
        let isolate_digits = matches!(pre, "smollm" | "starcoder" | "refact");
        let pre_tokenizer: PreTokenizerWrapper = if isolate_digits {
            Sequence::new(vec![Digits::new(true).into(), byte_level]).into()
        } else {
            byte_level
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevel::default()));
        let control: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(&control);

        let id = |key: &str| g.get_u64(key).ok().map(|v| v as u32);
        let eos = id("tokenizer.ggml.eos_token_id")
            .ok_or_else(|| TokenizerError::Build("no eos token id".into()))?;
        let bos = id("tokenizer.ggml.bos_token_id");
        let text_of = |i: Option<u32>| {
            i.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };
        let mut stop_ids = vec![eos];
        if let Some(end) = tokens
            .iter()
            .position(|t| t == "<|im_end|>" || t == "<|eot_id|>")
        {
            let end = end as u32;
            if !stop_ids.contains(&end) {
                stop_ids.push(end);
            }
        }
        let (template, chatml) = chat_template(g.get_str("tokenizer.chat_template").ok());
        Ok(Tokenizer {
            segments: SegmentEncoder::for_tokenizer(&inner, ByteLevelEncoder::new(isolate_digits)),
            inner,
            bos,
            eos,
            stop_ids,
            add_bos: g
                .get("tokenizer.ggml.add_bos_token")
                .is_ok_and(|v| *v == super::gguf::Value::Bool(true)),
            template,
            chatml,
            bos_text: text_of(bos),
            eos_text: text_of(Some(eos)),
        })
    }

    /// The tokenizer of a Hugging Face folder: `tokenizer.json`, with the special
    /// tokens and chat template of `tokenizer_config.json` when present.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Tokenizer, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| TokenizerError::Build(format!("tokenizer.json: {e}")))?;
        let config: serde_json::Value = std::fs::read(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        // A special token is a string or {"content": string}.
        let token_text = |key: &str| match &config[key] {
            serde_json::Value::String(s) => Some(s.clone()),
            v => v["content"].as_str().map(str::to_string),
        };
        let bos_text = token_text("bos_token");
        let eos_text = token_text("eos_token").ok_or_else(|| {
            TokenizerError::Build("tokenizer_config.json names no eos_token".into())
        })?;
        let eos = inner.token_to_id(&eos_text).ok_or_else(|| {
            TokenizerError::Build(format!("eos token {eos_text:?} is not in the vocabulary"))
        })?;
        let bos = bos_text.as_deref().and_then(|t| inner.token_to_id(t));
        let (template, chatml) = chat_template(config["chat_template"].as_str());
        let mut stop_ids = vec![eos];
        for end in ["<|im_end|>", "<|eot_id|>"] {
            if let Some(id) = inner.token_to_id(end)
                && !stop_ids.contains(&id)
            {
                stop_ids.push(id);
            }
        }
        Ok(Tokenizer {
            // Hugging Face tokenizers: `tokenizers`' own pipeline, whole text.
            segments: None,
            inner,
            bos,
            eos,
            stop_ids,
            add_bos: config["add_bos_token"].as_bool().unwrap_or(false),
            template,
            chatml,
            bos_text: bos_text.unwrap_or_default(),
            eos_text,
        })
    }

    /// Token ids of `text`; control tokens written in the text (`<|im_start|>`)
    /// become their ids. Adds bos when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, self.add_bos)
    }

    /// Token ids of `text` without bos, whatever the model asks: for text a
    /// chat template rendered (it writes its special tokens itself), as
    /// engines encode it.
    pub fn encode_without_bos(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if let (true, Some(bos)) = (add_bos, self.bos) {
            ids.push(bos);
        }
        match &self.segments {
            Some(segments) => segments.encode(text, &self.inner, &mut ids),
            None => self
                .inner
                .encode_fast(text, false)
                .map(|enc| ids.extend_from_slice(enc.get_ids())),
        }
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
        Ok(ids)
    }

    /// Token ids of `text` straight from `tokenizers`, without segments or
    /// cache (the reference [`Tokenizer::encode`] is tested against).
    pub fn encode_uncached(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`, control tokens included when `skip_special` is false.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Build(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Renders the chat template with messages and tools as a client sent
    /// them (JSON, every field kept: tool calls, names), as an engine serving
    /// this model would; used to route requests a gateway forwards unparsed.
    pub fn apply_chat_template_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_chat(
            minijinja::Value::from_serialize(messages),
            tools.map(minijinja::Value::from_serialize),
            add_generation_prompt,
        )
    }

    /// Renders the chat template with `messages` (and the assistant's opening
    /// when `add_generation_prompt`). Models without a template get ChatML.
    /// Known ChatML templates are written natively (`super::chatml`), others
    /// rendered by minijinja.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        if let Some(chatml) = &self.chatml {
            let turns = messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str()));
            return Ok(chatml.render(turns, add_generation_prompt));
        }
        self.render_with_minijinja(messages, add_generation_prompt)
    }

    /// Whether this tokenizer's chat template is rendered natively.
    pub fn renders_template_natively(&self) -> bool {
        self.chatml.is_some()
    }

    /// [`Tokenizer::apply_chat_template`] through minijinja whatever the
    /// template (the reference the native renderer is tested against).
    pub fn render_with_minijinja(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_chat(
            minijinja::Value::from_serialize(messages),
            None,
            add_generation_prompt,
        )
    }

    fn render_chat(
        &self,
        messages: minijinja::Value,
        tools: Option<minijinja::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let env = self
            .template
            .as_ref()
            .map_err(|e| TokenizerError::Template(e.clone()))?;
        env.get_template("chat")
            .and_then(|t| {
                t.render(minijinja::context! {
                    messages => messages,
                    // No tools: undefined, as for a template never given any.
                    tools => tools.unwrap_or(minijinja::Value::UNDEFINED),
                    add_generation_prompt => add_generation_prompt,
                    bos_token => &self.bos_text,
                    eos_token => &self.eos_text,
                })
            })
            .map_err(|e| TokenizerError::Template(e.to_string()))
    }
}
