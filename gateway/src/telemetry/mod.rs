//! Telemetry: Prometheus metrics of the request path (`metrics`) and W3C
//! trace context carried from clients to workers (`trace`). Logs go through
//! `tracing` everywhere.

mod metrics;
mod trace;

pub use metrics::{Metrics, RequestOutcome};
pub use trace::TraceContext;
