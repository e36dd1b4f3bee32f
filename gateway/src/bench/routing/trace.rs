//! Replayable multi-turn workloads: a trace is a list of sessions, each with
//! an arrival time (for one session per second on average; the replay scales
//! it to the wanted rate), an optional system prompt and turns (the user's
//! message, the answer's length, the think time before the next turn).
//! Generators: the agentic-coding pattern (seeded, parametrized), ShareGPT
//! conversations and MT-Bench's two-turn questions (files from ../DATA.md's
//! wheels, fetched by `make data`).

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    pub name: String,
    pub sessions: Vec<Session>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Session {
    /// Seconds after the start at one session per second on average.
    pub arrival: f64,
    pub system: Option<String>,
    pub turns: Vec<Turn>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// The user's (or tool's) message.
    pub user: String,
    /// The answer's length in tokens (`max_tokens`; the simulator always
    /// generates exactly this many).
    pub output_tokens: u32,
    /// Seconds between this turn's answer and the next turn.
    pub think: f64,
}

impl Trace {
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// One JSON object per line: the header, then one session per line.
    pub fn to_jsonl(&self) -> String {
        let mut out = serde_json::json!({"trace": self.name}).to_string();
        out.push('\n');
        for s in &self.sessions {
            out.push_str(&serde_json::to_string(s).unwrap_or_default());
            out.push('\n');
        }
        out
    }

    pub fn from_jsonl(text: &str) -> Result<Trace, String> {
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let header: Value = serde_json::from_str(lines.next().ok_or("the trace is empty")?)
            .map_err(|e| format!("trace header: {e}"))?;
        let name = header["trace"]
            .as_str()
            .ok_or("the header has no `trace` name")?;
        let sessions = lines
            .enumerate()
            .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("session {}: {e}", i + 1)))
            .collect::<Result<Vec<Session>, String>>()?;
        Ok(Trace {
            name: name.to_string(),
            sessions,
        })
    }
}

/// Exponential with the given mean (inter-arrival and think times), to the
/// microsecond (so that a trace survives its JSON round trip exactly).
fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    micros(-mean * (1.0 - rng.random::<f64>()).ln())
}

fn micros(seconds: f64) -> f64 {
    (seconds * 1e6).round() / 1e6
}

/// The shape of the agentic-coding trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgenticParams {
    pub sessions: usize,
    /// Turns per session, drawn uniformly from this range (inclusive).
    pub turns: (u32, u32),
    /// Approximate tokens of the system prompt and tool schema every session shares.
    pub shared_prefix_tokens: u32,
    /// Approximate tokens of the task that opens a session.
    pub task_tokens: (u32, u32),
    /// Approximate tokens of each tool result (the later turns).
    pub tool_result_tokens: (u32, u32),
    /// Tokens of each answer (a tool call, or the final answer).
    pub output_tokens: (u32, u32),
    /// Mean think time between turns (the tool running), seconds.
    pub think_mean: f64,
    pub seed: u64,
}

impl Default for AgenticParams {
    fn default() -> Self {
        Self {
            sessions: 200,
            turns: (4, 10),
            shared_prefix_tokens: 3000,
            task_tokens: (100, 400),
            tool_result_tokens: (300, 1500),
            output_tokens: (30, 150),
            think_mean: 1.0,
            seed: 1,
        }
    }
}

/// Words the generated text is made of (about 1.3 tokens each with a BPE
/// vocabulary; the bench reports the real counts from usage).
const WORDS: &[&str] = &[
    "fn", "let", "mut", "self", "return", "match", "error", "result", "value", "config", "request",
    "response", "buffer", "index", "worker", "thread", "async", "await", "string", "vector",
    "option", "parse", "read", "write", "file", "path", "test", "assert", "build", "cache",
    "block", "token", "stream", "client", "server", "route", "policy", "handle", "state", "event",
    "queue", "limit", "timeout", "retry", "status", "header", "body", "json", "field", "struct",
    "trait", "impl", "module", "crate", "import", "export", "call", "the", "a", "of", "to", "in",
    "and", "is", "for", "with", "that", "this", "on", "from", "line",
];

fn words(rng: &mut StdRng, approx_tokens: u32) -> String {
    let n = (approx_tokens as f64 / 1.3).round().max(1.0) as usize;
    let mut out = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            out.push(if i % 12 == 0 { '\n' } else { ' ' });
        }
        out.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    out
}

fn between(rng: &mut StdRng, (lo, hi): (u32, u32)) -> u32 {
    rng.random_range(lo..=hi.max(lo))
}

/// An agentic coding workload: one long system prompt with a tool schema
/// shared by every session; each session opens with a task, then feeds tool
/// results back turn after turn (the context grows by each result and each
/// answer), with think times between turns and Poisson arrivals.
pub fn agentic(p: &AgenticParams) -> Trace {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let tools = [
        "read_file(path)",
        "write_file(path, text)",
        "run_tests(filter)",
        "search_code(query)",
        "list_dir(path)",
        "apply_patch(diff)",
    ];
    let mut system = String::from(
        "You are a coding agent working in a Rust repository. Call one tool per turn \
         with a JSON object; read the results and continue until the task is done.\n\
         Tools:\n",
    );
    for t in tools {
        system.push_str(&format!("- {t}: {}\n", words(&mut rng, 40)));
    }
    system.push_str("Repository guide:\n");
    let have = (system.len() / 4) as u32;
    system.push_str(&words(
        &mut rng,
        p.shared_prefix_tokens.saturating_sub(have),
    ));
    let mut arrival = 0.0;
    let sessions = (0..p.sessions)
        .map(|_| {
            arrival = micros(arrival + exponential(&mut rng, 1.0));
            let n = between(&mut rng, p.turns);
            let turns = (0..n)
                .map(|k| {
                    let user = if k == 0 {
                        let n = between(&mut rng, p.task_tokens);
                        format!("Task: {}", words(&mut rng, n))
                    } else {
                        let n = between(&mut rng, p.tool_result_tokens);
                        format!("Tool result:\n{}", words(&mut rng, n))
                    };
                    Turn {
                        user,
                        output_tokens: between(&mut rng, p.output_tokens),
                        think: exponential(&mut rng, p.think_mean),
                    }
                })
                .collect();
            Session {
                arrival,
                system: Some(system.clone()),
                turns,
            }
        })
        .collect();
    Trace {
        name: "agentic".into(),
        sessions,
    }
}

/// Answers' lengths are clamped to this range (tokens).
const OUTPUT_RANGE: (u32, u32) = (16, 512);

/// Conversations from ShareGPT (the file vLLM's serving benchmark uses): the
/// first `sessions` records with two or more human turns, each human turn a
/// request, each recorded answer's length (about 4 characters a token) its
/// `max_tokens`. The file is cut off mid-record, so it is read record by
/// record and the broken tail is dropped.
pub fn sharegpt(path: &Path, sessions: usize, think_mean: f64, seed: u64) -> Result<Trace, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pos = bytes
        .iter()
        .position(|&b| b == b'[')
        .ok_or("not a JSON array")?
        + 1;
    let mut out = Vec::new();
    let mut arrival = 0.0;
    while out.len() < sessions {
        while pos < bytes.len() && (bytes[pos].is_ascii_whitespace() || bytes[pos] == b',') {
            pos += 1;
        }
        let mut stream = serde_json::Deserializer::from_slice(&bytes[pos..]).into_iter::<Value>();
        let Some(Ok(record)) = stream.next() else {
            break; // the end, or the cut-off record
        };
        pos += stream.byte_offset();
        let Some(conversation) = record["conversations"].as_array() else {
            continue;
        };
        let mut turns: Vec<Turn> = Vec::new();
        let mut pending: Option<String> = None;
        for message in conversation {
            let text = message["value"].as_str().unwrap_or_default();
            match message["from"].as_str() {
                Some("human") => pending = Some(text.to_string()),
                Some("gpt") => {
                    if let Some(user) = pending.take() {
                        let tokens = (text.len() / 4) as u32;
                        turns.push(Turn {
                            user,
                            output_tokens: tokens.clamp(OUTPUT_RANGE.0, OUTPUT_RANGE.1),
                            think: exponential(&mut rng, think_mean),
                        });
                    }
                }
                _ => {}
            }
        }
        if turns.len() < 2 || turns.iter().any(|t| t.user.trim().is_empty()) {
            continue;
        }
        arrival = micros(arrival + exponential(&mut rng, 1.0));
        out.push(Session {
            arrival,
            system: None,
            turns,
        });
    }
    if out.is_empty() {
        return Err(format!("no conversation in {}", path.display()));
    }
    Ok(Trace {
        name: "sharegpt".into(),
        sessions: out,
    })
}

/// MT-Bench's 80 questions, two turns each, answers of 256 tokens.
pub fn mt_bench(path: &Path, think_mean: f64, seed: u64) -> Result<Trace, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut arrival = 0.0;
    let mut sessions = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let q: Value = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        let turns: Vec<Turn> = q["turns"]
            .as_array()
            .map(|t| t.iter().filter_map(Value::as_str).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .map(|user| Turn {
                user: user.to_string(),
                output_tokens: 256,
                think: exponential(&mut rng, think_mean),
            })
            .collect();
        if turns.is_empty() {
            continue;
        }
        arrival = micros(arrival + exponential(&mut rng, 1.0));
        sessions.push(Session {
            arrival,
            system: None,
            turns,
        });
    }
    Ok(Trace {
        name: "mt-bench".into(),
        sessions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agentic_is_seeded_and_shares_one_system_prompt() {
        let p = AgenticParams {
            sessions: 20,
            ..AgenticParams::default()
        };
        let a = agentic(&p);
        assert_eq!(a, agentic(&p), "same seed, same trace");
        assert_ne!(
            a,
            agentic(&AgenticParams {
                seed: 2,
                ..p.clone()
            })
        );
        assert_eq!(a.sessions.len(), 20);
        let system = a.sessions[0].system.as_ref().expect("a system prompt");
        assert!(a.sessions.iter().all(|s| s.system.as_ref() == Some(system)));
        assert!(
            system.len() > 3000 * 3,
            "about 3000 tokens: {} bytes",
            system.len()
        );
        for s in &a.sessions {
            assert!((4..=10).contains(&s.turns.len()));
            assert!(
                s.turns[1..]
                    .iter()
                    .all(|t| t.user.starts_with("Tool result:"))
            );
            assert!(
                s.turns
                    .iter()
                    .all(|t| (30..=150).contains(&t.output_tokens))
            );
        }
        assert!(a.sessions.windows(2).all(|w| w[0].arrival < w[1].arrival));
    }

    #[test]
    fn traces_round_trip_through_jsonl() {
        let t = agentic(&AgenticParams {
            sessions: 3,
            ..AgenticParams::default()
        });
        assert_eq!(Trace::from_jsonl(&t.to_jsonl()).expect("parses"), t);
        assert!(Trace::from_jsonl("").is_err());
    }

    #[test]
    fn sharegpt_reads_records_up_to_a_cut_off_tail() {
        let dir = std::env::temp_dir().join(format!("sluice-sharegpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("sg.json");
        let text = r#"[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there, how can I help you today?"}, {"from": "human", "value": "more"}, {"from": "gpt", "value": "ok"}]},
 {"id": "b", "conversations": [{"from": "human", "value": "one turn"}, {"from": "gpt", "value": "only"}]},
 {"id": "c", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}, {"from": "human", "value": "z"}, {"from": "gpt", "value": "w"}]},
 {"id": "d", "conversations": [{"from": "human", "val"#;
        std::fs::write(&path, text).expect("write");
        let t = sharegpt(&path, 10, 1.0, 1).expect("reads");
        assert_eq!(t.sessions.len(), 2, "a and c; b has one turn, d is cut off");
        assert_eq!(t.sessions[0].turns[0].user, "hi");
        assert_eq!(t.sessions[0].turns[0].output_tokens, 16, "clamped up");
        assert_eq!(t.sessions[1].turns[1].user, "z");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn mt_bench_questions_become_two_turn_sessions() {
        let dir = std::env::temp_dir().join(format!("sluice-mtbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("question.jsonl");
        let text = r#"{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}
{"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]}
"#;
        std::fs::write(&path, text).expect("write");
        let t = mt_bench(&path, 1.0, 1).expect("reads");
        assert_eq!(t.sessions.len(), 2);
        assert_eq!(t.sessions[1].turns[1].user, "And 3+3?");
        assert!(
            t.sessions
                .iter()
                .all(|s| s.turns.len() == 2 && s.system.is_none())
        );
        assert!(mt_bench(&dir.join("missing.jsonl"), 1.0, 1).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
