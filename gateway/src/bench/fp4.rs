//! `sluice bench fp4 --accuracy`: what FP4 weights cost in quality, on the CPU.
//! SmolLM2's linear layers in BF16, MXFP4 and NVFP4 (`WeightFormat`), each
//! scored on the same fixed text (MT-Bench's questions, both turns, from
//! `make data`): perplexity, and how often its greedy next token agrees with
//! the BF16 model's (teacher-forced, every position).

use std::path::PathBuf;

use serde_json::{Value, json};
use sluice_backend::kv::KvStorage;
use sluice_backend::model::{Llama, Logits, SeqChunk, WeightFormat};

use super::routing::trace::mt_bench;

#[derive(Clone, Debug)]
pub struct Fp4BenchOptions {
    pub model: PathBuf,
    /// MT-Bench's question.jsonl.
    pub texts: PathBuf,
    /// Tokens scored in all (texts are cut at 256 tokens each).
    pub max_tokens: usize,
}

/// One format's scores over the text set.
struct Scored {
    nll_sum: f64,
    predicted: usize,
    /// The greedy next token at every scored position, in order.
    argmax: Vec<u32>,
}

fn score(model: &Llama, texts: &[Vec<u32>]) -> Scored {
    let c = &model.config;
    let mut out = Scored {
        nll_sum: 0.0,
        predicted: 0,
        argmax: Vec::new(),
    };
    for tokens in texts {
        let table: Vec<u32> = (0..tokens.len().div_ceil(16) as u32).collect();
        let mut kv = KvStorage::new(c.n_layers, table.len(), 16, c.kv_dim());
        let chunk = [SeqChunk {
            tokens,
            start: 0,
            block_table: &table,
            logits: Logits::All,
        }];
        let logits = model.forward(&mut kv, &chunk).remove(0);
        for (p, row) in logits.chunks(c.vocab).enumerate().take(tokens.len() - 1) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let log_sum = f64::from(max)
                + row
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln();
            out.nll_sum += log_sum - f64::from(row[tokens[p + 1] as usize]);
            out.predicted += 1;
            let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            out.argmax.push(best as u32);
        }
    }
    out
}

/// Runs the comparison, printing one JSON line per format through `emit`;
/// returns the summary.
pub fn run_fp4_accuracy_bench(
    options: &Fp4BenchOptions,
    mut emit: impl FnMut(&Value),
) -> anyhow::Result<Value> {
    let trace = mt_bench(&options.texts, 1.0, 0)
        .map_err(|e| anyhow::anyhow!("{e} (fetch it with `make data`)"))?;
    let tokenizer = sluice_backend::model::load(&options.model)?.tokenizer;
    let mut texts = Vec::new();
    let mut total = 0;
    for session in &trace.sessions {
        let text: Vec<&str> = session.turns.iter().map(|t| t.user.as_str()).collect();
        let mut tokens = tokenizer.encode(&text.join("\n\n"))?;
        tokens.truncate(256);
        if tokens.len() < 2 || total >= options.max_tokens {
            continue;
        }
        tokens.truncate(options.max_tokens - total);
        total += tokens.len();
        texts.push(tokens);
    }
    let mut summary = serde_json::Map::new();
    let mut baseline: Option<Vec<u32>> = None;
    for format in [
        WeightFormat::Bf16,
        WeightFormat::Mxfp4,
        WeightFormat::Nvfp4,
        WeightFormat::AsLoaded,
    ] {
        let started = std::time::Instant::now();
        let model = sluice_backend::model::load(&options.model)?
            .llama
            .with_linear_weights(format)
            .map_err(anyhow::Error::msg)?;
        let s = score(&model, &texts);
        let ppl = (s.nll_sum / s.predicted as f64).exp();
        let agree = baseline.as_ref().map(|b| {
            b.iter().zip(&s.argmax).filter(|(a, b)| a == b).count() as f64 / b.len() as f64
        });
        emit(
            &json!({"bench": "fp4", "weights": format.to_string(), "perplexity": ppl,
                     "greedy_agree_with_bf16": agree, "tokens_scored": s.predicted,
                     "seconds": started.elapsed().as_secs_f64()}),
        );
        let key = format.to_string().replace('-', "_");
        summary.insert(format!("ppl_{key}"), json!(ppl));
        if let Some(a) = agree {
            summary.insert(format!("greedy_agree_{key}"), json!(a));
        }
        if format == WeightFormat::Bf16 {
            baseline = Some(s.argmax);
        }
    }
    summary.insert("texts".into(), json!(texts.len()));
    summary.insert("tokens".into(), json!(total));
    summary.insert("summary".into(), json!(true));
    Ok(Value::Object(summary))
}
