//! `dlq`: the dead-letter stream's entries listed, shown, replayed and purged.
//!
//! An entry's id is its sequence in the job's DLQ stream (`FLOTILLA_<job>_DLQ`), as
//! `dlq list` shows it. A replay publishes the entry's payload and its original
//! headers back to the subject it came from, as a new message (so it has a fresh
//! attempt budget and goes to the end of its partition), with the id
//! `replay-<job>-<entry>-<dead-lettered ms>`, and then deletes the entry. Replaying an
//! entry twice therefore sends it once: the second finds no entry, or, when the first
//! stopped between its publish and its delete, is dropped by the server as a duplicate
//! id — within the target stream's duplicate window (2 minutes). A replay interrupted
//! there and run again later than that sends the entry a second time.

use crate::client::ControlError;
use flotilla_actors::StreamType;
use flotilla_transport::broker::{BrokerError, OutboundMessage, SharedBroker, StoredMessage};
use flotilla_transport::clock::unix_millis;
use flotilla_transport::wire::{Codec, JobName, StreamName, Subjects, headers};
use serde::Serialize;
use std::time::{Duration, Instant};

/// The `dlq` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DlqCommand {
    /// List dead letters: id, stream, reason, attempts, age and key.
    #[command(
        after_help = "Examples:\n  flotilla --job shop dlq list\n  flotilla --job shop dlq list --stream orders --reason max-attempts --json"
    )]
    List {
        /// Only those of this input stream.
        #[arg(long)]
        stream: Option<String>,
        /// Only those with this reason (`max-attempts`, `malformed`, `handler`, ...).
        #[arg(long)]
        reason: Option<String>,
        /// Show at most this many (the oldest first).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter: its headers, reason, attempts and payload.
    #[command(after_help = "Example:\n  flotilla --job shop dlq show 42")]
    Show {
        /// The entry's id (from `dlq list`).
        #[arg(value_parser = clap::value_parser!(u64).range(1..))]
        id: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Send dead letters back to where they came from, with a fresh attempt budget.
    #[command(
        after_help = "Examples:\n  flotilla --job shop dlq replay 42 43\n  flotilla --job shop dlq replay --all --stream orders"
    )]
    Replay {
        /// Entry ids (from `dlq list`).
        ids: Vec<u64>,
        /// Every entry (matching --stream and --reason).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only those of this input stream.
        #[arg(long, requires = "all")]
        stream: Option<String>,
        /// With --all: only those with this reason.
        #[arg(long, requires = "all")]
        reason: Option<String>,
    },
    /// Delete dead letters for good.
    #[command(
        after_help = "Examples:\n  flotilla --job shop dlq purge 42\n  flotilla --job shop dlq purge --all --reason malformed"
    )]
    Purge {
        /// Entry ids (from `dlq list`).
        ids: Vec<u64>,
        /// Every entry (matching --stream and --reason).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// With --all: only those of this input stream.
        #[arg(long, requires = "all")]
        stream: Option<String>,
        /// With --all: only those with this reason.
        #[arg(long, requires = "all")]
        reason: Option<String>,
    },
}

/// One dead letter.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetterEntry {
    /// Its id: the sequence in the DLQ stream.
    pub id: u64,
    /// The input stream it came from (`_timers` for a broken delayed message).
    pub stream: String,
    /// The subject it came from (where a replay sends it).
    pub subject: String,
    /// The reason code.
    pub reason: String,
    /// The reason in words.
    pub detail: String,
    /// Attempts the task made (0 when it never ran, as for a malformed record).
    pub attempts: u64,
    /// Deliveries by the broker.
    pub deliveries: u64,
    /// Its key.
    pub key: Option<String>,
    /// Its sequence in the input stream.
    pub seq: Option<u64>,
    /// When it was dead-lettered (Unix ms).
    pub dead_lettered_ms: u64,
    /// Its headers (all of them).
    pub headers: Vec<(String, String)>,
    /// The payload's size in bytes.
    pub size: usize,
    #[serde(skip)]
    payload: bytes::Bytes,
}

impl DeadLetterEntry {
    /// Reads a stored DLQ message.
    pub fn from_stored(m: StoredMessage) -> Self {
        let h = &m.headers;
        let text = |name: &str| h.get(name).unwrap_or_default().to_owned();
        let stream = m.subject.rsplit_once("._dlq.").map_or_else(String::new, |(_, s)| s.to_owned());
        Self {
            id: m.seq,
            stream,
            subject: text(headers::DLQ_SUBJECT),
            reason: text(headers::DLQ_REASON),
            detail: text(headers::DLQ_DETAIL),
            attempts: h.get(headers::DLQ_ATTEMPTS).and_then(|d| d.parse().ok()).unwrap_or(0),
            deliveries: h.get(headers::DLQ_DELIVERIES).and_then(|d| d.parse().ok()).unwrap_or(0),
            key: h.get(headers::KEY).map(str::to_owned),
            seq: h.get(headers::DLQ_SEQ).and_then(|d| d.parse().ok()),
            dead_lettered_ms: unix_millis(m.published),
            headers: h.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
            size: m.payload.len(),
            payload: m.payload,
        }
    }

    /// Whether it matches the filters.
    pub fn matches(&self, stream: Option<&str>, reason: Option<&str>) -> bool {
        stream.is_none_or(|s| s == self.stream) && reason.is_none_or(|r| r == self.reason)
    }

    /// The message a replay publishes: the payload and the original headers, without
    /// the DLQ's, with the id `replay-<job>-<entry>`.
    ///
    /// # Errors
    /// When the entry does not say where it came from.
    pub fn replay_message(&self, subjects: &Subjects) -> Result<OutboundMessage, String> {
        if subjects.data_target_problem(&self.subject).is_some() && !self.subject.starts_with(&subjects.timer("")) {
            return Err(format!(
                "entry {} does not name a subject of job {} to go back to ({:?})",
                self.id,
                subjects.job(),
                self.subject
            ));
        }
        let mut out = OutboundMessage::new(self.subject.clone(), self.payload.clone());
        for (name, value) in &self.headers {
            // Not the DLQ's headers, nor the broker's (an outside producer's
            // `Nats-Expected-*` would refuse the replay); the id is the replay's own.
            if !name.starts_with("Flotilla-Dlq-") && !headers::is_broker_control(name) {
                out.headers.append(name.clone(), value.clone());
            }
        }
        out.headers.insert(headers::MSG_ID, self.replay_id(subjects));
        Ok(out)
    }

    /// The id a replay of this entry publishes with: its DLQ sequence and the time it
    /// was dead-lettered, so an entry of a DLQ stream recreated since (sequences start
    /// again) never shares it.
    pub fn replay_id(&self, subjects: &Subjects) -> String {
        format!("replay-{}-{}-{}", subjects.job(), self.id, self.dead_lettered_ms)
    }
}

/// One page of a listing ([`DeadLetters::page`]).
#[derive(Debug, Clone, Default)]
pub struct Page {
    /// The entries, oldest first, without payloads (`size` still says how big).
    pub entries: Vec<DeadLetterEntry>,
    /// When the page stopped before the end: the id to read on after.
    pub next: Option<u64>,
}

/// The DLQ of one job.
pub struct DeadLetters {
    broker: SharedBroker,
    subjects: Subjects,
    stream: String,
}

impl std::fmt::Debug for DeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetters").field("stream", &self.stream).finish()
    }
}

impl DeadLetters {
    /// The DLQ of `job`.
    ///
    /// # Errors
    /// A bad job name.
    pub fn new(broker: SharedBroker, job: &str) -> Result<Self, ControlError> {
        let subjects = Subjects::new(JobName::new(job).map_err(|e| ControlError::Refused(e.to_string()))?);
        let stream = subjects.dlq_stream_name();
        Ok(Self { broker, subjects, stream })
    }

    /// The entries matching the filters, oldest first, at most `limit`, with their
    /// payloads (a replay of them sends these).
    ///
    /// # Errors
    /// [`ControlError::Refused`] when the job has no DLQ or `stream` is not a stream
    /// name; broker failures.
    pub async fn list(
        &self,
        stream: Option<&str>,
        reason: Option<&str>,
        limit: usize,
    ) -> Result<Vec<DeadLetterEntry>, ControlError> {
        Ok(self.scan(stream, reason, 0, limit, usize::MAX, true).await?.entries)
    }

    /// One page of the listing: up to `limit` entries with ids over `after` matching the
    /// filters, oldest first, without their payloads, reading at most `max_reads`
    /// entries. Each read is one request that skips deleted entries and, with `stream`,
    /// other streams' entries; only a `reason` filter reads entries it does not list.
    ///
    /// # Errors
    /// As [`list`](Self::list).
    pub async fn page(
        &self,
        stream: Option<&str>,
        reason: Option<&str>,
        after: u64,
        limit: usize,
        max_reads: usize,
    ) -> Result<Page, ControlError> {
        self.scan(stream, reason, after, limit, max_reads, false).await
    }

    async fn scan(
        &self,
        stream: Option<&str>,
        reason: Option<&str>,
        after: u64,
        limit: usize,
        max_reads: usize,
        payloads: bool,
    ) -> Result<Page, ControlError> {
        let subject = match stream {
            None => self.subjects.dlq_all(),
            Some("_timers") => self.subjects.dlq_timers(),
            Some(s) => self
                .subjects
                .dlq(&StreamName::new(s).map_err(|e| ControlError::Refused(format!("stream filter {s:?}: {e}")))?),
        };
        let mut page = Page::default();
        let mut seq = after.saturating_add(1);
        let mut reads = 0;
        while page.entries.len() < limit {
            if reads == max_reads {
                page.next = Some(seq - 1);
                return Ok(page);
            }
            let stored = match self.broker.get_next_message(&self.stream, seq, &subject).await {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(page),
                Err(BrokerError::StreamNotFound { .. }) => {
                    return Err(ControlError::Refused(format!(
                        "job {} has no dead-letter stream on this server: start a node of it first",
                        self.subjects.job()
                    )));
                }
                Err(e) => return Err(e.into()),
            };
            reads += 1;
            seq = stored.seq.saturating_add(1);
            let mut entry = DeadLetterEntry::from_stored(stored);
            if entry.matches(stream, reason) {
                if !payloads {
                    entry.payload = bytes::Bytes::new();
                }
                page.entries.push(entry);
            }
        }
        // Stopped at the limit: more may follow.
        page.next = Some(seq - 1);
        Ok(page)
    }

    /// One entry.
    ///
    /// # Errors
    /// [`ControlError::Refused`] when there is none with this id.
    pub async fn get(&self, id: u64) -> Result<DeadLetterEntry, ControlError> {
        if id == 0 {
            return Err(ControlError::Refused("dead-letter ids start at 1: `dlq list` shows them".into()));
        }
        match self.broker.get_message(&self.stream, id).await {
            Ok(Some(m)) => Ok(DeadLetterEntry::from_stored(m)),
            Ok(None) | Err(BrokerError::StreamNotFound { .. }) => Err(ControlError::Refused(format!(
                "no dead letter {id} in job {}: `dlq list` shows the ids",
                self.subjects.job()
            ))),
            Err(e) => Err(e.into()),
        }
    }

    /// The entries a replay or purge acts on: `ids`, or every match with `all`.
    async fn select(
        &self,
        ids: &[u64],
        all: bool,
        stream: Option<&str>,
        reason: Option<&str>,
    ) -> Result<Vec<DeadLetterEntry>, ControlError> {
        if all {
            return self.list(stream, reason, usize::MAX).await;
        }
        if ids.is_empty() {
            return Err(ControlError::Refused("name the entries (ids from `dlq list`) or give --all".into()));
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            out.push(self.get(id).await?);
        }
        Ok(out)
    }

    /// Replays entries (see the module docs); returns how many were sent back.
    ///
    /// # Errors
    /// [`ControlError::Incomplete`] naming those that failed.
    pub async fn replay(
        &self,
        ids: &[u64],
        all: bool,
        stream: Option<&str>,
        reason: Option<&str>,
        progress: bool,
    ) -> Result<usize, ControlError> {
        let entries = self.select(ids, all, stream, reason).await?;
        self.each(&entries, "replayed", progress, async |entry| self.send_back(entry).await).await
    }

    /// Replays one entry quietly (the dashboard's button).
    ///
    /// # Errors
    /// [`ControlError::Refused`] when there is no such entry or it cannot be sent
    /// back; broker failures.
    pub async fn replay_one(&self, id: u64) -> Result<(), ControlError> {
        let entry = self.get(id).await?;
        self.send_back(&entry).await.map_err(ControlError::Refused)
    }

    /// Publishes the entry to its subject again, then deletes it.
    async fn send_back(&self, entry: &DeadLetterEntry) -> Result<(), String> {
        let msg = entry.replay_message(&self.subjects)?;
        self.broker.publish(msg).await.map_err(|e| e.to_string())?;
        self.broker
            .delete_message(&self.stream, entry.id)
            .await
            .map_err(|e| format!("sent back, but not removed: {e}"))?;
        Ok(())
    }

    /// Deletes entries; returns how many.
    ///
    /// # Errors
    /// [`ControlError::Incomplete`] naming those that failed.
    pub async fn purge(
        &self,
        ids: &[u64],
        all: bool,
        stream: Option<&str>,
        reason: Option<&str>,
        progress: bool,
    ) -> Result<usize, ControlError> {
        let entries = self.select(ids, all, stream, reason).await?;
        self.each(&entries, "purged", progress, async |entry| {
            match self.broker.delete_message(&self.stream, entry.id).await {
                Ok(true) => Ok(()),
                Ok(false) => Err("already gone".to_owned()),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
    }

    /// Runs `op` on every entry, with progress (`verb`) and a summary; the error names
    /// the entries it failed for.
    async fn each(
        &self,
        entries: &[DeadLetterEntry],
        verb: &'static str,
        progress: bool,
        op: impl AsyncFn(&DeadLetterEntry) -> Result<(), String>,
    ) -> Result<usize, ControlError> {
        let mut meter = Progress::new(verb, entries.len(), progress);
        let mut failed = Vec::new();
        for entry in entries {
            match op(entry).await {
                Ok(()) => meter.done(),
                Err(e) => failed.push(format!("{}: {e}", entry.id)),
            }
        }
        meter.finish(&failed);
        if failed.is_empty() {
            Ok(entries.len())
        } else {
            Err(ControlError::Incomplete(format!(
                "{} of {} not {verb}: {}",
                failed.len(),
                entries.len(),
                failed.join("; ")
            )))
        }
    }
}

/// Progress on standard error, at most once a second, and a summary.
struct Progress {
    verb: &'static str,
    total: usize,
    done: usize,
    show: bool,
    last: Instant,
}

impl Progress {
    fn new(verb: &'static str, total: usize, show: bool) -> Self {
        Self { verb, total, done: 0, show, last: Instant::now() }
    }

    fn done(&mut self) {
        self.done += 1;
        if self.show && self.last.elapsed() >= Duration::from_secs(1) {
            self.last = Instant::now();
            eprintln!("{} {} of {}", self.verb, self.done, self.total);
        }
    }

    fn finish(&self, failed: &[String]) {
        if self.show {
            eprintln!("{} {} of {} dead letter(s); {} failed", self.verb, self.done, self.total, failed.len());
        }
    }
}

/// A payload for people: the value as JSON when the type is known and it decodes, else
/// UTF-8 text when it is printable, else hex.
pub fn describe_payload(
    payload: &[u8],
    type_name: Option<&str>,
    types: &[StreamType],
    stream: &str,
) -> (String, String) {
    let codec = Codec::default();
    let known =
        types.iter().find(|t| t.stream == stream).or_else(|| types.iter().find(|t| Some(t.type_name) == type_name));
    if let Some(t) = known {
        match t.to_json(&codec, payload) {
            Ok(v) => return (format!("json ({})", t.type_name), serde_json::to_string_pretty(&v).unwrap_or_default()),
            Err(e) => {
                let (how, text) = raw(payload);
                return (format!("{how}; it does not decode as {}: {e}", t.type_name), text);
            }
        }
    }
    raw(payload)
}

fn raw(payload: &[u8]) -> (String, String) {
    match std::str::from_utf8(payload) {
        Ok(s) if s.chars().all(|c| !c.is_control() || c == '\n' || c == '\t') => ("text".into(), s.to_owned()),
        _ => ("hex".into(), flotilla_actors::store::hex(payload)),
    }
}

/// Runs a `dlq` command for `job`, printing what happens; returns the exit code.
pub async fn run(broker: SharedBroker, job: &str, command: DlqCommand, types: &[StreamType]) -> i32 {
    let dlq = match DeadLetters::new(broker, job) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let result = match command {
        DlqCommand::List { stream, reason, limit, json } => {
            dlq.list(stream.as_deref(), reason.as_deref(), limit).await.map(|entries| print_list(&entries, json))
        }
        DlqCommand::Show { id, json } => dlq.get(id).await.map(|e| print_entry(&e, types, json)),
        DlqCommand::Replay { ids, all, stream, reason } => {
            dlq.replay(&ids, all, stream.as_deref(), reason.as_deref(), true).await.map(drop)
        }
        DlqCommand::Purge { ids, all, stream, reason } => {
            dlq.purge(&ids, all, stream.as_deref(), reason.as_deref(), true).await.map(drop)
        }
    };
    crate::client::exit_code(result)
}

fn print_list(entries: &[DeadLetterEntry], json: bool) {
    if json {
        for e in entries {
            crate::outln!("{}", serde_json::to_string(e).unwrap_or_default());
        }
        return;
    }
    let now = unix_millis(std::time::SystemTime::now());
    crate::outln!(
        "{:>8}  {:<20} {:<14} {:>8} {:>8}  {:<20} DETAIL",
        "ID",
        "STREAM",
        "REASON",
        "ATTEMPTS",
        "AGE",
        "KEY"
    );
    for e in entries {
        let age = Duration::from_millis(now.saturating_sub(e.dead_lettered_ms));
        let mut detail = e.detail.clone();
        if detail.chars().count() > 60 {
            detail = detail.chars().take(59).chain(['…']).collect();
        }
        crate::outln!(
            "{:>8}  {:<20} {:<14} {:>8} {:>8}  {:<20} {}",
            e.id,
            e.stream,
            e.reason,
            e.attempts,
            humantime::format_duration(Duration::from_secs(age.as_secs())).to_string(),
            e.key.as_deref().unwrap_or("-"),
            detail
        );
    }
    eprintln!("{} dead letter(s) shown (at most --limit, oldest first)", entries.len());
}

fn print_entry(e: &DeadLetterEntry, types: &[StreamType], json: bool) {
    let (how, payload) = describe_payload(
        &e.payload,
        e.headers.iter().find(|(k, _)| k == headers::TYPE).map(|(_, v)| v.as_str()),
        types,
        &e.stream,
    );
    if json {
        let mut v = serde_json::to_value(e).unwrap_or_default();
        v["payload_format"] = how.into();
        v["payload"] = payload.into();
        crate::outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    crate::outln!("dead letter {} of stream {}", e.id, e.stream);
    crate::outln!("  reason:   {} ({})", e.reason, e.detail);
    crate::outln!("  attempts: {} ({} deliveries)", e.attempts, e.deliveries);
    crate::outln!("  from:     {}{}", e.subject, e.seq.map(|s| format!(" at sequence {s}")).unwrap_or_default());
    crate::outln!("  headers:");
    for (k, v) in &e.headers {
        crate::outln!("    {k}: {v}");
    }
    crate::outln!("  payload ({} bytes, {how}):", e.size);
    for line in payload.lines() {
        crate::outln!("    {line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_transport::wire::Headers;

    fn stored() -> StoredMessage {
        StoredMessage {
            subject: "flotilla.shop._dlq.orders".into(),
            seq: 42,
            headers: Headers::new()
                .with(headers::MSG_ID, "dlq-FLOTILLA_shop_orders-7")
                .with(headers::KEY, "customer-7")
                .with(headers::TYPE, "Order")
                .with("traceparent", "00-abc-def-01")
                .with(headers::DLQ_REASON, "max-attempts")
                .with(headers::DLQ_DETAIL, "boom")
                .with(headers::DLQ_SUBJECT, "flotilla.shop.orders.3")
                .with(headers::DLQ_SEQ, "7")
                .with(headers::DLQ_DELIVERIES, "1")
                .with(headers::DLQ_ATTEMPTS, "3"),
            payload: bytes::Bytes::from_static(b"poison"),
            published: std::time::SystemTime::now(),
        }
    }

    #[test]
    fn a_replay_goes_back_to_its_subject_with_its_headers_and_an_id_of_its_entry() {
        let entry = DeadLetterEntry::from_stored(stored());
        assert_eq!(
            (entry.stream.as_str(), entry.reason.as_str(), entry.attempts, entry.seq),
            ("orders", "max-attempts", 3, Some(7))
        );
        assert!(entry.matches(Some("orders"), Some("max-attempts")) && !entry.matches(None, Some("malformed")));
        let subjects = Subjects::new(JobName::new("shop").expect("job"));
        let msg = entry.replay_message(&subjects).expect("replayable");
        assert_eq!(msg.subject, "flotilla.shop.orders.3");
        assert_eq!(msg.headers.msg_id(), Some(format!("replay-shop-42-{}", entry.dead_lettered_ms).as_str()));
        assert_eq!(msg.headers.get(headers::KEY), Some("customer-7"));
        assert_eq!(msg.headers.get("traceparent"), Some("00-abc-def-01"));
        assert!(msg.headers.iter().all(|(k, _)| !k.starts_with("Flotilla-Dlq-")));
        let mut elsewhere = stored();
        elsewhere.headers.insert(headers::DLQ_SUBJECT, "$JS.API.STREAM.DELETE.X");
        assert!(DeadLetterEntry::from_stored(elsewhere).replay_message(&subjects).is_err());
    }

    /// A DLQ of 30 entries (ids 1 to 30: odd ones `orders`/`handler`, even ones
    /// `payments`/`max-attempts`), the first 10 deleted.
    async fn thirty_with_ten_deleted() -> DeadLetters {
        use flotilla_transport::broker::{Retention, StreamSpec};
        let broker = flotilla_transport::EmbeddedBroker::new().shared();
        let spec = StreamSpec::new("FLOTILLA_shop_DLQ", vec!["flotilla.shop._dlq.>".into()], Retention::Limits);
        broker.ensure_stream(spec).await.expect("stream");
        for n in 1..=30u64 {
            let (stream, reason) = if n % 2 == 1 { ("orders", "handler") } else { ("payments", "max-attempts") };
            let msg = OutboundMessage::new(format!("flotilla.shop._dlq.{stream}"), b"poison".to_vec())
                .with_header(headers::DLQ_REASON, reason)
                .with_header(headers::DLQ_SUBJECT, format!("flotilla.shop.{stream}.0"));
            assert_eq!(broker.publish(msg).await.expect("publish").seq, n);
        }
        for seq in 1..=10 {
            assert!(broker.delete_message("FLOTILLA_shop_DLQ", seq).await.expect("delete"));
        }
        DeadLetters::new(broker, "shop").expect("dlq")
    }

    fn ids(page: &Page) -> Vec<u64> {
        page.entries.iter().map(|e| e.id).collect()
    }

    #[tokio::test]
    async fn a_page_stops_at_its_limit_or_its_reads_and_says_where_to_go_on() {
        let dlq = thirty_with_ten_deleted().await;
        let first = dlq.page(None, None, 0, 5, 100).await.expect("page");
        assert_eq!((ids(&first), first.next), ((11..=15).collect(), Some(15)), "past the deleted ones");
        assert!(first.entries.iter().all(|e| e.payload.is_empty() && e.size == 6), "no payloads held, sizes kept");
        let rest = dlq.page(None, None, 15, 100, 100).await.expect("page");
        assert_eq!((ids(&rest), rest.next), ((16..=30).collect(), None), "the last page");
        let payments = dlq.page(Some("payments"), None, 0, 100, 100).await.expect("page");
        assert_eq!(ids(&payments), (12..=30).step_by(2).collect::<Vec<_>>());
        // A reason filter reads what it skips, up to the reads allowed.
        let handler = dlq.page(None, Some("handler"), 0, 100, 4).await.expect("page");
        assert_eq!((ids(&handler), handler.next), (vec![11, 13], Some(14)));
        let err = dlq.page(Some("a.>"), None, 0, 10, 10).await.expect_err("not a stream name");
        assert!(err.to_string().contains("stream filter"), "{err}");
        let listed = dlq.list(Some("orders"), None, 2).await.expect("list");
        assert!(listed.iter().all(|e| e.payload.as_ref() == b"poison"), "a listing to replay keeps payloads");
    }

    #[test]
    fn payloads_show_as_json_text_or_hex() {
        let def = flotilla_actors::StreamDef::<(u32, String)>::queue("orders");
        let types = [StreamType::of(&def)];
        let bytes = Codec::default().encode(&(7u32, "seven".to_owned())).expect("encodes");
        let (how, text) = describe_payload(&bytes, None, &types, "orders");
        assert!(how.starts_with("json") && text.contains("seven"), "{how}: {text}");
        assert_eq!(describe_payload(b"poison-1", None, &[], "orders"), ("text".into(), "poison-1".into()));
        assert_eq!(describe_payload(&[0, 255], None, &[], "orders").0, "hex");
        let (how, _) = describe_payload(b"poison", None, &types, "orders");
        assert!(how.contains("does not decode"), "{how}");
    }
}
