//! The gateway exports request spans over OTLP/HTTP when configured: a span
//! per request, continuing the client's `traceparent` (same trace id, the
//! client's span as parent). A fake collector in this test receives them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;
use sluice_tests::cluster::{Cluster, chat};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_continue_the_clients_trace() {
    let received: Arc<Mutex<Vec<ExportTraceServiceRequest>>> = Arc::default();
    let sink = received.clone();
    let collector = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                if let Ok(request) = ExportTraceServiceRequest::decode(body) {
                    sink.lock().unwrap().push(request);
                }
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, collector).await });
    let _telemetry = sluice_gateway::telemetry::init(Some(&endpoint), "sluice-test").unwrap();

    let cluster = Cluster::start(2, |_| {}).await;
    let r = cluster
        .request("/v1/chat/completions")
        .header("traceparent", format!("00-{TRACE_ID}-{CLIENT_SPAN}-01"))
        .json(&chat(&[("user", "hello")], 2))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let worker = r.headers()["x-sluice-worker"].to_str().unwrap().to_string();

    let started = Instant::now();
    loop {
        let found = received
            .lock()
            .unwrap()
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|r| &r.scope_spans)
            .flat_map(|s| &s.spans)
            .find(|s| hex(&s.trace_id) == TRACE_ID)
            .cloned();
        if let Some(span) = found {
            assert_eq!(
                hex(&span.parent_span_id),
                CLIENT_SPAN,
                "the client's span is the parent"
            );
            assert_eq!(span.name, "POST /v1/chat/completions");
            let worker_attr = span
                .attributes
                .iter()
                .find(|a| a.key == "worker")
                .and_then(|a| a.value.as_ref())
                .map(|v| format!("{:?}", v.value));
            assert!(
                worker_attr.is_some_and(|v| v.contains(&worker)),
                "the span names worker {worker}"
            );
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no span of the trace was exported"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
