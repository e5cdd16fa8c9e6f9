//! Trace context: W3C `traceparent` in, spans here, `traceparent` out.
//!
//! Each message a task processes runs inside a `process` span (`stream`, `partition`,
//! `seq`, `attempt`, and the trace ids), each hook inside a `hook` span and each commit
//! inside a `commit` span; a dead letter is written inside a `dead_letter` span that is
//! a child of the message's (across the worker and the reaper, two actors). All are at
//! debug level. When the input carries a `traceparent` and the spans are collected
//! (`--log debug`, or the OTLP exporter), the message's span continues that trace: its
//! outputs carry `traceparent` with the same trace id and the `process` span's id as
//! their parent, so the next task, on whichever node, continues it again. When they are
//! not collected, the input's `traceparent` is passed on unchanged. An input without
//! one starts a trace only when the spans are collected; otherwise nothing is added.
//!
//! The ids are recorded as span fields (`trace_id`, `span_id`, `parent_id`), so logs
//! show them; with the `otlp` feature of `flotilla-node` the same spans are exported
//! with these ids ([`set_span_hook`]).

use rand::Rng;
use std::sync::OnceLock;

/// One position in a trace: the trace and the span that is the parent of what comes
/// next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace (never 0).
    pub trace_id: u128,
    /// The span (never 0).
    pub span_id: u64,
    /// The caller asked for the trace to be recorded.
    pub sampled: bool,
}

fn nonzero_u64() -> u64 {
    loop {
        let id: u64 = rand::rng().random();
        if id != 0 {
            return id;
        }
    }
}

impl TraceContext {
    /// A new trace, at its root span.
    pub fn root() -> Self {
        let trace_id = loop {
            let id: u128 = rand::rng().random();
            if id != 0 {
                break id;
            }
        };
        Self { trace_id, span_id: nonzero_u64(), sampled: true }
    }

    /// A span under this one, in the same trace.
    pub fn child(&self) -> Self {
        Self { trace_id: self.trace_id, span_id: nonzero_u64(), sampled: self.sampled }
    }

    /// Reads a `traceparent` header (version 00; later versions are read by their
    /// first four fields, as the spec asks). `None` for anything malformed.
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        if trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
            return None;
        }
        let hex = |s: &str| s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !(hex(version) && hex(trace) && hex(span) && hex(flags)) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?;
        let span_id = u64::from_str_radix(span, 16).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        (trace_id != 0 && span_id != 0).then_some(Self { trace_id, span_id, sampled: flags & 1 == 1 })
    }

    /// The `traceparent` header naming this span as the parent.
    pub fn header(&self) -> String {
        format!("00-{:032x}-{:016x}-{:02x}", self.trace_id, self.span_id, u8::from(self.sampled))
    }

    /// The trace id as 32 hex digits.
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The span id as 16 hex digits.
    pub fn span_hex(&self) -> String {
        format!("{:016x}", self.span_id)
    }
}

/// Called for each collected span this crate opens in a trace, with its remote parent
/// (if any); returns the span's own context when an exporter made it (its ids are then
/// the ones exported, and the ones outputs carry). The node's OTLP exporter sets it.
pub type SpanHook = fn(&tracing::Span, Option<&TraceContext>) -> Option<TraceContext>;

static SPAN_HOOK: OnceLock<SpanHook> = OnceLock::new();

/// Installs the span hook (once per process; later calls are ignored).
pub fn set_span_hook(hook: SpanHook) {
    let _ = SPAN_HOOK.set(hook);
}

/// The trace context of a message's processing, and its span: continues the input's
/// trace, or starts one when the span is collected. Records the ids on the span.
pub fn message_context(span: &tracing::Span, input: Option<&str>) -> Option<TraceContext> {
    let parent = input.and_then(TraceContext::parse);
    open(span, parent, true)
}

/// The trace context of `span`: a child of `parent`, or (with `start`, when the span is
/// collected) a new trace, or none. Records the ids on the span.
pub fn open(span: &tracing::Span, parent: Option<TraceContext>, start: bool) -> Option<TraceContext> {
    let collected = !span.is_disabled();
    let exported = match SPAN_HOOK.get() {
        Some(hook) if collected => hook(span, parent.as_ref()),
        _ => None,
    };
    let this = match (exported, parent) {
        (Some(this), _) => this,
        (None, Some(p)) if collected => p.child(),
        // Nobody records a span here: the caller's span stays the parent of what comes
        // next (a child nobody records would leave a hole in the trace).
        (None, Some(p)) => return Some(p),
        (None, None) if start && collected => TraceContext::root(),
        (None, None) => return None,
    };
    if collected {
        span.record("trace_id", tracing::field::display(this.trace_hex()));
        span.record("span_id", tracing::field::display(this.span_hex()));
        if let Some(p) = parent {
            span.record("parent_id", tracing::field::display(p.span_hex()));
        }
    }
    Some(this)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_children_keep_the_trace() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let ctx = TraceContext::parse(tp).expect("valid");
        assert_eq!(ctx.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(ctx.span_id, 0x00f067aa0ba902b7);
        assert!(ctx.sampled);
        assert_eq!(ctx.header(), tp);
        let child = ctx.child();
        assert_eq!(child.trace_id, ctx.trace_id);
        assert_ne!(child.span_id, ctx.span_id);
        assert!(child.header().starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(
            !TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").expect("valid").sampled
        );
        // A later version may add fields.
        assert!(TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra").is_some());
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        for bad in [
            "",
            "00-abc-def-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_message_without_a_trace_starts_none_unless_its_span_is_collected() {
        // No subscriber: the span is disabled, nothing is added.
        let span = tracing::info_span!("process", trace_id = tracing::field::Empty);
        assert_eq!(message_context(&span, None), None);
        // An input trace is passed on as it came while nothing records a span here.
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let ctx = message_context(&span, Some(tp)).expect("passed on");
        assert_eq!(ctx.header(), tp);
    }
}
