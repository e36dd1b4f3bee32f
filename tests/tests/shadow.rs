//! Shadow routing and the decision log, end to end: a round-robin router
//! routes while the kv-aware plugin runs in shadow (counted, never acted
//! on), every decision's inputs land in the decision log, and `sluice
//! plugins replay` asks a plugin about that log offline.

use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::cluster::{ADMIN_TOKEN, Cluster, chat, sluice_bin};
use sluice_tests::{plugin_wasm, plugins_dir};

const CHAT: &str = "/v1/chat/completions";

async fn put_shadow(cluster: &Cluster, body: Vec<u8>) -> (u16, Value) {
    let r = cluster
        .client
        .put(format!("{}/admin/plugins/router/shadow", cluster.url))
        .query(&[("name", "kv-aware")])
        .bearer_auth(ADMIN_TOKEN)
        .body(body)
        .send()
        .await
        .expect("PUT shadow");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn delete_shadow(cluster: &Cluster) -> u16 {
    cluster
        .client
        .delete(format!("{}/admin/plugins/router/shadow", cluster.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("DELETE shadow")
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_router_is_counted_never_obeyed_and_the_log_replays() {
    let dir = std::env::temp_dir().join(format!("sluice-shadow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decisions.jsonl");
    let log_for_config = log.clone();
    let cluster = Cluster::start(2, move |c| c.routing.decision_log = Some(log_for_config)).await;
    let (status, body) = cluster.put_plugin("router", "round-robin", "").await;
    assert_eq!(status, 200, "{body}");

    // A component that is not one is refused, and no shadow runs.
    let (status, body) = put_shadow(&cluster, b"not wasm".to_vec()).await;
    assert_eq!(status, 422, "{body}");
    assert!(cluster.admin_get("/admin/plugins").await["shadow"]["candidate"].is_null());
    let (status, body) = put_shadow(&cluster, plugin_wasm("kv-aware")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["shadow"]["name"], "kv-aware");

    // The same long prompt, again and again: kv-aware would keep it where it
    // is cached, round-robin alternates.
    let system = "You are the assistant of a bicycle repair shop. You answer questions \
                  about repairs, spare parts, prices and opening hours, briefly and \
                  politely, and you never promise a repair date you cannot keep.";
    let mut served = Vec::new();
    for i in 0..8 {
        let (status, headers, body) = cluster
            .post(
                CHAT,
                &chat(&[("system", system), ("user", "Do you fix brakes?")], 4),
            )
            .await;
        assert_eq!(status, 200, "request {i}: {body}");
        served.push(headers["x-sluice-worker"].to_str().unwrap().to_string());
        // Let the worker's KV events reach the index before the next one.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_ne!(served[0], served[1], "round-robin decided, not the shadow");
    assert_eq!(served[0], served[2]);

    let shadow = &cluster.admin_get("/admin/plugins").await["shadow"];
    assert_eq!(shadow["candidate"]["name"], "kv-aware", "{shadow}");
    let c = &shadow["comparison"];
    assert_eq!(c["decisions"], 8, "{shadow}");
    assert!(c["disagreements"].as_u64().unwrap() >= 2, "{shadow}");
    assert!(
        c["candidate_overlap_blocks"].as_u64() > c["active_overlap_blocks"].as_u64(),
        "kv-aware would have found more of the prompt cached: {shadow}"
    );
    let series = r#"sluice_shadow_decisions_total{plugin="kv-aware",version="1"}"#;
    assert_eq!(cluster.metric(series).await, 8.0);

    assert_eq!(delete_shadow(&cluster).await, 200);
    assert_eq!(delete_shadow(&cluster).await, 404);
    assert!(cluster.admin_get("/admin/plugins").await["shadow"]["candidate"].is_null());

    // Every decision is in the log (written within a second or so).
    let started = Instant::now();
    let lines = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let n = text.lines().count();
        if n >= 8 || started.elapsed() > Duration::from_secs(10) {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(lines, 8);

    // Offline: what kv-aware would have done with the same inputs.
    let out = std::process::Command::new(sluice_bin())
        .args(["plugin", "replay"])
        .arg(plugins_dir().join("kv_aware.wasm"))
        .arg(&log)
        .output()
        .expect("runs sluice plugin replay");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(report["replay"]["records"], 8, "{report}");
    assert_eq!(report["replay"]["malformed"], 0);
    assert!(
        report["replay"]["comparison"]["disagreements"]
            .as_u64()
            .unwrap()
            >= 2
    );
    assert_eq!(report["plugin"]["name"], "kv_aware");

    // A log with no records is an error, not an empty report.
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "garbage\n").unwrap();
    let out = std::process::Command::new(sluice_bin())
        .args(["plugins", "replay"])
        .arg(plugins_dir().join("kv_aware.wasm"))
        .arg(&empty)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no decision records"));
    std::fs::remove_dir_all(&dir).ok();
}
