//! OpenTelemetry export of the run loop's spans over OTLP/HTTP (cargo feature `otlp`;
//! `--otlp-endpoint URL`). See `docs/metrics.md`.
//!
//! A `tracing-opentelemetry` layer takes Flotilla's spans (targets `flotilla_actors` and
//! `flotilla_node`, debug and above, whatever `--log` says) and a batch exporter sends
//! them to the collector. The span hook of [`flotilla_actors::trace`] makes the
//! exported ids the ones messages carry: a span continuing a record's `traceparent`
//! gets it as its remote parent, and its outputs name the exported span.

use flotilla_actors::trace::{TraceContext, set_span_hook};
use opentelemetry::trace::{SpanContext, TraceContextExt, TraceFlags, TraceState, TracerProvider as _};
use opentelemetry::{KeyValue, trace::SpanId, trace::TraceId};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;

/// Flushes and stops the exporter when dropped (at the end of the node's run).
pub struct OtlpGuard(SdkTracerProvider);

impl std::fmt::Debug for OtlpGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OtlpGuard")
    }
}

impl Drop for OtlpGuard {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("warning: spans not all exported at exit: {e}");
        }
    }
}

/// The traces URL for `endpoint`: a base URL gets `/v1/traces` appended.
pub fn traces_url(endpoint: &str) -> String {
    let trimmed = endpoint.trim_end_matches('/');
    if trimmed.ends_with("/v1/traces") { trimmed.to_owned() } else { format!("{trimmed}/v1/traces") }
}

/// The layer exporting to `endpoint` for node `node` of `job`, and its guard.
///
/// # Errors
/// The exporter cannot be built (a malformed URL, for one).
pub fn layer<S>(endpoint: &str, job: &str, node: &str) -> Result<(impl Layer<S>, OtlpGuard), String>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(traces_url(endpoint))
        .build()
        .map_err(|e| format!("cannot export to --otlp-endpoint {endpoint}: {e}"))?;
    let resource = Resource::builder()
        .with_service_name(format!("flotilla-{job}"))
        .with_attribute(KeyValue::new("flotilla.node", node.to_owned()))
        .with_attribute(KeyValue::new("flotilla.job", job.to_owned()))
        .build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    let tracer = provider.tracer("flotilla");
    set_span_hook(exported_context);
    let filter = Targets::new()
        .with_target("flotilla_actors", tracing::Level::DEBUG)
        .with_target("flotilla_node", tracing::Level::DEBUG);
    Ok((tracing_opentelemetry::layer().with_tracer(tracer).with_filter(filter), OtlpGuard(provider)))
}

/// The span hook: the remote parent becomes the exported span's parent; the exported
/// span's own ids are returned.
fn exported_context(span: &tracing::Span, parent: Option<&TraceContext>) -> Option<TraceContext> {
    if let Some(p) = parent {
        let flags = if p.sampled { TraceFlags::SAMPLED } else { TraceFlags::default() };
        let remote =
            SpanContext::new(TraceId::from(p.trace_id), SpanId::from(p.span_id), flags, true, TraceState::default());
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
    let cx = span.context();
    let own = cx.span().span_context().clone();
    own.is_valid().then(|| TraceContext {
        trace_id: u128::from_be_bytes(own.trace_id().to_bytes()),
        span_id: u64::from_be_bytes(own.span_id().to_bytes()),
        sampled: own.is_sampled(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_url_gets_the_traces_path() {
        assert_eq!(traces_url("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(traces_url("http://127.0.0.1:4318/"), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
    }
}
