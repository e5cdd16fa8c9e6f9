//! Header names and the small header map carried by every message.

use std::borrow::Cow;
use std::sync::Arc;

/// JetStream's deduplication id. Required of every producer.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The message's key (the partitioning input), UTF-8.
pub const KEY: &str = "Flotilla-Key";
/// The message kind: `data` (default when absent), `drain` or `end-of-stream`.
pub const KIND: &str = "Flotilla-Kind";
/// The run id a drain marker belongs to.
pub const RUN: &str = "Flotilla-Run";
/// The stream's declared message type name; checked when present.
pub const TYPE: &str = "Flotilla-Type";
/// Publish time, milliseconds since the Unix epoch, decimal.
pub const SENT: &str = "Flotilla-Sent";
/// Id of the input whose processing produced this message.
pub const CAUSE: &str = "Flotilla-Cause";
/// The producing partition's lease epoch (fencing token), decimal.
pub const EPOCH: &str = "Flotilla-Epoch";
/// W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
/// Wire-format version of the payload, decimal; absent means version 1.
pub const WIRE: &str = "Flotilla-Wire";

/// A delayed message's delay in milliseconds, counted from when the timer stream
/// stored it (timer stream only).
pub const DELAY: &str = "Flotilla-Delay";
/// The subject a delayed message is published to when due (timer stream only).
pub const TARGET: &str = "Flotilla-Target";

/// A durable timer's name, on the timer message that calls the `timer` hook.
pub const TIMER: &str = "Flotilla-Timer";
/// A durable timer's misfire policy (timer stream only): `fire` (fire late once, the
/// default when absent) or `skip:<ms>` (dropped when it would fire more than that late).
pub const MISFIRE: &str = "Flotilla-Misfire";
/// The arming a durable timer message belongs to: the id `schedule_durable` gave it, on
/// the timer message and (copied when it is promoted) on its fire. A fire whose timer
/// the task armed again or cancelled since is stale: the worker drops it.
pub const ARMING: &str = "Flotilla-Arming";
/// The `Flotilla-Kind` of a cancelled durable timer's tombstone in the timer stream
/// (it replaces the timer; the timer service drops it).
pub const TIMER_CANCELLED: &str = "timer-cancelled";

/// On a message of a parked key let through once (`step --key`): it runs although
/// its key is parked.
pub const STEP: &str = "Flotilla-Step";
/// On a parked message: its sequence in the queue stream it came from (parked
/// messages go back in this order).
pub const PARKED_SEQ: &str = "Flotilla-Parked-Seq";
/// On a message that was parked: its `Nats-Msg-Id` before (the id its task sees, so
/// its outputs keep the ids they would have had).
pub const ORIGIN_ID: &str = "Flotilla-Origin-Id";

/// Why a message was dead-lettered: a short code (`malformed`, `too-large`,
/// `type-mismatch`, `unsupported-version`, `max-attempts`, `max-deliveries`, `handler`).
pub const DLQ_REASON: &str = "Flotilla-Dlq-Reason";
/// Human-readable detail of the dead-lettering reason.
pub const DLQ_DETAIL: &str = "Flotilla-Dlq-Detail";
/// The JetStream stream the dead letter came from.
pub const DLQ_STREAM: &str = "Flotilla-Dlq-Stream";
/// The original subject of the dead letter.
pub const DLQ_SUBJECT: &str = "Flotilla-Dlq-Subject";
/// The original stream sequence of the dead letter, decimal.
pub const DLQ_SEQ: &str = "Flotilla-Dlq-Seq";
/// How many times the message had been delivered, decimal.
pub const DLQ_DELIVERIES: &str = "Flotilla-Dlq-Deliveries";
/// How many attempts the task made, decimal (0 when it never ran, e.g. `malformed`;
/// absent when nobody knows, as for `max-deliveries`).
pub const DLQ_ATTEMPTS: &str = "Flotilla-Dlq-Attempts";

/// Every header name above.
pub(crate) const KNOWN: [&str; 25] = [
    MSG_ID,
    KEY,
    KIND,
    RUN,
    TYPE,
    SENT,
    CAUSE,
    EPOCH,
    TRACEPARENT,
    WIRE,
    DELAY,
    TARGET,
    DLQ_REASON,
    DLQ_DETAIL,
    DLQ_STREAM,
    DLQ_SUBJECT,
    DLQ_SEQ,
    DLQ_DELIVERIES,
    DLQ_ATTEMPTS,
    TIMER,
    MISFIRE,
    STEP,
    PARKED_SEQ,
    ORIGIN_ID,
    ARMING,
];

/// `name` as one of the constants of this module when it is one (same spelling), so a
/// received header can name it without a copy.
pub fn known(name: &str) -> Option<&'static str> {
    known_index(name).map(|i| KNOWN[i])
}

/// Where `name` is among the constants of this module (same spelling), in the order of
/// [`KNOWN`]: backends keep their own form of each known name at that index.
pub(crate) fn known_index(name: &str) -> Option<usize> {
    KNOWN.iter().position(|k| *k == name)
}

/// What is wrong with a header entry NATS could not carry, or `None`: a name must be
/// non-empty printable ASCII without `:`, a value must not hold CR or LF. (async-nats
/// panics on either, so every backend checks with this first.)
pub fn entry_problem(name: &str, value: &str) -> Option<&'static str> {
    name_problem(name).or_else(|| value_problem(value))
}

/// What is wrong with a header name NATS could not carry (see [`entry_problem`]).
pub fn name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("the name is empty")
    } else if name.bytes().any(|b| !b.is_ascii_graphic() || b == b':') {
        Some("the name has a character other than printable ASCII, or ':'")
    } else {
        None
    }
}

/// What is wrong with a header value NATS could not carry (see [`entry_problem`]).
pub fn value_problem(value: &str) -> Option<&'static str> {
    value.bytes().any(|b| b == b'\r' || b == b'\n').then_some("the value has a line break")
}

/// Whether `name` is one of the broker's own headers, which JetStream acts on when a
/// message is published (`Nats-Expected-Stream`, `Nats-Expected-Last-Sequence`,
/// `Nats-Expected-Last-Subject-Sequence`, `Nats-Expected-Last-Msg-Id`, `Nats-Rollup`,
/// `Nats-TTL`, `Nats-Schedule*`, `Nats-Batch-*`, `Nats-Incr`, …) or adds when it stores
/// or serves one (`Nats-Stream`, `Nats-Sequence`, `Nats-Marker-Reason`, …): every
/// `Nats-` header, in any case, but [`MSG_ID`].
///
/// A copy of a message published elsewhere (a dead letter, a parked copy, a promoted
/// delayed message, a replay) must leave them behind: they were meant for the original
/// publish, and JetStream refuses a copy that still expects the original's stream and
/// sequence, so the copy would be retried for ever.
pub fn is_broker_control(name: &str) -> bool {
    name.get(..5).is_some_and(|prefix| prefix.eq_ignore_ascii_case("Nats-")) && !name.eq_ignore_ascii_case(MSG_ID)
}

/// What a message is, from its [`KIND`] header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// A user message (the default when the header is absent).
    Data,
    /// A drain marker: everything before it is processed, nothing after.
    Drain,
    /// End of stream for this partition.
    EndOfStream,
    /// A durable timer that came due: the task's `timer` hook runs with its name
    /// ([`TIMER`]), in order with the partition's messages.
    Timer,
}

impl MessageKind {
    /// The header value.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageKind::Data => "data",
            MessageKind::Drain => "drain",
            MessageKind::EndOfStream => "end-of-stream",
            MessageKind::Timer => "timer",
        }
    }

    /// Parses a header value; `None` for an unknown kind.
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "data" => Some(MessageKind::Data),
            "drain" => Some(MessageKind::Drain),
            "end-of-stream" => Some(MessageKind::EndOfStream),
            "timer" => Some(MessageKind::Timer),
            _ => None,
        }
    }
}

/// A header value's text: its own, or shared without a copy. The outputs of one
/// callback share their cause, epoch and type, so only what differs per output (its
/// id, key and time) is allocated per output.
#[derive(Debug, Clone)]
pub enum HeaderText {
    /// Text of the program.
    Static(&'static str),
    /// Text that clones share.
    Shared(Arc<str>),
    /// Text of its own.
    Owned(String),
}

impl HeaderText {
    /// The text.
    pub fn as_str(&self) -> &str {
        match self {
            HeaderText::Static(s) => s,
            HeaderText::Shared(s) => s,
            HeaderText::Owned(s) => s,
        }
    }
}

impl PartialEq for HeaderText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for HeaderText {}

impl From<String> for HeaderText {
    fn from(s: String) -> Self {
        HeaderText::Owned(s)
    }
}

impl From<&String> for HeaderText {
    fn from(s: &String) -> Self {
        HeaderText::Owned(s.clone())
    }
}

impl From<&str> for HeaderText {
    fn from(s: &str) -> Self {
        HeaderText::Owned(s.to_owned())
    }
}

impl From<Cow<'_, str>> for HeaderText {
    fn from(s: Cow<'_, str>) -> Self {
        HeaderText::Owned(s.into_owned())
    }
}

impl From<Box<str>> for HeaderText {
    fn from(s: Box<str>) -> Self {
        HeaderText::Owned(s.into())
    }
}

impl From<char> for HeaderText {
    fn from(c: char) -> Self {
        HeaderText::Owned(c.into())
    }
}

impl From<Arc<str>> for HeaderText {
    fn from(s: Arc<str>) -> Self {
        HeaderText::Shared(s)
    }
}

/// An ordered multimap of header names to values.
///
/// Lookups ignore ASCII case, as NATS servers and most clients do not canonicalise names.
/// Clones share the entries (a delivery's headers are handed to the task without a
/// copy); a change to a shared map copies it first. Names given as `&'static str` (the
/// constants of this module) are not copied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    entries: Arc<Vec<(Cow<'static, str>, HeaderText)>>,
}

impl Headers {
    /// An empty header map.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty header map with room for `n` entries.
    pub fn with_capacity(n: usize) -> Self {
        Self { entries: Arc::new(Vec::with_capacity(n)) }
    }

    /// Sets `name` to `value`, replacing any earlier values of `name`.
    pub fn insert(&mut self, name: impl Into<Cow<'static, str>>, value: impl Into<HeaderText>) -> &mut Self {
        let name = name.into();
        let entries = Arc::make_mut(&mut self.entries);
        entries.retain(|(n, _)| !n.eq_ignore_ascii_case(&name));
        entries.push((name, value.into()));
        self
    }

    /// Adds a value for `name`, keeping earlier ones.
    pub fn append(&mut self, name: impl Into<Cow<'static, str>>, value: impl Into<HeaderText>) -> &mut Self {
        Arc::make_mut(&mut self.entries).push((name.into(), value.into()));
        self
    }

    /// Builder form of [`Headers::insert`].
    pub fn with(mut self, name: impl Into<Cow<'static, str>>, value: impl Into<HeaderText>) -> Self {
        self.insert(name, value);
        self
    }

    /// The first value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_text(name).map(HeaderText::as_str)
    }

    /// The first value of `name`, as held (to share it without a copy).
    pub fn get_text(&self, name: &str) -> Option<&HeaderText> {
        // Names are nearly always spelled as sent (Flotilla's own are the constants of
        // this module): the first entry equal as written is the first equal ignoring
        // case unless an earlier one differs only in case, which the check rules out.
        let exact = self.entries.iter().position(|(n, _)| **n == *name);
        let first = match exact {
            Some(at) if !self.entries[..at].iter().any(|(n, _)| n.eq_ignore_ascii_case(name)) => at,
            _ => self.entries.iter().position(|(n, _)| n.eq_ignore_ascii_case(name))?,
        };
        Some(&self.entries[first].1)
    }

    /// Removes every value of `name`.
    pub fn remove(&mut self, name: &str) {
        if !self.entries.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)) {
            return;
        }
        Arc::make_mut(&mut self.entries).retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    }

    /// All entries in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(n, v)| (&**n, v.as_str()))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The message kind; [`MessageKind::Data`] when the header is absent, `None` when
    /// it holds an unknown value.
    pub fn kind(&self) -> Option<MessageKind> {
        match self.get(KIND) {
            None => Some(MessageKind::Data),
            Some(v) => MessageKind::parse(v),
        }
    }

    /// The `Nats-Msg-Id` value.
    pub fn msg_id(&self) -> Option<&str> {
        self.get(MSG_ID)
    }

    /// A copy for a message published elsewhere: every entry but the broker's own
    /// ([`is_broker_control`]). `Nats-Msg-Id` stays; a copy that needs an id of its own
    /// replaces it.
    pub fn without_broker_controls(&self) -> Headers {
        if !self.entries.iter().any(|(n, _)| is_broker_control(n)) {
            // Nothing to leave behind (nearly always): share the entries.
            return self.clone();
        }
        Self { entries: Arc::new(self.entries.iter().filter(|(n, _)| !is_broker_control(n)).cloned().collect()) }
    }

    /// The first entry NATS cannot carry, with what is wrong with it (see
    /// [`entry_problem`]).
    pub fn invalid_entry(&self) -> Option<(&str, &'static str)> {
        self.entries.iter().find_map(|(name, value)| entry_problem(name, value.as_str()).map(|why| (&**name, why)))
    }

    /// The entries, names as given (borrowed names are `'static`).
    pub(crate) fn entries(&self) -> &[(Cow<'static, str>, HeaderText)] {
        &self.entries
    }
}

impl From<Vec<(Cow<'static, str>, String)>> for Headers {
    /// The entries as given, in order (no check for repeated names).
    fn from(entries: Vec<(Cow<'static, str>, String)>) -> Self {
        Self { entries: Arc::new(entries.into_iter().map(|(n, v)| (n, HeaderText::Owned(v))).collect()) }
    }
}

impl From<Vec<(Cow<'static, str>, HeaderText)>> for Headers {
    /// The entries as given, in order (no check for repeated names).
    fn from(entries: Vec<(Cow<'static, str>, HeaderText)>) -> Self {
        Self { entries: Arc::new(entries) }
    }
}

impl<N: Into<Cow<'static, str>>, V: Into<HeaderText>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        Self { entries: Arc::new(iter.into_iter().map(|(n, v)| (n.into(), v.into())).collect()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_replaces_and_get_ignores_case() {
        let mut h = Headers::new();
        h.insert(MSG_ID, "a").insert("nats-msg-id", "b").append(KEY, "k1").append(KEY, "k2");
        assert_eq!(h.msg_id(), Some("b"));
        assert_eq!(h.get("flotilla-key"), Some("k1"));
        assert_eq!(h.len(), 3);
        h.remove(KEY);
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn get_finds_the_first_value_ignoring_case_whatever_the_spelling_asked() {
        let mut h = Headers::new().with(MSG_ID, "id").with(KEY, "k1");
        h.append("flotilla-key", "k2");
        assert_eq!(h.get(KEY), Some("k1"));
        assert_eq!(h.get("flotilla-key"), Some("k1"), "the first of the spellings, not the exact one");
        assert_eq!(h.get("FLOTILLA-KEY"), Some("k1"));
        assert_eq!(h.get(TRACEPARENT), None);
        let mut later = Headers::new().with("flotilla-key", "lower");
        later.append(KEY, "exact");
        assert_eq!(later.get(KEY), Some("lower"));
    }

    #[test]
    fn header_text_compares_by_its_text_however_it_is_held() {
        let shared: Arc<str> = Arc::from("0190b6a4");
        let owned = Headers::new().with(CAUSE, "0190b6a4").with(TYPE, "Record");
        let mut other = Headers::new().with(CAUSE, HeaderText::Shared(shared.clone()));
        other.insert(TYPE, HeaderText::Static("Record"));
        assert_eq!(owned, other);
        assert_eq!(other.get(CAUSE), Some("0190b6a4"));
        assert_eq!(other.iter().collect::<Vec<_>>(), vec![(CAUSE, "0190b6a4"), (TYPE, "Record")]);
        assert_ne!(owned, Headers::new().with(CAUSE, HeaderText::Shared(shared)).with(TYPE, "Other"));
    }

    #[test]
    fn known_names_are_the_constants() {
        assert_eq!(known("Nats-Msg-Id"), Some(MSG_ID));
        assert_eq!(known("Flotilla-Dlq-Deliveries"), Some(DLQ_DELIVERIES));
        assert_eq!(known("nats-msg-id"), None, "another spelling is kept as sent");
        assert_eq!(known("X-Custom"), None);
    }

    #[test]
    fn entries_nats_cannot_carry_are_named() {
        assert_eq!(Headers::new().with(KEY, "a b").with("X-Ok", "").invalid_entry(), None);
        assert_eq!(Headers::new().with(KEY, "a\nb").invalid_entry().map(|e| e.0), Some(KEY));
        assert_eq!(Headers::new().with(KEY, "a\rb").invalid_entry().map(|e| e.0), Some(KEY));
        assert!(Headers::new().with("Bad:Name", "v").invalid_entry().is_some());
        assert!(Headers::new().with("Bad Name", "v").invalid_entry().is_some());
        assert!(Headers::new().with("", "v").invalid_entry().is_some());
        assert!(Headers::new().with("Näme", "v").invalid_entry().is_some());
    }

    #[test]
    fn copies_leave_the_brokers_own_headers_behind() {
        let mut h = Headers::new().with(MSG_ID, "id-1").with(KEY, "k").with("X-App", "1");
        h.append("Nats-Expected-Stream", "FLOTILLA_shop_orders")
            .append("Nats-Expected-Last-Subject-Sequence", "7")
            .append("nats-expected-last-sequence", "9")
            .append("NATS-EXPECTED-LAST-MSG-ID", "id-0")
            .append("Nats-Rollup", "sub")
            .append("Nats-TTL", "1s")
            .append("Nats-Schedule", "@at 2030-01-01T00:00:00Z")
            .append("Nats-Schedule-Target", "a.b")
            .append("Nats-Marker-Reason", "MaxAge")
            .append("Nats-Stream", "S")
            .append("Nats-Sequence", "3")
            .append("Nats-Batch-Id", "b1")
            .append("Nats-Incr", "1")
            .append("Natsy", "not the broker's")
            .append("Nats", "nor this");
        let copy = h.without_broker_controls();
        assert_eq!(
            copy.iter().collect::<Vec<_>>(),
            vec![(MSG_ID, "id-1"), (KEY, "k"), ("X-App", "1"), ("Natsy", "not the broker's"), ("Nats", "nor this")]
        );
        assert_eq!(h.len(), 18, "the original keeps them");
        assert!(is_broker_control("nats-ttl") && !is_broker_control("nats-msg-id") && !is_broker_control("Nat"));
        assert!(!is_broker_control("Ñats-x"), "a name that is not ASCII does not panic");
        let plain = Headers::new().with(MSG_ID, "id").with(KEY, "k");
        assert!(Arc::ptr_eq(&plain.entries, &plain.without_broker_controls().entries), "nothing to drop: shared");
    }

    #[test]
    fn kind_defaults_to_data_and_rejects_unknown() {
        assert_eq!(Headers::new().kind(), Some(MessageKind::Data));
        assert_eq!(Headers::new().with(KIND, "drain").kind(), Some(MessageKind::Drain));
        assert_eq!(Headers::new().with(KIND, "end-of-stream").kind(), Some(MessageKind::EndOfStream));
        assert_eq!(Headers::new().with(KIND, "boom").kind(), None);
    }
}
