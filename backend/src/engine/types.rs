//! What goes into the engine and what comes out of it.

use super::sampling::SamplingParams;

/// One generation request, already tokenized (also the JSON body of the
/// worker's `/internal/generate`; only `prompt` and `max_tokens` are required).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    #[serde(default)]
    pub sampling: SamplingParams,
    /// The most tokens to generate.
    pub max_tokens: u32,
    /// Token ids that end generation (the model's end tokens are added).
    #[serde(default)]
    pub stop_ids: Vec<u32>,
    /// Strings that end generation; the text ends before them.
    #[serde(default)]
    pub stop_strings: Vec<String>,
    /// Keeps generating past end tokens (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Mixed into the first block hash (tenant isolation); 0 = shared.
    #[serde(default)]
    pub cache_salt: u64,
    /// Retention priority of the prompt's cached blocks.
    #[serde(default)]
    pub cache_priority: u8,
    #[serde(default)]
    pub tenant_id: u32,
    /// Disaggregation: reserve the prompt's KV blocks and wait for a prefill
    /// worker to fill them (the `awaiting_kv` event says which), instead of
    /// prefilling here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remote_prefill: bool,
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
    pub top: Vec<(u32, String, f32)>,
}

/// What the engine sends back for a request, in order: `Started`, any number of
/// `Token`s, then exactly one `Finished`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
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
