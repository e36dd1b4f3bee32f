//! The Wasm plugin host with real plugin components: every shipped policy loads
//! and answers, hot swaps lose no call, hostile plugins are contained, and bad
//! plugins are refused at load with a clear reason.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice_gateway::plugins::{
    Admission, Cache, ErrorClass, HostConfig, LoadError, Router, Runtime, Slot, WasmAdmission,
    WasmCachePolicy, WasmRouter,
};
use sluice_gateway::policy::{
    AdmissionPolicy, AdmitDecision, CachePolicy, Completion, EvictionCandidates, FleetSaturation,
    KvAwareRouter, Outcome, RouteDecision, RouterPolicy,
};
use sluice_tests::{fleet, plugin_wasm, request};

fn runtime() -> Arc<Runtime> {
    Arc::new(Runtime::new(HostConfig::default()).expect("plugin runtime"))
}

fn router_with(plugin: &str, config: &str) -> WasmRouter {
    let slot = Arc::new(Slot::<Router>::new(runtime()));
    slot.load(plugin, &plugin_wasm(plugin), config)
        .unwrap_or_else(|e| panic!("{e}"));
    WasmRouter::new(slot)
}

#[test]
fn shipped_routers_answer_through_wasm() {
    let f = fleet(8, 3);
    for name in ["round-robin", "least-load", "kv-aware", "session-affinity"] {
        let router = router_with(name, "");
        for _ in 0..20 {
            let (decision, version) = router.route_traced(&request(40), &f);
            assert_eq!(version, Some(1), "{name} answered itself");
            assert!(
                matches!(decision, RouteDecision::Worker(i) if i < 8),
                "{name}: {decision:?}"
            );
        }
        assert_eq!(router.slot().shared().stats.total_fallbacks(), 0, "{name}");
    }
}

#[test]
fn kv_aware_in_wasm_agrees_with_the_native_policy() {
    let router = router_with("kv-aware", "");
    let native = KvAwareRouter::default();
    for seed in 0..300 {
        let f = fleet(1 + (seed as usize % 70), seed);
        let r = request(8 + (seed as u32 % 60));
        let (decision, answered_by) = router.route_traced(&r, &f);
        assert_eq!(
            answered_by,
            Some(1),
            "the plugin itself answered (seed {seed})"
        );
        assert_eq!(decision, native.route(&r, &f), "seed {seed}");
    }
    assert_eq!(router.slot().shared().stats.total_fallbacks(), 0);
}

#[test]
fn round_robin_state_lives_across_calls() {
    let router = router_with("round-robin", "");
    let f = fleet(3, 1);
    let picks: Vec<_> = (0..6).map(|_| router.route(&request(4), &f)).collect();
    use RouteDecision::Worker as W;
    // One pooled instance serves sequential calls, so its cursor carries on.
    assert_eq!(picks, vec![W(0), W(1), W(2), W(0), W(1), W(2)]);
}

#[test]
fn session_affinity_holds_across_instances_running_side_by_side() {
    // No instance goes back to the pool, so every call after the first runs
    // on an instance made for it: a session's worker can only carry over
    // through the slot's shared store, whichever instance answers. (Relying
    // on threads' calls overlapping to make the pool grow was up to the OS:
    // on a busy 2-core CI machine 5,000 rounds once ran on one instance.)
    let no_pooling = HostConfig {
        max_idle_instances: 0,
        ..HostConfig::default()
    };
    let slot = Arc::new(Slot::<Router>::new(Arc::new(
        Runtime::new(no_pooling).expect("plugin runtime"),
    )));
    slot.load("session-affinity", &plugin_wasm("session-affinity"), "")
        .unwrap_or_else(|e| panic!("{e}"));
    let router = Arc::new(WasmRouter::new(slot.clone()));
    // Four threads call at once, each round over made-up fleets in which
    // KV-aware alone would pick anywhere.
    let rounds = 60u64;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let router = router.clone();
            std::thread::spawn(move || {
                (0..rounds)
                    .map(|round| {
                        let mut r = request(40);
                        // All four threads ask for the same session in a round,
                        // so first placements race (the plugin settles them
                        // with compare-and-swap).
                        r.session_hash = 1 + round % 25;
                        let f = fleet(64, t * 10_000 + round);
                        (r.session_hash, router.route_traced(&r, &f))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut worker_of = std::collections::HashMap::new();
    for t in threads {
        for (session, (decision, version)) in t.join().unwrap() {
            assert_eq!(version, Some(1), "the plugin itself answered");
            let first = worker_of
                .entry(session)
                .or_insert_with(|| decision.clone())
                .clone();
            assert_eq!(decision, first, "session {session} moved");
        }
    }
    assert_eq!(
        slot.with_current(|g| g.idle_instances()),
        Some(0),
        "no instance was reused (else this test proves less)"
    );
    let status = slot.status();
    assert_eq!(status.shared_entries, 25, "one entry a session");
    assert_eq!(status.shared_refused, 0);
    assert_eq!(slot.shared().stats.total_fallbacks(), 0);
}

#[test]
fn a_plugin_built_against_0_1_0_still_loads_and_answers() {
    let router = router_with("contract-0-1-0", "");
    let (decision, version) = router.route_traced(&request(40), &fleet(5, 1));
    assert_eq!(version, Some(1), "the plugin itself answered");
    assert_eq!(decision, RouteDecision::Worker(4));
}

#[test]
fn hot_swap_under_concurrent_calls_loses_nothing() {
    let slot = Arc::new(Slot::<Router>::new(runtime()));
    let bytes = plugin_wasm("hostile"); // mode=ok: a constant, well-behaved router
    let first = slot.prepare("constant", &bytes, "worker=0").unwrap();
    // version -> the worker that version answers; written before activation.
    let answers: Arc<Vec<AtomicU64>> =
        Arc::new((0..64).map(|_| AtomicU64::new(u64::MAX)).collect());
    answers[first.identity.version as usize].store(0, Ordering::SeqCst);
    let mut newest = slot.activate(first).version;
    let published = Arc::new(AtomicU64::new(newest));
    let router = Arc::new(WasmRouter::new(slot.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let f = Arc::new(fleet(4, 9));

    let callers: Vec<_> = (0..8)
        .map(|_| {
            let (router, published, answers, stop, f) = (
                router.clone(),
                published.clone(),
                answers.clone(),
                stop.clone(),
                f.clone(),
            );
            std::thread::spawn(move || {
                let mut calls = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let floor = published.load(Ordering::SeqCst);
                    let (decision, version) = router.route_traced(&request(16), &f);
                    let version = version.unwrap_or_else(|| {
                        panic!(
                            "the plugin answered every call: {:?}",
                            router.slot().status()
                        )
                    });
                    assert!(
                        version >= floor,
                        "saw version {version} after {floor} was active"
                    );
                    let expected = answers[version as usize].load(Ordering::SeqCst);
                    assert_eq!(decision, RouteDecision::Worker(expected as usize));
                    calls += 1;
                }
                calls
            })
        })
        .collect();

    let deadline = Instant::now() + Duration::from_secs(2);
    for swap in 1..=50u64 {
        let worker = swap % 4;
        let next = slot
            .prepare("constant", &bytes, &format!("worker={worker}"))
            .unwrap();
        answers[next.identity.version as usize].store(worker, Ordering::SeqCst);
        newest = slot.activate(next).version;
        published.store(newest, Ordering::SeqCst);
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()) / (51 - swap as u32));
    }
    stop.store(true, Ordering::Relaxed);
    let calls: u64 = callers.into_iter().map(|c| c.join().expect("caller")).sum();
    let stats = &slot.shared().stats;
    assert!(
        calls > 1000,
        "callers kept calling through the swaps ({calls})"
    );
    assert_eq!(
        stats.calls.load(Ordering::Relaxed),
        calls,
        "every call reached the plugin"
    );
    assert_eq!(stats.total_fallbacks(), 0);
    assert_eq!(slot.status().active.unwrap().version, newest);
}

/// Loads the hostile fixture in `mode`, checks that a triggering request is
/// answered by the built-in policy and counted as `class`, and that the next
/// ordinary request is answered by the plugin again.
fn contained(mode: &str, class: ErrorClass) {
    let router = router_with("hostile", &format!("mode={mode}, worker=2"));
    let f = fleet(6, 11);
    let mut bad = request(30);
    bad.priority = 666;
    let started = Instant::now();
    let (decision, version) = router.route_traced(&bad, &f);
    assert_eq!(version, None, "{mode}: the built-in policy answered");
    assert_eq!(decision, KvAwareRouter::default().route(&bad, &f), "{mode}");
    let stats = &router.slot().shared().stats;
    assert_eq!(
        stats.fallbacks(class),
        1,
        "{mode} counted as {class}: {:?}",
        router.slot().status()
    );
    assert_eq!(stats.total_fallbacks(), 1, "{mode} counted once");
    for _ in 0..3 {
        let (decision, version) = router.route_traced(&request(30), &f);
        assert_eq!(
            (decision, version),
            (RouteDecision::Worker(2), Some(1)),
            "{mode}: serving again"
        );
    }
    eprintln!("{mode}: contained in {:?}", started.elapsed());
}

#[test]
fn an_infinite_loop_is_stopped_by_the_deadline() {
    contained("loop", ErrorClass::Timeout);
}

/// Host imports charge the call's fuel too: a loop over them runs out as a
/// loop over Wasm instructions does.
#[test]
fn an_infinite_loop_of_host_calls_is_stopped_by_the_deadline() {
    contained("hostloop", ErrorClass::Timeout);
}

#[test]
fn a_memory_bomb_hits_the_limit() {
    contained("membomb", ErrorClass::Memory);
}

#[test]
fn a_panic_is_a_trap() {
    contained("trap", ErrorClass::Trap);
}

#[test]
fn an_out_of_range_index_is_invalid() {
    contained("oob", ErrorClass::Invalid);
}

#[test]
fn a_huge_answer_is_invalid() {
    contained("huge", ErrorClass::Invalid);
}

#[test]
fn wasi_use_traps() {
    contained("wasi", ErrorClass::Trap);
}

#[test]
fn a_plugin_that_keeps_failing_is_benched_then_tried_again() {
    // A long first bench, so that a busy machine cannot outlast it by accident.
    let config = HostConfig {
        breaker_first_bench: Duration::from_millis(500),
        ..HostConfig::default()
    };
    let slot = Arc::new(Slot::<Router>::new(Arc::new(Runtime::new(config).unwrap())));
    slot.load("hostile", &plugin_wasm("hostile"), "mode=trap, worker=1")
        .unwrap();
    let router = WasmRouter::new(slot);
    let f = fleet(3, 4);
    let mut bad = request(5);
    bad.priority = 666;
    let stats = &router.slot().shared().stats;
    for _ in 0..3 {
        assert_eq!(router.route_traced(&bad, &f).1, None);
    }
    assert_eq!(stats.fallbacks(ErrorClass::Trap), 3);
    // Benched: even a good request is answered by the built-in policy, and the
    // plugin is not called.
    let calls = stats.calls.load(Ordering::Relaxed);
    assert_eq!(router.route_traced(&request(5), &f).1, None);
    assert_eq!(stats.calls.load(Ordering::Relaxed), calls);
    assert_eq!(stats.fallbacks(ErrorClass::Benched), 1);
    // After the bench the plugin answers again.
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(
        router.route_traced(&request(5), &f),
        (RouteDecision::Worker(1), Some(1))
    );
}

#[test]
fn a_log_flood_is_rate_limited() {
    let router = router_with("hostile", "mode=logflood, worker=1");
    let f = fleet(2, 5);
    let mut flood = request(3);
    flood.priority = 666;
    assert_eq!(
        router.route_traced(&flood, &f),
        (RouteDecision::Worker(1), Some(1))
    );
    let stats = &router.slot().shared().stats;
    let dropped = stats.logs_dropped.load(Ordering::Relaxed);
    // The burst is one second's worth (20 lines); the other 180 are dropped.
    assert!(
        dropped >= 170,
        "only a burst of the 200 lines got through ({dropped} dropped)"
    );
}

#[test]
fn a_disallowed_import_is_refused_at_load() {
    let slot = Slot::<Router>::new(runtime());
    let err = slot
        .load("bad-import", &plugin_wasm("bad-import"), "")
        .unwrap_err();
    assert!(matches!(err, LoadError::DisallowedImport { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("bad-import") && text.contains("acme:net/socket"),
        "{text}"
    );
    assert!(slot.status().active.is_none());
}

#[test]
fn an_incompatible_interface_version_is_refused_at_load() {
    let slot = Slot::<Router>::new(runtime());
    let err = slot
        .load("future", &plugin_wasm("wrong-version"), "")
        .unwrap_err();
    assert!(
        matches!(err, LoadError::IncompatibleVersion { .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("sluice:policy/router@0.2.0") && text.contains("0.1.1"),
        "{text}"
    );
}

#[test]
fn refusals_name_the_plugin_and_leave_the_active_version_alone() {
    let slot = Slot::<Router>::new(runtime());
    slot.load("rr", &plugin_wasm("round-robin"), "").unwrap();

    let err = slot.load("junk", b"\0asm not really", "").unwrap_err();
    assert!(
        matches!(err, LoadError::Compile { .. }) && err.to_string().contains("`junk`"),
        "{err}"
    );

    let err = slot
        .load("adm", &plugin_wasm("token-bucket"), "")
        .unwrap_err();
    assert!(matches!(err, LoadError::WrongKind { .. }), "{err}");
    assert!(
        err.to_string().contains("sluice:policy/admission@0.1.1"),
        "{err}"
    );

    let err = slot
        .load("picky", &plugin_wasm("hostile"), "init=fail")
        .unwrap_err();
    assert!(matches!(err, LoadError::Init { .. }), "{err}");
    assert!(
        err.to_string().contains("init=fail asks this fixture"),
        "{err}"
    );

    let err = slot
        .load("kv", &plugin_wasm("kv-aware"), "temperature=-2")
        .unwrap_err();
    assert!(
        err.to_string().contains("temperature must be >= 0"),
        "{err}"
    );

    // A plugin that fails its smoke call (it always traps) never goes live.
    let err = slot
        .load("bomb", &plugin_wasm("hostile"), "mode=trap, always=true")
        .unwrap_err();
    assert!(matches!(err, LoadError::Smoke { .. }), "{err}");

    let status = slot.status();
    assert_eq!(status.active.unwrap().name, "rr");
    assert!(status.previous.is_none());
}

#[test]
fn rollback_swaps_back_and_forth() {
    let slot = Arc::new(Slot::<Router>::new(runtime()));
    assert!(matches!(slot.rollback(), Err(LoadError::NoPrevious { .. })));
    let bytes = plugin_wasm("hostile");
    slot.load("a", &bytes, "worker=0").unwrap();
    slot.load("b", &bytes, "worker=1").unwrap();
    let router = WasmRouter::new(slot.clone());
    let f = fleet(2, 2);
    assert_eq!(
        router.route_traced(&request(4), &f),
        (RouteDecision::Worker(1), Some(2))
    );
    assert_eq!(slot.rollback().unwrap().name, "a");
    assert_eq!(
        router.route_traced(&request(4), &f),
        (RouteDecision::Worker(0), Some(1))
    );
    assert_eq!(slot.rollback().unwrap().name, "b");
    assert_eq!(
        router.route_traced(&request(4), &f),
        (RouteDecision::Worker(1), Some(2))
    );
}

#[test]
fn an_empty_slot_uses_the_built_in_policy() {
    let router = WasmRouter::new(Arc::new(Slot::<Router>::new(runtime())));
    let f = fleet(5, 8);
    assert_eq!(
        router.route_traced(&request(20), &f),
        (KvAwareRouter::default().route(&request(20), &f), None)
    );
}

fn saturation(kv_used: u64) -> FleetSaturation {
    FleetSaturation {
        healthy_workers: 4,
        active_requests: 8,
        queued_requests: 0,
        queued_prefill_tokens: 0,
        kv_blocks_used: kv_used,
        kv_blocks_total: 1000,
    }
}

#[test]
fn token_bucket_admission_through_wasm() {
    let slot = Arc::new(Slot::<Admission>::new(runtime()));
    slot.load("tb", &plugin_wasm("token-bucket"), "rate=1, burst=1000")
        .unwrap();
    let admission = WasmAdmission::new(slot.clone());
    let mut r = request(25); // 400 tokens
    r.tenant_id = 7;
    assert_eq!(admission.admit(&r, &saturation(0)), AdmitDecision::Admit);
    assert_eq!(admission.admit(&r, &saturation(0)), AdmitDecision::Admit);
    // 200 left, and output tokens are paid on completion.
    admission.on_complete(&Completion {
        tenant_id: 7,
        session_hash: 0,
        priority: 0,
        prompt_tokens: 400,
        cached_tokens: 0,
        output_tokens: 150,
        outcome: Outcome::Success,
        duration_us: 10,
    });
    match admission.admit(&request(4), &saturation(0)) {
        AdmitDecision::Admit => {} // tenant 0 has its own bucket
        other => panic!("tenant 0 was refused: {other:?}"),
    }
    let mut small = request(4); // 64 tokens > the 50 left
    small.tenant_id = 7;
    match admission.admit(&small, &saturation(0)) {
        AdmitDecision::Reject(rej) => {
            assert_eq!(rej.status, 429);
            assert!(rej.message.contains("tenant 7"), "{}", rej.message);
        }
        other => panic!("expected a 429, got {other:?}"),
    }
    assert_eq!(slot.shared().stats.total_fallbacks(), 0);
    assert_eq!(slot.status().counters, vec![("rejected".to_string(), 1)]);
}

#[test]
fn priority_admission_through_wasm() {
    let slot = Arc::new(Slot::<Admission>::new(runtime()));
    slot.load(
        "prio",
        &plugin_wasm("priority-admission"),
        "kv_threshold=0.8",
    )
    .unwrap();
    let admission = WasmAdmission::new(slot);
    let mut high = request(4);
    high.priority = 3;
    assert_eq!(
        admission.admit(&request(4), &saturation(100)),
        AdmitDecision::Admit
    );
    assert!(
        matches!(admission.admit(&request(4), &saturation(900)), AdmitDecision::Reject(r) if r.status == 503)
    );
    assert_eq!(
        admission.admit(&high, &saturation(900)),
        AdmitDecision::Queue(3)
    );
}

#[test]
fn lru_priority_cache_through_wasm() {
    let slot = Arc::new(Slot::<Cache>::new(runtime()));
    slot.load("lru", &plugin_wasm("lru-priority-cache"), "")
        .unwrap();
    let cache = WasmCachePolicy::new(slot.clone());
    let mut r = request(4);
    r.tenant_id = 3;
    r.priority = 2;
    let hints = cache.hints(&r);
    assert!(hints.salt != 0 && hints.write_host_tier);
    assert_eq!(hints.retention_priority, 2);
    let scores = cache.score_eviction(&EvictionCandidates {
        age_ms: vec![1000, 1000, 10],
        hits: vec![0, 0, 0],
        priority: vec![0, 5, 0],
        tenant_id: vec![1, 1, 2],
    });
    assert_eq!(scores.len(), 3);
    assert!(scores[0] > scores[1] && scores[0] > scores[2], "{scores:?}");
    assert_eq!(slot.shared().stats.total_fallbacks(), 0);
}

/// With each plugin memory's reservation cut to what an instance may grow
/// to (`plugin_memory_reservation`: the compiled code checks bounds instead
/// of leaning on 4 GiB of reserved address space and guards), plugins answer
/// as with the default, and a memory bomb still stops at the limit.
#[test]
fn a_small_memory_reservation_changes_no_answer() {
    let runtime = Arc::new(
        Runtime::new(HostConfig {
            memory_reservation: Some(32 << 20),
            ..HostConfig::default()
        })
        .expect("plugin runtime"),
    );
    let slot = Arc::new(Slot::<Router>::new(runtime.clone()));
    slot.load("kv-aware", &plugin_wasm("kv-aware"), "")
        .unwrap_or_else(|e| panic!("{e}"));
    let router = WasmRouter::new(slot);
    let native = KvAwareRouter::default();
    for seed in 0..100 {
        let f = fleet(1 + (seed as usize % 70), seed);
        let r = request(8 + (seed as u32 % 60));
        let (decision, answered_by) = router.route_traced(&r, &f);
        assert_eq!(answered_by, Some(1), "the plugin answered (seed {seed})");
        assert_eq!(decision, native.route(&r, &f), "seed {seed}");
    }
    let slot = Arc::new(Slot::<Router>::new(runtime));
    slot.load("hostile", &plugin_wasm("hostile"), "mode=membomb, worker=2")
        .unwrap_or_else(|e| panic!("{e}"));
    let router = WasmRouter::new(slot);
    let mut bomb = request(30);
    bomb.priority = 666;
    let (_, version) = router.route_traced(&bomb, &fleet(6, 11));
    assert_eq!(version, None, "the built-in policy answered");
    let stats = &router.slot().shared().stats;
    assert_eq!(
        stats.fallbacks(ErrorClass::Memory),
        1,
        "{:?}",
        router.slot().status()
    );
}
