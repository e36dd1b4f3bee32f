//! Logs and traces: the `tracing` subscriber (stderr, `RUST_LOG`), and, when an
//! OTLP endpoint is configured, an OpenTelemetry layer exporting spans over
//! OTLP/HTTP. Each request's span continues the client's `traceparent`, and
//! its id is what the worker receives as parent.

use std::time::Duration;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use super::TraceContext;

/// Flushes and stops the exporter when dropped.
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// Installs the process's subscriber: logs to stderr filtered by `RUST_LOG`
/// (default `info`), plus span export to `otlp_endpoint` (the full URL,
/// `http://collector:4318/v1/traces`) when given.
pub fn init(otlp_endpoint: Option<&str>, service: &str) -> Result<TelemetryGuard, String> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let (otel, provider) = match otlp_endpoint {
        None => (None, None),
        Some(url) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(url)
                .with_timeout(Duration::from_secs(5))
                .build()
                .map_err(|e| format!("OTLP exporter for {url}: {e}"))?;
            let batches = BatchSpanProcessor::builder(exporter)
                .with_batch_config(
                    BatchConfigBuilder::default()
                        .with_scheduled_delay(Duration::from_secs(1))
                        .build(),
                )
                .build();
            let provider = SdkTracerProvider::builder()
                .with_span_processor(batches)
                .with_resource(
                    opentelemetry_sdk::Resource::builder()
                        .with_service_name(service.to_string())
                        .build(),
                )
                .build();
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("sluice"));
            (Some(layer), Some(provider))
        }
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(logs)
        .with(otel)
        .try_init()
        .map_err(|e| format!("cannot install the log subscriber: {e}"))?;
    Ok(TelemetryGuard { provider })
}

/// The span of one request, child of the client's span when it sent one.
/// With an exporter installed, `trace` takes the span's own ids, so the
/// worker's `traceparent` names this span as its parent.
pub fn request_span(name: &'static str, trace: &mut TraceContext) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        otel.name = name,
        otel.kind = "server",
        worker = tracing::field::Empty,
        cached_blocks = tracing::field::Empty,
    );
    if let Some(parent) = trace.parent_id {
        let flags = if trace.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let remote = SpanContext::new(
            TraceId::from_bytes(trace.trace_id.to_be_bytes()),
            SpanId::from_bytes(parent.to_be_bytes()),
            flags,
            true,
            TraceState::default(),
        );
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
    let cx = span.context();
    let own = cx.span().span_context().clone();
    if own.is_valid() {
        trace.trace_id = u128::from_be_bytes(own.trace_id().to_bytes());
        trace.span_id = u64::from_be_bytes(own.span_id().to_bytes());
    }
    span
}
