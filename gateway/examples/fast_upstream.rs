//! The fast upstream of `sluice bench gateway` (a sluice worker's API,
//! canned answers of 16 tokens, no inference) on the given ports, on its
//! own: for profiling `sluice serve` in front of it outside the bench
//! (BENCHMARKS.md, "Gateway overhead": callgrind instruction counts).
//! `cargo run --release -p sluice-gateway --example fast_upstream -- 18091 18092`
fn main() {
    let ports: Vec<u16> = std::env::args()
        .skip(1)
        .map(|p| p.parse().expect("a port number"))
        .collect();
    if ports.is_empty() {
        eprintln!("usage: fast_upstream PORT [PORT...]");
        std::process::exit(2);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let mut servers = Vec::new();
        for port in ports {
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .unwrap_or_else(|e| panic!("port {port}: {e}"));
            servers.push(tokio::spawn(sluice_gateway::bench::upstream::serve(
                listener,
                16,
                "bench".into(),
            )));
        }
        for server in servers {
            if let Ok(Err(e)) = server.await {
                eprintln!("upstream stopped: {e}");
            }
        }
    });
}
