//! `sluice bench fp4 --accuracy` on a small text (two MT-Bench-style
//! questions) with the real SmolLM2: every format is scored, and the figures
//! are what they must be (finite perplexities above 1, agreement rates
//! between 0 and 1, every text scored).

use sluice_gateway::bench::{Fp4BenchOptions, run_fp4_accuracy_bench};
use sluice_tests::cluster::model_path;

#[test]
fn the_fp4_accuracy_bench_scores_every_format() {
    let dir = std::env::temp_dir().join(format!("sluice-fp4-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let texts = dir.join("question.jsonl");
    std::fs::write(
        &texts,
        concat!(
            r#"{"question_id": 1, "category": "writing", "turns": ["Write a short note to a friend about a trip to the mountains.", "Now make it rhyme."]}"#,
            "\n",
            r#"{"question_id": 2, "category": "math", "turns": ["What is the sum of the first ten odd numbers? Explain the pattern."]}"#,
            "\n"
        ),
    )
    .unwrap();
    let options = Fp4BenchOptions {
        model: model_path(),
        texts,
        max_tokens: 40,
    };
    let mut lines = Vec::new();
    let summary = run_fp4_accuracy_bench(&options, |l| lines.push(l.clone())).unwrap();
    assert_eq!(lines.len(), 4, "bf16, mxfp4, nvfp4, as loaded");
    // Both questions, whole: fewer tokens than the cap.
    assert_eq!(summary["texts"], 2);
    let tokens = summary["tokens"].as_u64().unwrap();
    assert!((20..=40).contains(&tokens), "{tokens} tokens");
    for key in ["ppl_bf16", "ppl_mxfp4", "ppl_nvfp4", "ppl_as_loaded"] {
        let ppl = summary[key].as_f64().unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{key} = {ppl}");
    }
    for key in [
        "greedy_agree_mxfp4",
        "greedy_agree_nvfp4",
        "greedy_agree_as_loaded",
    ] {
        let a = summary[key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&a), "{key} = {a}");
    }
    // The BF16 model agrees with itself: its line has no agreement figure.
    assert!(lines[0]["greedy_agree_with_bf16"].is_null());
    std::fs::remove_dir_all(&dir).ok();
}
