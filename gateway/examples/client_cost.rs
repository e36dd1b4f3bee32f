//! CPU per request of the two ways the gateway can call a sluice worker's
//! `/internal/generate`: reqwest (as the request path did before
//! `upstream::conn`) and `upstream::conn` (hyper's connection directly). Both
//! run 20,000 sequential requests, three rounds alternated, on one
//! current-thread runtime against the bench's fast upstream in the same
//! process (its work is the same for both, so the difference is the client's).
//! `cargo run --release -p sluice-gateway --example client_cost`; prints
//! figures, asserts none (BENCHMARKS.md, "Gateway overhead").
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice_gateway::upstream::conn;

/// This process's CPU time so far (every thread), in µs, as `sluice bench
/// gateway` reads it.
fn cpu_us() -> f64 {
    let ns = sluice_gateway::bench::process_cpu_ns(std::process::id()).expect("/proc schedstat");
    ns as f64 / 1e3
}

fn main() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            sluice_gateway::bench::upstream::serve(l, 16, "m".into())
                .await
                .unwrap();
        });
    });
    std::thread::sleep(Duration::from_millis(200));
    let prompt: Vec<u32> = (0..80).collect();
    let body = Bytes::from(
        serde_json::to_vec(&serde_json::json!({"prompt": prompt, "max_tokens": 16})).unwrap(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let n = 20_000;
    let url = reqwest::Url::parse(&format!("http://{addr}/internal/generate")).unwrap();
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    for round in 0..3 {
        for kind in ["reqwest", "conn"] {
            let (t0, c0) = (Instant::now(), cpu_us());
            rt.block_on(async {
                for _ in 0..n {
                    if kind == "reqwest" {
                        let r = client
                            .post(url.clone())
                            .header("content-type", "application/json")
                            .header(
                                "traceparent",
                                "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01",
                            )
                            .body(body.clone())
                            .send()
                            .await
                            .unwrap();
                        use tokio_stream::StreamExt;
                        let mut s = r.bytes_stream();
                        let mut len = 0;
                        while let Some(c) = s.next().await {
                            len += c.unwrap().len();
                        }
                        assert!(len > 0);
                    } else {
                        let mut a = conn::post_json(
                            &addr,
                            "/internal/generate",
                            "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01",
                            body.clone(),
                            Duration::from_secs(1),
                        )
                        .await
                        .unwrap();
                        let mut len = 0;
                        while let Some(c) = a.chunk().await {
                            len += c.unwrap().len();
                        }
                        assert!(len > 0);
                    }
                }
            });
            let (wall, cpu) = (
                t0.elapsed().as_secs_f64() * 1e6 / n as f64,
                (cpu_us() - c0) / n as f64,
            );
            println!("round {round} {kind:8} wall {wall:.1} us/req, process cpu {cpu:.1} us/req");
        }
    }
}
