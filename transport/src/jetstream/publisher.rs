//! JetStream publishes, pipelined over core NATS with one reply subscription per
//! connection.
//!
//! A JetStream publish is a core NATS publish with a reply subject, to which the server
//! sends the publish ack. async-nats' JetStream publish makes, for every message, a new
//! inbox, a oneshot channel registered in its request multiplexer, a timer, and decodes
//! the ack through an untagged enum; for a worker's outputs that was about a quarter of
//! the client's CPU (BENCHMARKS.md). Here a batch of messages registers once, each
//! message's reply subject is `<inbox>.<batch>.<index>`, and one task takes in the acks
//! of every batch: it frees the window's permits and wakes a batch when its last ack is
//! in.
//!
//! * **Window.** At most `window` publishes wait for their acks at once; a batch larger
//!   than the window goes out as acks of its first messages come back (the acks are taken
//!   in by the reply task, not by the caller, so nothing can wait forever for a permit).
//! * **Timeout.** A batch whose acks are not all in within the request timeout after its
//!   last message was sent fails with [`BrokerError::TimedOut`] (transient): publishing it
//!   again stores each message once, by its `Nats-Msg-Id`.
//! * **Cancellation.** Dropping a batch's future gives its permits back; acks that arrive
//!   later are ignored.

use super::{publish_payload_check, to_header_map};
use crate::broker::{BrokerError, BrokerResult, OutboundMessage, PublishAck};
use async_nats::{HeaderMap, StatusCode};
use futures::StreamExt;
use rustc_hash::FxHashMap;
use serde::Deserialize;
use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Duration;
use tokio::sync::{Semaphore, oneshot};
use tracing::debug;

/// JetStream's error code for a publish whose expected last subject sequence is not the
/// stream's.
const WRONG_LAST_SEQUENCE: u64 = 10071;

/// Permits a batch takes at a time while it sends (bounded by the window).
const CREDIT_CHUNK: usize = 256;

/// Sends JetStream publishes on one connection; owned by the broker. Dropping it ends
/// the reply task.
pub(super) struct Publisher {
    client: async_nats::Client,
    shared: Arc<Shared>,
    /// The server's `max_payload`.
    max_payload: usize,
    timeout: Duration,
    /// Closed on drop: the reply task ends and unsubscribes.
    _stop: oneshot::Sender<()>,
}

/// What the publisher and its reply task share.
struct Shared {
    /// `<inbox>.`: every reply subject starts with it.
    prefix: String,
    window: Semaphore,
    window_size: usize,
    registry: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    batches: FxHashMap<u64, BatchState>,
}

/// What a batch's caller wants back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Want {
    /// Every message's ack (or why it was refused), in order.
    Acks,
    /// Only whether all were stored: the first refusal, in send order.
    FirstRefusal,
}

struct BatchState {
    msgs: Arc<[OutboundMessage]>,
    /// Messages sent, once sealed (each holds a window permit until its ack is in).
    sent: usize,
    /// Acks in so far.
    acked: usize,
    /// Every message that will be sent has been.
    sealed: bool,
    /// Per message, with [`Want::Acks`].
    acks: Vec<Option<BrokerResult<PublishAck>>>,
    /// The refusal of the earliest message refused so far.
    first_refusal: Option<(usize, BrokerError)>,
    waker: Option<Waker>,
}

impl BatchState {
    fn complete(&self) -> bool {
        self.sealed && self.acked == self.sent
    }
}

/// What the server answered to one publish.
#[derive(Debug, Deserialize)]
struct Reply<'a> {
    #[serde(default)]
    error: Option<ApiError>,
    #[serde(default, borrow)]
    stream: Cow<'a, str>,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    duplicate: bool,
}

#[derive(Debug, Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

impl Shared {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        // The registry is plain counters and results: a panic elsewhere cannot leave it
        // in a state worse than losing those acks (their batches time out).
        self.registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes in one reply. Replies of batches that are gone (timed out, dropped) are
    /// ignored: their permits were given back with them.
    fn reply(&self, msg: async_nats::Message) {
        let Some((batch, index)) = parse_reply_subject(msg.subject.as_str(), &self.prefix) else {
            return;
        };
        let mut reg = self.registry();
        let Some(b) = reg.batches.get_mut(&batch) else { return };
        let Some(out) = b.msgs.get(index) else { return };
        let result = publish_result(out, &msg);
        b.acked += 1;
        self.window.add_permits(1);
        match result {
            Ok(ack) => {
                // Only a caller that wants each ack gets one (and its stream name copied).
                if let Some(slot) = b.acks.get_mut(index) {
                    *slot = Some(Ok(PublishAck {
                        stream: ack.stream.into_owned(),
                        seq: ack.seq,
                        duplicate: ack.duplicate,
                    }));
                }
            }
            Err(e) => {
                if let Some(slot) = b.acks.get_mut(index) {
                    *slot = Some(Err(e.clone()));
                }
                if b.first_refusal.as_ref().is_none_or(|(at, _)| index < *at) {
                    b.first_refusal = Some((index, e));
                }
            }
        }
        if b.complete()
            && let Some(w) = b.waker.take()
        {
            w.wake();
        }
    }

    /// Removes a batch that will not complete, giving back the permits of its `sent`
    /// messages whose acks are not in.
    fn abandon(&self, batch: u64, sent: usize) -> Option<BatchState> {
        let b = self.registry().batches.remove(&batch)?;
        self.window.add_permits(sent.saturating_sub(b.acked));
        Some(b)
    }
}

/// The batch id and message index of a reply subject `<prefix><batch>.<index>`.
fn parse_reply_subject(subject: &str, prefix: &str) -> Option<(u64, usize)> {
    let (batch, index) = subject.strip_prefix(prefix)?.split_once('.')?;
    Some((batch.parse().ok()?, index.parse().ok()?))
}

/// The publish ack of `out` (its stream name borrowed from the reply), or why the server
/// refused it.
fn publish_result<'a>(out: &OutboundMessage, msg: &'a async_nats::Message) -> BrokerResult<Reply<'a>> {
    if msg.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(BrokerError::NoStream { subject: out.subject.clone() });
    }
    let mut reply: Reply<'_> = serde_json::from_slice(&msg.payload).map_err(|e| {
        BrokerError::other(format!("publish to {}", out.subject), format!("unreadable publish ack: {e}"))
    })?;
    let Some(e) = reply.error.take() else { return Ok(reply) };
    let operation = format!("publish to {}", out.subject);
    if e.err_code == WRONG_LAST_SEQUENCE {
        return Err(BrokerError::WrongLastSequence {
            subject: out.subject.clone(),
            expected: out.expected_last_subject_seq.unwrap_or(0),
            actual: 0,
        });
    }
    // A full store (10023, 10047, no space left): its own kind, so the message says so.
    if let Some(err) = BrokerError::from_js_api(&operation, e.code, e.err_code, &e.description) {
        return Err(err);
    }
    if e.code == 503 {
        // JetStream cannot take it now (no leader, a store error); the same publish may
        // succeed later.
        return Err(BrokerError::ServerUnavailable {
            operation,
            reason: format!("{} (error code {})", e.description, e.err_code),
        });
    }
    Err(BrokerError::other(operation, format!("{} (status {}, error code {})", e.description, e.code, e.err_code)))
}

/// A registered batch: removed (and its permits given back) when dropped unfinished.
pub(super) struct Batch {
    shared: Arc<Shared>,
    id: u64,
    want: Want,
    /// Messages sent (the registry learns the count when the batch is sealed).
    sent: usize,
    /// Window permits taken for messages not sent yet (given back when it is dropped
    /// while sending).
    credits: usize,
    /// When its last message was sent; its acks are due a timeout later.
    sealed_at: tokio::time::Instant,
    timeout: Duration,
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.shared.window.add_permits(std::mem::take(&mut self.credits));
        self.shared.abandon(self.id, self.sent);
    }
}

impl Batch {
    /// Waits for every ack; each message's ack with [`Want::Acks`] (messages refused
    /// before sending carry their refusal), else an empty list once all are stored.
    ///
    /// # Errors
    /// With [`Want::FirstRefusal`], the refusal of the earliest message the server
    /// refused; [`BrokerError::TimedOut`] when acks did not all come in time.
    pub(super) async fn acks(self) -> BrokerResult<Vec<BrokerResult<PublishAck>>> {
        let deadline = self.sealed_at + self.timeout;
        let done = std::future::poll_fn(|cx| {
            let mut reg = self.shared.registry();
            match reg.batches.get_mut(&self.id) {
                Some(b) if b.complete() => Poll::Ready(reg.batches.remove(&self.id)),
                Some(b) => {
                    b.waker = Some(cx.waker().clone());
                    Poll::Pending
                }
                None => Poll::Ready(None),
            }
        });
        let finished = match tokio::time::timeout_at(deadline, done).await {
            Ok(Some(b)) => b,
            Ok(None) => return Err(self.timed_out(None)),
            Err(_) => {
                let b = self.shared.abandon(self.id, self.sent);
                return Err(self.timed_out(b.as_ref()));
            }
        };
        match self.want {
            Want::FirstRefusal => match finished.first_refusal {
                Some((_, e)) => Err(e),
                None => Ok(Vec::new()),
            },
            Want::Acks => Ok(finished
                .acks
                .into_iter()
                .enumerate()
                .map(|(i, a)| a.unwrap_or_else(|| Err(self.timed_out_at(&finished.msgs, i))))
                .collect()),
        }
    }

    fn timed_out(&self, b: Option<&BatchState>) -> BrokerError {
        let subject = b.and_then(|b| b.msgs.first()).map_or("a batch", |m| m.subject.as_str());
        BrokerError::TimedOut { operation: format!("publish to {subject}"), after: self.timeout }
    }

    fn timed_out_at(&self, msgs: &[OutboundMessage], i: usize) -> BrokerError {
        let subject = msgs.get(i).map_or("a batch", |m| m.subject.as_str());
        BrokerError::TimedOut { operation: format!("publish to {subject}"), after: self.timeout }
    }
}

impl Publisher {
    /// Subscribes to this connection's reply subjects and starts the task that takes in
    /// the acks.
    ///
    /// # Errors
    /// [`BrokerError::Disconnected`] when the subscription cannot be made.
    pub(super) async fn start(
        client: async_nats::Client,
        max_payload: usize,
        window: usize,
        timeout: Duration,
    ) -> BrokerResult<Self> {
        let prefix = format!("{}.", client.new_inbox());
        let mut replies = client.subscribe(format!("{prefix}>")).await.map_err(|e| BrokerError::Disconnected {
            operation: "subscribe to publish acks".into(),
            reason: e.to_string(),
        })?;
        let window_size = window.clamp(1, Semaphore::MAX_PERMITS);
        let shared = Arc::new(Shared {
            prefix,
            window: Semaphore::new(window_size),
            window_size,
            registry: Mutex::new(Registry::default()),
        });
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task_shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    reply = replies.next() => match reply {
                        Some(msg) => task_shared.reply(msg),
                        None => break,
                    },
                }
            }
            debug!("publish ack task ended");
        });
        Ok(Self { client, shared, max_payload, timeout, _stop: stop })
    }

    /// Sends `msgs` in order and returns the batch to await their acks. With
    /// [`Want::Acks`] a message refused before sending (too large, headers NATS cannot
    /// carry) gets its refusal in its place and the others go on; with
    /// [`Want::FirstRefusal`] such a refusal ends the call (messages before it may have
    /// been stored).
    ///
    /// # Errors
    /// [`BrokerError::Disconnected`] when the connection refuses a publish, and refusals
    /// as above.
    pub(super) async fn send(&self, msgs: Arc<[OutboundMessage]>, want: Want) -> BrokerResult<Batch> {
        let id = {
            let mut reg = self.shared.registry();
            reg.next_id += 1;
            let id = reg.next_id;
            let acks = if want == Want::Acks { vec![None; msgs.len()] } else { Vec::new() };
            reg.batches.insert(
                id,
                BatchState {
                    msgs: msgs.clone(),
                    sent: 0,
                    acked: 0,
                    sealed: false,
                    acks,
                    first_refusal: None,
                    waker: None,
                },
            );
            id
        };
        let mut batch = Batch {
            shared: self.shared.clone(),
            id,
            want,
            sent: 0,
            credits: 0,
            sealed_at: tokio::time::Instant::now(),
            timeout: self.timeout,
        };
        let mut refused: Vec<(usize, BrokerError)> = Vec::new();
        let mut reply = String::with_capacity(self.shared.prefix.len() + 24);
        let mut last_subject: Option<(&str, async_nats::Subject)> = None;
        let result = async {
            for (i, msg) in msgs.iter().enumerate() {
                let headers = match message_headers(msg, self.max_payload) {
                    Ok(h) => h,
                    Err(e) if want == Want::Acks => {
                        refused.push((i, e));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                if batch.credits == 0 {
                    let want = (msgs.len() - i).min(CREDIT_CHUNK).min(self.shared.window_size);
                    // The semaphore is never closed.
                    if let Ok(permits) = self.shared.window.acquire_many(want as u32).await {
                        permits.forget();
                        batch.credits = want;
                    }
                }
                batch.credits = batch.credits.saturating_sub(1);
                reply.clear();
                reply.push_str(&self.shared.prefix);
                {
                    use std::fmt::Write;
                    // Writing into a String cannot fail.
                    let _ = write!(reply, "{id}.{i}");
                }
                // Counted before it goes out (its permit is the batch's from now on).
                batch.sent += 1;
                // Consecutive messages to one subject (a queue stream's outputs) share
                // its text instead of copying it each.
                let subject = match &last_subject {
                    Some((text, subject)) if *text == msg.subject => subject.clone(),
                    _ => {
                        let subject = async_nats::Subject::from(msg.subject.as_str());
                        last_subject = Some((msg.subject.as_str(), subject.clone()));
                        subject
                    }
                };
                self.client
                    .publish_with_reply_and_headers(subject, reply.clone(), headers, msg.payload.clone())
                    .await
                    .map_err(|e| BrokerError::Disconnected {
                        operation: format!("publish to {}", msg.subject),
                        reason: e.to_string(),
                    })?;
            }
            Ok(())
        }
        .await;
        self.shared.window.add_permits(std::mem::take(&mut batch.credits));
        result?;
        batch.sealed_at = tokio::time::Instant::now();
        let mut reg = self.shared.registry();
        if let Some(b) = reg.batches.get_mut(&id) {
            b.sealed = true;
            b.sent = batch.sent;
            for (i, e) in refused {
                b.acks[i] = Some(Err(e));
            }
        }
        drop(reg);
        Ok(batch)
    }
}

/// The headers `msg` goes out with: its own, and JetStream's expected last subject
/// sequence when it has one. Refuses what the server would not take.
fn message_headers(msg: &OutboundMessage, max_payload: usize) -> BrokerResult<HeaderMap> {
    publish_payload_check(msg, max_payload)?;
    let mut headers = to_header_map(&msg.headers)?;
    if let Some(seq) = msg.expected_last_subject_seq {
        headers.insert(async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, seq.to_string().as_str());
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_subjects_name_their_batch_and_message() {
        assert_eq!(parse_reply_subject("_INBOX.abc.17.3", "_INBOX.abc."), Some((17, 3)));
        assert_eq!(parse_reply_subject("_INBOX.abc.17", "_INBOX.abc."), None);
        assert_eq!(parse_reply_subject("_INBOX.other.17.3", "_INBOX.abc."), None);
        assert_eq!(parse_reply_subject("_INBOX.abc.x.3", "_INBOX.abc."), None);
        assert_eq!(parse_reply_subject("_INBOX.abc.1.2.3", "_INBOX.abc."), None);
    }

    fn message(payload: &str, status: Option<StatusCode>) -> async_nats::Message {
        async_nats::Message {
            subject: "_INBOX.x.1.0".into(),
            reply: None,
            payload: bytes::Bytes::from(payload.to_owned()),
            headers: None,
            status,
            description: None,
            length: 0,
        }
    }

    #[test]
    fn publish_acks_and_refusals_are_read() {
        let out = OutboundMessage::new("a.b", "x");
        let msg = message(r#"{"stream":"S","seq":42}"#, None);
        let ack = publish_result(&out, &msg).expect("ack");
        assert_eq!((&*ack.stream, ack.seq, ack.duplicate), ("S", 42, false));
        let msg = message(r#"{"stream":"S","seq":42,"duplicate":true}"#, None);
        assert!(publish_result(&out, &msg).expect("ack").duplicate);
        let msg = message("", Some(StatusCode::NO_RESPONDERS));
        let none = publish_result(&out, &msg).map(|_| ());
        assert!(matches!(none, Err(BrokerError::NoStream { ref subject }) if subject == "a.b"), "{none:?}");
        let mut expecting = OutboundMessage::new("a.b", "x");
        expecting.expected_last_subject_seq = Some(7);
        let msg = message(
            r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 9"},"stream":"S","seq":0}"#,
            None,
        );
        let wrong = publish_result(&expecting, &msg).map(|_| ());
        assert!(matches!(wrong, Err(BrokerError::WrongLastSequence { expected: 7, .. })), "{wrong:?}");
        let msg = message(r#"{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}"#, None);
        let text = publish_result(&out, &msg).map(|_| ()).expect_err("refused").to_string();
        assert!(text.contains("maximum messages exceeded") && text.contains("a.b"), "{text}");
        let msg = message("not json", None);
        assert!(publish_result(&out, &msg).is_err());
    }
}
