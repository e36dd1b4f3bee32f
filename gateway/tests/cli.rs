//! The `sluice` command line, run as a user would: `plugins check` verdicts and
//! exit codes, and the summary line of `bench plugins --quick`.

use std::path::PathBuf;
use std::process::Command;

fn plugins_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/wasm32-wasip2/release")
}

fn sluice(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("run sluice");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn plugins_check_accepts_a_good_plugin_and_explains_a_refusal() {
    let dir = plugins_dir();
    let good = dir.join("kv_aware.wasm");
    let (ok, stdout, stderr) = sluice(&[
        "plugins",
        "check",
        good.to_str().unwrap(),
        "--kind",
        "router",
    ]);
    assert!(ok, "{stderr}");
    let verdict: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(verdict["ok"], true);
    assert_eq!(verdict["slot"], "router");

    let (ok, _, stderr) = sluice(&[
        "plugins",
        "check",
        good.to_str().unwrap(),
        "--kind",
        "router",
        "--config",
        "temperature=hot",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("temperature") && stderr.contains("hot"),
        "{stderr}"
    );

    let bad = dir.join("bad_import.wasm");
    let (ok, _, stderr) = sluice(&[
        "plugins",
        "check",
        bad.to_str().unwrap(),
        "--kind",
        "router",
    ]);
    assert!(!ok);
    assert!(stderr.contains("acme:net/socket"), "{stderr}");
    assert!(
        !stderr.contains("Stack backtrace"),
        "errors are one clear line: {stderr}"
    );
}

#[test]
fn bench_plugins_quick_ends_with_the_summary() {
    let dir = plugins_dir();
    let (ok, stdout, stderr) = sluice(&[
        "bench",
        "plugins",
        "--quick",
        "--plugins-dir",
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let last = stdout.lines().last().expect("output");
    let summary: serde_json::Value = serde_json::from_str(last).expect("JSON summary");
    for key in [
        "wasm_ns_8",
        "wasm_ns_64",
        "wasm_ns_512",
        "native_ns_8",
        "native_ns_64",
        "native_ns_512",
        "swap_validate_ms",
        "swap_ms",
        "first_call_us",
    ] {
        assert!(
            summary[key].as_f64().is_some_and(|v| v > 0.0),
            "{key} in {summary}"
        );
    }
    assert_eq!(summary["fallbacks"], 0);
}
