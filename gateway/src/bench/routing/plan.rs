//! A trace worked out ahead of the run: the simulator's answers are a
//! function of the prompt (`sluice_backend::sim::next_word`), so every turn's
//! exact prompt tokens are known before any request is sent. From them: the
//! oracle hit rate (what a perfect router with unbounded caches could reuse)
//! and the fleet's capacity under the profile's timing model.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::json;
use sluice_backend::kv::hash::block_hashes;
use sluice_backend::server::Frontend;
use sluice_backend::server::openai::{ChatRequest, from_json};
use sluice_backend::sim::{Profile, next_word};

use super::replay::RequestRecord;
use super::trace::Trace;

/// One request of the trace, worked out.
#[derive(Clone, Debug)]
pub struct PlannedRequest {
    pub session: usize,
    pub turn: usize,
    /// When it would be sent if answers took no time (session arrival at one
    /// session per second, plus think times): the oracle's order.
    pub nominal_time: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Block hashes the worker keeps after serving it (prompt and answer).
    kept_blocks: Vec<u64>,
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub requests: Vec<PlannedRequest>,
    /// Each session's answers, as the simulator will give them.
    pub answers: Vec<Vec<String>>,
    block_size: usize,
}

/// The chat request body of a session's turn `turn`, given the answers so far.
pub fn chat_body(
    trace: &Trace,
    session: usize,
    turn: usize,
    answers: &[String],
    model: &str,
) -> serde_json::Value {
    let s = &trace.sessions[session];
    let mut messages = Vec::new();
    if let Some(system) = &s.system {
        messages.push(json!({"role": "system", "content": system}));
    }
    for (k, t) in s.turns[..=turn].iter().enumerate() {
        messages.push(json!({"role": "user", "content": t.user}));
        if k < turn {
            messages.push(json!({"role": "assistant", "content": answers[k]}));
        }
    }
    json!({
        "model": model,
        "messages": messages,
        "max_tokens": s.turns[turn].output_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

impl Plan {
    /// Works every turn out with the simulator's answer rule; `words` are the
    /// simulator's word tokens for this tokenizer.
    pub fn new(
        trace: &Trace,
        frontend: &Frontend,
        words: &[u32],
        block_size: usize,
    ) -> Result<Plan, String> {
        let mut requests = Vec::new();
        let mut answers = Vec::new();
        for (si, s) in trace.sessions.iter().enumerate() {
            let mut session_answers: Vec<String> = Vec::new();
            let mut t = s.arrival;
            for (ti, turn) in s.turns.iter().enumerate() {
                let body = chat_body(trace, si, ti, &session_answers, &frontend.model_name);
                let request: ChatRequest = from_json(body.to_string().as_bytes())
                    .map_err(|e| format!("session {si} turn {ti}: {}", e.message))?;
                let prompt = frontend
                    .chat(&request)
                    .map_err(|e| format!("session {si} turn {ti}: {}", e.message))?
                    .generate
                    .prompt;
                let mut answer = Vec::with_capacity(turn.output_tokens as usize);
                let mut last = *prompt.last().unwrap_or(&0);
                for k in 0..turn.output_tokens as usize {
                    if prompt.len() + k >= frontend.context {
                        break;
                    }
                    last = next_word(words, last, (prompt.len() + k) as u64);
                    answer.push(last);
                }
                let text = frontend
                    .tokenizer
                    .decode(&answer, true)
                    .map_err(|e| e.to_string())?;
                // The worker keeps the blocks of the prompt and of the answer
                // but its last token (never fed back).
                let mut kept = prompt.clone();
                kept.extend(&answer[..answer.len().saturating_sub(1)]);
                requests.push(PlannedRequest {
                    session: si,
                    turn: ti,
                    nominal_time: t,
                    prompt_tokens: prompt.len(),
                    output_tokens: answer.len(),
                    kept_blocks: block_hashes(&kept, block_size, 0),
                });
                session_answers.push(text);
                t += turn.think;
            }
            answers.push(session_answers);
        }
        Ok(Plan {
            requests,
            answers,
            block_size,
        })
    }

    /// Prompt tokens a perfect router with unbounded caches could serve from
    /// cache, per request, over the first `sessions` sessions: in nominal
    /// order, the longest prefix of each prompt that an earlier request left
    /// in some cache (the last prompt token is always computed).
    pub fn oracle_cached(&self, sessions: usize) -> Vec<usize> {
        let bs = self.block_size;
        let mut order: Vec<usize> = (0..self.requests.len())
            .filter(|&i| self.requests[i].session < sessions)
            .collect();
        order.sort_by(|&a, &b| {
            self.requests[a]
                .nominal_time
                .total_cmp(&self.requests[b].nominal_time)
        });
        let mut cached = vec![0; self.requests.len()];
        let mut seen: HashSet<u64> = HashSet::new();
        for i in order {
            let r = &self.requests[i];
            let prompt_blocks = (r.prompt_tokens / bs).min(r.kept_blocks.len());
            let hit = r.kept_blocks[..prompt_blocks]
                .iter()
                .take_while(|h| seen.contains(h))
                .count();
            cached[i] = (hit * bs).min(r.prompt_tokens.saturating_sub(1));
            seen.extend(r.kept_blocks.iter().copied());
        }
        cached
    }

    /// Cached prompt tokens / prompt tokens for a perfect router, over the
    /// first `sessions` sessions.
    pub fn oracle_hit_rate(&self, sessions: usize) -> f64 {
        let cached: usize = self.oracle_cached(sessions).iter().sum();
        let total: usize = self
            .requests
            .iter()
            .filter(|r| r.session < sessions)
            .map(|r| r.prompt_tokens)
            .sum();
        cached as f64 / total.max(1) as f64
    }

    /// Where a run's cached prompt tokens fall short of the oracle's, as
    /// shares of the run's prompt tokens (so the parts add up to the oracle's
    /// hit rate minus the run's, over the requests that reported their cached
    /// tokens): first turns; later turns served by the worker that served the
    /// session's previous turn (`stayed`), by another (`moved`), or by a
    /// worker the router did not name (`unnamed`: peers).
    pub fn shortfall(&self, sessions: usize, records: &[RequestRecord]) -> serde_json::Value {
        let oracle = self.oracle_cached(sessions);
        let index: HashMap<(usize, usize), usize> = self
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| ((r.session, r.turn), i))
            .collect();
        let worker_of = workers_by_turn(records);
        // (requests, oracle's cached minus the run's) per part.
        let mut parts: BTreeMap<&str, (usize, i64)> = BTreeMap::new();
        let mut prompt_tokens = 0u64;
        for r in records {
            let (Some(cached), Some(&i)) = (r.cached_tokens, index.get(&(r.session, r.turn)))
            else {
                continue;
            };
            prompt_tokens += self.requests[i].prompt_tokens as u64;
            let part = part_of(r, &worker_of);
            let entry = parts.entry(part).or_default();
            entry.0 += 1;
            entry.1 += oracle[i] as i64 - cached as i64;
        }
        let total = prompt_tokens.max(1) as f64;
        parts
            .into_iter()
            .map(|(part, (requests, short))| {
                (
                    part.to_string(),
                    json!({"requests": requests, "share": short as f64 / total}),
                )
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// Requests per second (modelled time) that keep `workers` workers fully
    /// busy when every reusable prefix is cached: per request, the prefill of
    /// its uncached tokens, plus its decode tokens at the reference batch
    /// (a quarter of the worker's running limit, at most 64), each paying its
    /// share of a step and its own context's KV reads.
    pub fn capacity_rps(&self, profile: &Profile, workers: usize) -> f64 {
        let batch = (profile.max_running / 4).clamp(1, 64) as f64;
        let step = profile.overhead_s + profile.weight_s.max(batch * profile.token_s);
        let oracle = self.oracle_cached(usize::MAX);
        let busy: f64 = self
            .requests
            .iter()
            .zip(oracle)
            .map(|(r, cached)| {
                let n = (r.prompt_tokens - cached) as f64;
                let start = cached as f64;
                let prefill =
                    n * profile.token_s + profile.pair_s * (n * start + n * (n + 1.0) / 2.0);
                let context = r.prompt_tokens as f64 + r.output_tokens as f64 / 2.0;
                let decode = r.output_tokens as f64 * (step / batch + context * profile.kv_token_s);
                prefill + decode
            })
            .sum();
        workers as f64 * self.requests.len() as f64 / busy.max(f64::MIN_POSITIVE)
    }
}

/// TTFT (modelled ms) of a run's answered requests by the same parts as
/// [`Plan::shortfall`]: where a router's slow first tokens come from.
pub fn ttft_by_part(records: &[RequestRecord], time_scale: f64) -> serde_json::Value {
    let worker_of = workers_by_turn(records);
    let mut parts: BTreeMap<&str, Vec<&RequestRecord>> = BTreeMap::new();
    for r in records {
        parts.entry(part_of(r, &worker_of)).or_default().push(r);
    }
    parts
        .into_iter()
        .filter_map(|(part, records)| {
            let ms = super::report::sorted_ttft_ms(records.into_iter(), time_scale);
            let p = |q| super::super::percentile(&ms, q);
            let figures = json!({"requests": ms.len(), "p50_ms": p(0.5), "p90_ms": p(0.9)});
            (!ms.is_empty()).then(|| (part.to_string(), figures))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The worker that served each (session, turn), where the router named it.
fn workers_by_turn(records: &[RequestRecord]) -> HashMap<(usize, usize), &str> {
    records
        .iter()
        .filter_map(|r| Some(((r.session, r.turn), r.worker.as_deref()?)))
        .collect()
}

/// A record's part: first turns; later turns served by the worker that
/// served the session's previous turn (`stayed`), by another (`moved`), or
/// by a worker the router did not name (`unnamed`: peers).
fn part_of(r: &RequestRecord, worker_of: &HashMap<(usize, usize), &str>) -> &'static str {
    match (r.turn, worker_of.get(&(r.session, r.turn))) {
        (0, _) => "first_turns",
        (_, None) => "unnamed",
        (t, Some(w)) => match worker_of.get(&(r.session, t - 1)) {
            Some(previous) if previous == w => "stayed",
            _ => "moved",
        },
    }
}
