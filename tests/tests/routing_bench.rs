//! `sluice bench routing`'s whole pipeline on a tiny fleet: a seeded agentic
//! trace worked out ahead (oracle, capacity), replayed through `sluice serve`
//! with two of our plugins in front of simulated workers, with the
//! simulator's answers matching the plan and every output written.

use serde_json::Value;
use sluice_gateway::bench::routing::trace::AgenticParams;
use sluice_gateway::bench::{RoutingBenchOptions, TraceChoice, run_routing_bench};
use sluice_tests::cluster::{model_path, sluice_bin};
use sluice_tests::plugins_dir;

#[test]
fn a_tiny_routing_bench_runs_end_to_end() {
    let out = std::env::temp_dir().join(format!("sluice-routing-bench-{}", std::process::id()));
    let mut options = RoutingBenchOptions::quick(model_path());
    options.plugins_dir = plugins_dir();
    options.sluice = sluice_bin();
    options.out_dir = out.clone();
    options.workers = 2;
    options.time_scale = 1.0;
    options.window_s = 1.0;
    options.traces = vec![TraceChoice::Agentic(AgenticParams {
        sessions: 10,
        turns: (2, 3),
        shared_prefix_tokens: 400,
        tool_result_tokens: (50, 200),
        think_mean: 0.05,
        ..AgenticParams::default()
    })];
    options.policies = vec!["round-robin".into(), "session-affinity?ttl_ms=60000".into()];
    let mut lines: Vec<Value> = Vec::new();
    let summary = run_routing_bench(&options, |l| lines.push(l.clone())).expect("runs");

    let runs: Vec<&Value> = lines.iter().filter(|l| l.get("policy").is_some()).collect();
    assert_eq!(runs.len(), 2, "{lines:?}");
    for run in &runs {
        assert_eq!(run["errors"], 0, "{run}");
        assert_eq!(
            run["answers_unlike_plan"], 0,
            "the simulator answered as planned: {run}"
        );
        assert!(run["requests"].as_u64().unwrap() >= 20, "{run}");
        let hit = run["hit_rate"].as_f64().unwrap();
        assert!(hit > 0.0 && hit <= 1.0, "{run}");
        assert!(run["ttft_p90_ms"].as_f64().unwrap() > 0.0);
    }
    let oracle = summary["oracle_hit_rate"].as_f64().unwrap();
    // The shortfall's parts add up to the oracle's hit rate minus the run's
    // (the requests' own cached-token counts against the workers' totals).
    for run in &runs {
        let parts = run["hit_shortfall"].as_object().expect("a shortfall split");
        let sum: f64 = parts.values().map(|p| p["share"].as_f64().unwrap()).sum();
        let gap = oracle - run["hit_rate"].as_f64().unwrap();
        assert!((sum - gap).abs() < 1e-6, "{sum} vs {gap}: {run}");
        let requests: u64 = parts
            .values()
            .map(|p| p["requests"].as_u64().unwrap())
            .sum();
        assert_eq!(requests, run["requests"].as_u64().unwrap(), "{run}");
        // TTFT by the same parts: every answered request in one of them.
        let ttft = run["ttft_by_part"].as_object().expect("a TTFT split");
        let timed: u64 = ttft.values().map(|p| p["requests"].as_u64().unwrap()).sum();
        let answered = run["requests"].as_u64().unwrap() - run["errors"].as_u64().unwrap();
        assert_eq!(timed, answered, "{run}");
        let first = &ttft["first_turns"];
        assert!(first["p90_ms"].as_f64().unwrap() >= first["p50_ms"].as_f64().unwrap());
    }
    let sticky = runs
        .iter()
        .find(|r| r["policy"] == "session-affinity?ttl_ms=60000")
        .unwrap();
    assert!(
        sticky["hit_shortfall"].get("moved").is_none(),
        "session affinity moved no turn: {sticky}"
    );
    assert!(oracle > 0.3 && oracle < 1.0, "{summary}");
    for policy in ["round-robin", "session-affinity?ttl_ms=60000"] {
        let hit = summary["hit_rate"][policy].as_f64().unwrap();
        assert!(
            hit <= oracle + 1e-9,
            "no router beats the oracle: {summary}"
        );
        assert!(
            summary["ttft_p90_ms"][policy].as_f64().is_some(),
            "{summary}"
        );
    }
    let plan = lines
        .iter()
        .find(|l| l.get("capacity_rps").is_some())
        .unwrap();
    assert!(plan["capacity_rps"].as_f64().unwrap() > 0.0);

    let table = std::fs::read_to_string(out.join("routing.md")).unwrap();
    assert_eq!(table.lines().count(), 4, "header, rule, two runs:\n{table}");
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("routing.json")).unwrap()).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 2);
    let svg = std::fs::read_to_string(out.join("routing-agentic.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("session-affinity"));
    // The trace is saved, and reads back as the same trace.
    let saved = std::fs::read_to_string(out.join("trace-agentic.jsonl")).unwrap();
    let trace = sluice_gateway::bench::routing::trace::Trace::from_jsonl(&saved).unwrap();
    assert_eq!(trace.sessions.len(), 10);
    std::fs::remove_dir_all(&out).ok();
}
