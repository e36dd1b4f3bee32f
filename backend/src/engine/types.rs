//! What goes into the engine and what comes out of it.

use super::sampling::SamplingParams;

/// One generation request, already tokenized (also the JSON body of the
/// worker's `/internal/generate`; only `prompt` and `max_tokens` are required,
/// and fields at their defaults are left out of it: most requests carry none
/// but those two, and each field written and read costs the gateway and the
/// worker a few hundred instructions).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    #[serde(default, skip_serializing_if = "is_default")]
    pub sampling: SamplingParams,
    /// The most tokens to generate.
    pub max_tokens: u32,
    /// Token ids that end generation (the model's end tokens are added).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_ids: Vec<u32>,
    /// Strings that end generation; the text ends before them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_strings: Vec<String>,
    /// Keeps generating past end tokens (benchmarks).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignore_eos: bool,
    /// Mixed into the first block hash (tenant isolation); 0 = shared.
    #[serde(default, skip_serializing_if = "is_default")]
    pub cache_salt: u64,
    /// Retention priority of the prompt's cached blocks.
    #[serde(default, skip_serializing_if = "is_default")]
    pub cache_priority: u8,
    #[serde(default, skip_serializing_if = "is_default")]
    pub tenant_id: u32,
    /// Disaggregation: reserve the prompt's KV blocks and wait for a prefill
    /// worker to fill them (the `awaiting_kv` event says which), instead of
    /// prefilling here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remote_prefill: bool,
}

/// Whether `v` is its type's default (such fields are left off the wire).
fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

impl GenerateRequest {
    pub fn new(prompt: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            cache_salt: 0,
            cache_priority: 0,
            tenant_id: 0,
            remote_prefill: false,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end token or a stop string.
    Stop,
    /// `max_tokens`, or the model's context.
    Length,
    /// The client went away or the request was cancelled.
    Cancelled,
}

/// Token counts of a finished (or running) request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenOut {
    pub id: u32,
    /// Text this token completes (may be empty: partial characters and text
    /// that could start a stop string are held back).
    pub text: String,
    pub logprob: f32,
    /// Alternatives, most likely first: (token id, token text, logprob).
    /// Left out of the wire when empty (most requests ask for none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<(u32, String, f32)>,
}

/// What the engine sends back for a request, in order: `Started`, any number of
/// `Token`s, then exactly one `Finished`. On the wire (`/internal/generate`'s
/// NDJSON) a JSON object with an `event` field naming the variant beside the
/// variant's fields; read back through `wire::WireEvent`, not by serde's
/// internally tagged enums, which buffer every event into a tree first.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum GenerateEvent {
    Started {
        prompt_tokens: u32,
        cached_tokens: u32,
    },
    /// A `remote_prefill` request holds its blocks: a prefill worker sends
    /// blocks `from_block..from_block + blocks` of it (the earlier ones are
    /// cached here) under `handle` to `addr`, this worker's KV listener.
    /// `blocks` = 0: everything is cached here; nothing needs sending.
    AwaitingKv {
        handle: u64,
        from_block: u32,
        blocks: u32,
        /// Filled in by the worker's server.
        #[serde(default)]
        addr: String,
    },
    Token(TokenOut),
    Finished {
        reason: FinishReason,
        /// Held-back text released at the end.
        text: String,
        usage: Usage,
    },
    /// The request could not run (prompt longer than the context or the cache),
    /// or (from the gateway) its worker failed or timed out.
    Error {
        message: String,
        /// The HTTP status a non-streaming answer gets; absent = 400.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<u16>,
    },
}

/// The worker's load, as the gateway's router sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Load {
    pub active_requests: u32,
    pub waiting_requests: u32,
    pub queued_prefill_tokens: u32,
    pub kv_blocks_used: u32,
    pub kv_blocks_total: u32,
}

impl GenerateEvent {
    /// Reads one line of `/internal/generate`'s NDJSON. Most lines are
    /// tokens: one in the exact form a worker writes is read without serde
    /// ([`token_line`](super::token_line)); another that starts as a
    /// token's, as a token's fields alone (a fifth fewer instructions than
    /// through every variant's); any other line as
    /// [`Deserialize`](serde::Deserialize) reads it. All three accept and
    /// refuse the same token lines.
    pub fn from_line(line: &str) -> serde_json::Result<GenerateEvent> {
        if let Some(token) = super::token_line::plain_token_line(line) {
            return Ok(GenerateEvent::Token(token));
        }
        if line.starts_with(r#"{"event":"token","#) {
            return serde_json::from_str::<TokenOut>(line).map(GenerateEvent::Token);
        }
        serde_json::from_str(line)
    }
}

impl<'de> serde::Deserialize<'de> for GenerateEvent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        wire::WireEvent::deserialize(d)?
            .into_event()
            .map_err(serde::de::Error::missing_field)
    }
}

/// Reading a [`GenerateEvent`] in one pass: every variant's fields in one
/// flat struct, then the variant's own checked for presence.
mod wire {
    use super::{FinishReason, GenerateEvent, TokenOut, Usage};

    #[derive(serde::Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Tag {
        Started,
        AwaitingKv,
        Token,
        Finished,
        Error,
    }

    #[derive(serde::Deserialize)]
    pub struct WireEvent {
        event: Tag,
        prompt_tokens: Option<u32>,
        cached_tokens: Option<u32>,
        handle: Option<u64>,
        from_block: Option<u32>,
        blocks: Option<u32>,
        #[serde(default)]
        addr: String,
        id: Option<u32>,
        text: Option<String>,
        logprob: Option<f32>,
        top: Option<Vec<(u32, String, f32)>>,
        reason: Option<FinishReason>,
        usage: Option<Usage>,
        message: Option<String>,
        status: Option<u16>,
    }

    /// `value`, or the name of the missing field.
    fn need<T>(value: Option<T>, name: &'static str) -> Result<T, &'static str> {
        value.ok_or(name)
    }

    impl WireEvent {
        /// The event, or the name of a field its variant needs and lacks.
        pub fn into_event(self) -> Result<GenerateEvent, &'static str> {
            Ok(match self.event {
                Tag::Started => GenerateEvent::Started {
                    prompt_tokens: need(self.prompt_tokens, "prompt_tokens")?,
                    cached_tokens: need(self.cached_tokens, "cached_tokens")?,
                },
                Tag::AwaitingKv => GenerateEvent::AwaitingKv {
                    handle: need(self.handle, "handle")?,
                    from_block: need(self.from_block, "from_block")?,
                    blocks: need(self.blocks, "blocks")?,
                    addr: self.addr,
                },
                Tag::Token => GenerateEvent::Token(TokenOut {
                    id: need(self.id, "id")?,
                    text: need(self.text, "text")?,
                    logprob: need(self.logprob, "logprob")?,
                    top: self.top.unwrap_or_default(),
                }),
                Tag::Finished => GenerateEvent::Finished {
                    reason: need(self.reason, "reason")?,
                    text: need(self.text, "text")?,
                    usage: need(self.usage, "usage")?,
                },
                Tag::Error => GenerateEvent::Error {
                    message: need(self.message, "message")?,
                    status: self.status,
                },
            })
        }
    }
}

#[cfg(test)]
mod generate_event_tests {
    use super::*;

    /// A request at its defaults is its prompt and max_tokens alone on the
    /// wire; every field set reads back as it was; and a field left out
    /// reads as its default.
    #[test]
    fn requests_leave_defaults_out_and_read_back_as_written() {
        let plain = GenerateRequest::new(vec![1, 2, 3], 16);
        let json = serde_json::to_string(&plain).unwrap();
        assert_eq!(json, r#"{"prompt":[1,2,3],"max_tokens":16}"#);
        assert_eq!(
            serde_json::from_str::<GenerateRequest>(&json).unwrap(),
            plain
        );
        let full = GenerateRequest {
            prompt: vec![5],
            sampling: SamplingParams {
                temperature: 0.5,
                top_p: 0.9,
                top_k: 40,
                seed: Some(7),
                presence_penalty: 0.25,
                frequency_penalty: -0.5,
                logprobs: true,
                top_logprobs: 3,
            },
            max_tokens: 4,
            stop_ids: vec![2],
            stop_strings: vec!["\n\n".into()],
            ignore_eos: true,
            cache_salt: 99,
            cache_priority: 2,
            tenant_id: 11,
            remote_prefill: true,
        };
        let json = serde_json::to_string(&full).unwrap();
        assert_eq!(
            serde_json::from_str::<GenerateRequest>(&json).unwrap(),
            full,
            "{json}"
        );
        // One sampling setting changed: the others, still written, keep theirs.
        let mut one = plain.clone();
        one.sampling.temperature = 0.0;
        let json = serde_json::to_string(&one).unwrap();
        assert!(json.contains(r#""temperature":0.0"#), "{json}");
        assert_eq!(serde_json::from_str::<GenerateRequest>(&json).unwrap(), one);
    }

    /// Every variant reads back as it was written, and a variant without
    /// one of its fields, or an unknown variant, is refused.
    #[test]
    fn events_read_back_as_written_and_incomplete_ones_are_refused() {
        let events = [
            GenerateEvent::Started {
                prompt_tokens: 12,
                cached_tokens: 8,
            },
            GenerateEvent::AwaitingKv {
                handle: 7,
                from_block: 1,
                blocks: 3,
                addr: "10.0.0.2:9000".into(),
            },
            GenerateEvent::Token(TokenOut {
                id: 42,
                text: "hi".into(),
                logprob: -0.5,
                top: vec![(42, "hi".into(), -0.5), (7, "ho".into(), -1.25)],
            }),
            GenerateEvent::Finished {
                reason: FinishReason::Length,
                text: " end".into(),
                usage: Usage {
                    prompt_tokens: 12,
                    completion_tokens: 3,
                    cached_tokens: 8,
                },
            },
            GenerateEvent::Error {
                message: "too long".into(),
                status: Some(413),
            },
            GenerateEvent::Error {
                message: "bad".into(),
                status: None,
            },
        ];
        for event in events {
            let json = serde_json::to_string(&event).unwrap();
            let back: GenerateEvent = serde_json::from_str(&json).unwrap();
            assert_eq!(back, event, "{json}");
            assert_eq!(GenerateEvent::from_line(&json).unwrap(), event, "{json}");
        }
        // A token line read by `from_line`'s shortcut: fields in any order
        // after the tag, `top` optional (written only when not empty), and
        // refused without one of the others, as by the general reader.
        let token = |top| {
            GenerateEvent::Token(TokenOut {
                id: 9,
                text: "x".into(),
                logprob: -1.5,
                top,
            })
        };
        let top = vec![(3, "y".to_string(), -2.0)];
        assert_eq!(
            serde_json::to_string(&token(vec![])).unwrap(),
            r#"{"event":"token","id":9,"text":"x","logprob":-1.5}"#
        );
        for (line, expected) in [
            (
                r#"{"event":"token","top":[[3,"y",-2.0]],"logprob":-1.5,"text":"x","id":9}"#,
                token(top),
            ),
            (
                r#"{"event":"token","top":[],"logprob":-1.5,"text":"x","id":9}"#,
                token(vec![]),
            ),
            (
                r#"{"event":"token","logprob":-1.5,"text":"x","id":9}"#,
                token(vec![]),
            ),
        ] {
            assert!(line.starts_with(r#"{"event":"token","#));
            assert_eq!(GenerateEvent::from_line(line).unwrap(), expected, "{line}");
            assert_eq!(
                serde_json::from_str::<GenerateEvent>(line).unwrap(),
                expected,
                "{line}"
            );
        }
        for field in ["id", "text", "logprob"] {
            let mut fields = vec![r#""id":9"#, r#""text":"x""#, r#""logprob":-1.5"#];
            fields.retain(|f| !f.starts_with(&format!("\"{field}\"")));
            let line = format!(r#"{{"event":"token",{}}}"#, fields.join(","));
            let err = GenerateEvent::from_line(&line).unwrap_err();
            assert!(err.to_string().contains(field), "{line}: {err}");
            assert!(serde_json::from_str::<GenerateEvent>(&line).is_err());
        }
        // The worker's address is filled in by its server: absent = empty.
        let e: GenerateEvent =
            serde_json::from_str(r#"{"event":"awaiting_kv","handle":1,"from_block":0,"blocks":0}"#)
                .unwrap();
        assert!(matches!(e, GenerateEvent::AwaitingKv { addr, .. } if addr.is_empty()));
        for (json, missing) in [
            (r#"{"event":"started","prompt_tokens":3}"#, "cached_tokens"),
            (r#"{"event":"token","id":1,"text":"a"}"#, "logprob"),
            (r#"{"event":"finished","reason":"stop","text":""}"#, "usage"),
            (r#"{"event":"error"}"#, "message"),
        ] {
            let err = serde_json::from_str::<GenerateEvent>(json).unwrap_err();
            assert!(err.to_string().contains(missing), "{json}: {err}");
        }
        assert!(serde_json::from_str::<GenerateEvent>(r#"{"event":"bogus"}"#).is_err());
        assert!(serde_json::from_str::<GenerateEvent>(r#"{"text":"no tag"}"#).is_err());
    }
}
