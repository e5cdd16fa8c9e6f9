//! Consuming: pulls and claims, reading a delivery's metadata from its reply subject,
//! and acks.

use super::Inner;
use super::headers::from_header_map;
use crate::broker::{AckKind, AckToken, AckTokenInner, BrokerError, BrokerResult, Delivery, DeliveryInfo};
use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tracing::warn;

impl Inner {
    /// Sends a pull request for up to `max` messages, waiting at most `expires` for the
    /// first, and returns the subscription they arrive on. Plain core NATS, as async-nats' fetch
    /// does it, but its messages are read as they are: async-nats wraps each in a
    /// JetStream message holding a clone of its context, made and dropped per message.
    async fn pull(
        &self,
        stream: &str,
        consumer: &str,
        max: usize,
        expires: Duration,
    ) -> Result<async_nats::Subscriber, async_nats::Error> {
        let inbox = self.client.new_inbox();
        let sub = self.client.subscribe(inbox.clone()).await?;
        // As async-nats' fetch: no_wait with an expiry returns what is there, or waits
        // (up to the expiry) for the first message, then ends with a 404 status.
        let request = serde_json::json!({ "batch": max, "expires": expires.as_nanos() as u64, "no_wait": true });
        self.client
            .publish_with_reply(
                format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
                inbox,
                Bytes::from(request.to_string()),
            )
            .await?;
        Ok(sub)
    }

    /// A pulled message as a delivery. `shared` keeps the last stream and consumer names
    /// and subject, so the messages of one claim share them instead of allocating their own.
    fn delivery(&self, message: async_nats::Message, shared: &mut SharedNames) -> Option<Delivery> {
        let reply = message.reply.clone()?;
        // The common reply form is parsed here, without async-nats' per-token
        // iterator and date conversion (this runs for every delivery); any other form
        // goes through async-nats.
        let info = match parse_ack_subject(reply.as_str()) {
            Some(a) => {
                let (stream, consumer) = shared.names(a.stream, a.consumer);
                DeliveryInfo {
                    stream,
                    consumer,
                    stream_seq: a.stream_seq,
                    consumer_seq: a.consumer_seq,
                    delivered: a.delivered,
                    pending: a.pending,
                    published: SystemTime::UNIX_EPOCH + Duration::from_nanos(a.timestamp_ns),
                }
            }
            // async-nats reads the other forms (with a domain) from a JetStream message.
            None => match (jetstream::Message { message: message.clone(), context: self.js.clone() }).info() {
                Ok(info) => {
                    let (stream, consumer) = shared.names(info.stream, info.consumer);
                    DeliveryInfo {
                        stream,
                        consumer,
                        stream_seq: info.stream_sequence,
                        consumer_seq: info.consumer_sequence,
                        delivered: info.delivered.max(0) as u64,
                        pending: info.pending,
                        published: SystemTime::from(info.published),
                    }
                }
                Err(e) => {
                    warn!(error = %e, subject = %message.subject, "pulled message without JetStream metadata; skipped");
                    return None;
                }
            },
        };
        Some(Delivery {
            subject: shared.subject(message.subject.as_str()),
            headers: from_header_map(message.headers.as_ref()),
            payload: message.payload,
            info,
            token: AckToken(AckTokenInner::Reply(reply)),
        })
    }

    pub(super) async fn claim(
        &self,
        stream: String,
        consumer: String,
        max: usize,
        max_wait: Duration,
    ) -> BrokerResult<Vec<Delivery>> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let started = tokio::time::Instant::now();
        // The server needs an expiry of at least a millisecond or so to answer 408.
        let expires = max_wait.max(Duration::from_millis(10));
        // Known to exist (the handle is cached after the first look-up).
        self.consumer_handle(&stream, &consumer).await?;
        let op = || format!("claim from consumer {consumer} of {stream}");
        let mut batch = match self.pull(&stream, &consumer, max, expires).await {
            Ok(b) => b,
            Err(e) => return Err(BrokerError::Disconnected { operation: op(), reason: e.to_string() }),
        };
        // The request ends when the server says so (408 at its expiry, 404 for a
        // no-wait pull) or after `max` messages; the client gives up a few seconds
        // after the expiry in case that status was lost.
        let give_up = tokio::time::sleep(expires.saturating_add(Duration::from_secs(5)));
        tokio::pin!(give_up);
        let mut out = Vec::with_capacity(max.min(1024));
        let mut shared = SharedNames::default();
        while out.len() < max {
            let msg = tokio::select! {
                msg = batch.next() => msg,
                () = &mut give_up => None,
            };
            let Some(msg) = msg else { break };
            match msg.status {
                None | Some(async_nats::StatusCode::OK) => out.extend(self.delivery(msg, &mut shared)),
                Some(async_nats::StatusCode::TIMEOUT | async_nats::StatusCode::NOT_FOUND) => break,
                Some(async_nats::StatusCode::IDLE_HEARTBEAT) => {}
                Some(async_nats::StatusCode::NO_RESPONDERS) => {
                    // Nobody serves the consumer: it is gone (or JetStream is down).
                    // The next claim looks it up again.
                    self.consumers.remove(&(stream.clone(), consumer.clone()));
                    if out.is_empty() {
                        return Err(BrokerError::Disconnected {
                            operation: op(),
                            reason: "no responders: the consumer is gone or JetStream is unavailable".into(),
                        });
                    }
                    break;
                }
                Some(status) => {
                    let text = format!("{status}: {}", msg.description.as_deref().unwrap_or(""));
                    if status.as_u16() == 409 {
                        // E.g. `Exceeded MaxWaiting` on 2.9 or `Consumer Deleted`:
                        // never re-pull at once, wait out this claim's window.
                        warn!(error = %text, stream = %stream, consumer = %consumer, "pull refused; backing off");
                        if text.contains("Consumer Deleted") {
                            self.consumers.remove(&(stream.clone(), consumer.clone()));
                        }
                        if out.is_empty() {
                            tokio::time::sleep_until(started + max_wait).await;
                        }
                    } else if out.is_empty() {
                        return Err(BrokerError::Disconnected { operation: op(), reason: text });
                    }
                    break;
                }
            }
        }
        if out.is_empty() {
            // The server can answer at once with nothing (e.g. `408 Requests
            // Pending` when other pullers' requests cover the backlog): wait out the
            // window, so a caller that claims again does not spin.
            tokio::time::sleep_until(started + max_wait).await;
        }
        Ok(out)
    }

    pub(super) async fn ack_many(&self, acks: Vec<(AckToken, AckKind)>) -> BrokerResult<()> {
        let mut first = Ok(());
        for (token, kind) in acks {
            let sent = match reply_of(&token) {
                Ok(reply) => self
                    .client
                    .publish(reply, ack_body(kind))
                    .await
                    .map_err(|e| BrokerError::Disconnected { operation: "ack".into(), reason: e.to_string() }),
                Err(e) => Err(e),
            };
            if let Err(e) = sent
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }

    pub(super) async fn ack_confirmed(&self, reply: async_nats::Subject, kind: AckKind) -> BrokerResult<()> {
        let req = async_nats::Request::new().payload(ack_body(kind)).timeout(Some(self.request_timeout));
        self.client.send_request(reply, req).await.map(|_| ()).map_err(|e| match e.kind() {
            async_nats::RequestErrorKind::TimedOut => {
                BrokerError::TimedOut { operation: "confirmed ack".into(), after: self.request_timeout }
            }
            _ => BrokerError::Disconnected { operation: "confirmed ack".into(), reason: e.to_string() },
        })
    }
}

/// The metadata a JetStream delivery's reply subject carries.
#[derive(Debug, PartialEq, Eq)]
struct AckSubject<'a> {
    stream: &'a str,
    consumer: &'a str,
    delivered: u64,
    stream_seq: u64,
    consumer_seq: u64,
    timestamp_ns: u64,
    pending: u64,
}

/// Parses `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>`,
/// the form nats-server 2.9 and later send without a domain; `None` for anything else.
fn parse_ack_subject(subject: &str) -> Option<AckSubject<'_>> {
    let rest = subject.strip_prefix("$JS.ACK.")?;
    // One pass over the bytes: tokens end at '.', which is ASCII, so every cut is a
    // char boundary. (`str::find` per token and `str::parse` cost about a thousand
    // instructions per delivery; this runs for every delivery.)
    let mut tokens = [""; 7];
    let mut n = 0;
    let mut start = 0;
    for (i, &b) in rest.as_bytes().iter().enumerate() {
        if b == b'.' {
            // More tokens than the plain form: the domain-qualified form, left to
            // async-nats.
            *tokens.get_mut(n)? = &rest[start..i];
            n += 1;
            start = i + 1;
        }
    }
    *tokens.get_mut(n)? = &rest[start..];
    if n != 6 {
        return None;
    }
    let [stream, consumer, delivered, stream_seq, consumer_seq, timestamp_ns, pending] = tokens;
    if stream.is_empty() || consumer.is_empty() {
        return None;
    }
    Some(AckSubject {
        stream,
        consumer,
        delivered: decimal(delivered)?,
        stream_seq: decimal(stream_seq)?,
        consumer_seq: decimal(consumer_seq)?,
        timestamp_ns: decimal(timestamp_ns)?,
        pending: decimal(pending)?,
    })
}

/// A non-empty run of ASCII digits as a `u64`; `None` for anything else or on overflow.
fn decimal(token: &str) -> Option<u64> {
    if token.is_empty() {
        return None;
    }
    token.bytes().try_fold(0u64, |acc, b| {
        let digit = b.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        acc.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// What the deliveries of one claim share: the (stream, consumer) names, and the subject
/// (one per partition), each replaced when a message names another.
#[derive(Default)]
struct SharedNames {
    names: Option<(Arc<str>, Arc<str>)>,
    subject: Option<Arc<str>>,
}

impl SharedNames {
    fn names(&mut self, stream: &str, consumer: &str) -> (Arc<str>, Arc<str>) {
        match &self.names {
            Some((s, c)) if &**s == stream && &**c == consumer => (s.clone(), c.clone()),
            _ => {
                let fresh = (Arc::<str>::from(stream), Arc::<str>::from(consumer));
                self.names = Some(fresh.clone());
                fresh
            }
        }
    }

    fn subject(&mut self, subject: &str) -> Arc<str> {
        match &self.subject {
            Some(s) if &**s == subject => s.clone(),
            _ => self.subject.insert(Arc::from(subject)).clone(),
        }
    }
}

fn ack_body(kind: AckKind) -> Bytes {
    match kind {
        AckKind::Ack => Bytes::from_static(b"+ACK"),
        AckKind::Nak(None) => Bytes::from_static(b"-NAK"),
        AckKind::Nak(Some(d)) => Bytes::from(format!("-NAK {{\"delay\":{}}}", d.as_nanos())),
        AckKind::InProgress => Bytes::from_static(b"+WPI"),
        AckKind::Term => Bytes::from_static(b"+TERM"),
    }
}

pub(super) fn reply_of(token: &AckToken) -> BrokerResult<async_nats::Subject> {
    match &token.0 {
        AckTokenInner::Reply(r) => Ok(r.clone()),
        AckTokenInner::Embedded { .. } | AckTokenInner::Detached => {
            Err(BrokerError::other("ack", "not a delivery of this JetStream connection"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_subjects_parse_like_async_nats() {
        let got = parse_ack_subject("$JS.ACK.FLOTILLA_j_in.in-p3.2.1041.17.1764770000123456789.55").expect("parsed");
        assert_eq!(
            got,
            AckSubject {
                stream: "FLOTILLA_j_in",
                consumer: "in-p3",
                delivered: 2,
                stream_seq: 1041,
                consumer_seq: 17,
                timestamp_ns: 1_764_770_000_123_456_789,
                pending: 55,
            }
        );
        // The domain form (12 tokens) and anything malformed go to async-nats.
        assert_eq!(parse_ack_subject("$JS.ACK.dom.acc.S.C.1.2.3.4.5.rand"), None);
        assert_eq!(parse_ack_subject("$JS.ACK.S.C.1.2.3.4"), None);
        assert_eq!(parse_ack_subject("$JS.ACK.S.C.1.x.3.4.5"), None);
        assert_eq!(parse_ack_subject("_INBOX.abc"), None);
        for malformed in [
            "$JS.ACK.S.C.1..3.4.5",
            "$JS.ACK..C.1.2.3.4.5",
            "$JS.ACK.S..1.2.3.4.5",
            "$JS.ACK.S.C.+1.2.3.4.5",
            "$JS.ACK.S.C.1.2.3.4.5.",
            "$JS.ACK.S.C.1.2.3.18446744073709551616.5",
        ] {
            assert_eq!(parse_ack_subject(malformed), None, "{malformed}");
        }
        let max = parse_ack_subject("$JS.ACK.S.C.1.2.3.18446744073709551615.0").expect("u64::MAX parses");
        assert_eq!(max.timestamp_ns, u64::MAX);
    }

    #[test]
    fn ack_bodies_match_the_protocol() {
        assert_eq!(ack_body(AckKind::Ack), "+ACK");
        assert_eq!(ack_body(AckKind::Nak(Some(Duration::from_millis(1500)))), "-NAK {\"delay\":1500000000}");
        assert_eq!(ack_body(AckKind::Term), "+TERM");
        assert_eq!(ack_body(AckKind::InProgress), "+WPI");
    }
}

#[cfg(test)]
mod props;
