//! Telemetry: Prometheus metrics of the request path (`metrics`), W3C trace
//! context carried from clients to workers (`trace`), and the log subscriber
//! with its optional OTLP span exporter (`otel`).

mod metrics;
mod otel;
mod trace;

pub use metrics::{Metrics, RequestOutcome};
pub use otel::{TelemetryGuard, init, request_span};
pub use trace::TraceContext;
