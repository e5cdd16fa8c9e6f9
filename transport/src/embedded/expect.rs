//! JetStream's publish expectations (`Nats-Expected-*` headers), checked by the
//! embedded broker as the server checks them, so that a copy which wrongly keeps a
//! producer's expectations fails here as it would on NATS.
//!
//! Checked: `Nats-Expected-Stream`, `Nats-Expected-Last-Sequence` and
//! `Nats-Expected-Last-Subject-Sequence`. Not checked: `Nats-Expected-Last-Msg-Id`.

use crate::broker::{BrokerError, BrokerResult};
use crate::wire::Headers;

/// The value of header `name`, spelled exactly so (the server looks headers up by
/// their exact spelling).
fn exact<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
}

/// A sequence the header expects; one that is no number never matches (as on the
/// server, which reads it as -1).
fn sequence(value: &str) -> u64 {
    value.trim().parse().unwrap_or(u64::MAX)
}

/// Checks the expectations in `headers` of a publish to `subject` in stream `stream`,
/// whose last sequence is `last_seq`; `last_for_subject` gives the subject's.
///
/// # Errors
/// As JetStream refuses: another stream's name (`expected stream does not match`), or
/// [`BrokerError::WrongLastSequence`].
pub(super) fn check(
    headers: &Headers,
    subject: &str,
    stream: &str,
    last_seq: u64,
    last_for_subject: impl FnOnce() -> u64,
) -> BrokerResult<()> {
    if headers.is_empty() {
        return Ok(());
    }
    if let Some(expected) = exact(headers, "Nats-Expected-Stream")
        && expected != stream
    {
        return Err(BrokerError::other(format!("publish to {subject}"), "expected stream does not match"));
    }
    if let Some(expected) = exact(headers, "Nats-Expected-Last-Subject-Sequence").map(sequence) {
        let actual = last_for_subject();
        if actual != expected {
            return Err(BrokerError::WrongLastSequence { subject: subject.to_owned(), expected, actual });
        }
    }
    if let Some(expected) = exact(headers, "Nats-Expected-Last-Sequence").map(sequence)
        && expected != last_seq
    {
        return Err(BrokerError::WrongLastSequence { subject: subject.to_owned(), expected, actual: last_seq });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectations_are_checked_by_their_exact_names() {
        let h = |name: &'static str, value: &str| Headers::new().with(name, value.to_owned());
        assert!(check(&Headers::new(), "s.a", "S", 4, || 2).is_ok());
        assert!(check(&h("Nats-Expected-Stream", "S"), "s.a", "S", 4, || 2).is_ok());
        let err = check(&h("Nats-Expected-Stream", "T"), "s.a", "S", 4, || 2).expect_err("another stream");
        assert!(err.to_string().contains("expected stream does not match"), "{err}");
        assert!(check(&h("Nats-Expected-Last-Subject-Sequence", "2"), "s.a", "S", 4, || 2).is_ok());
        assert!(matches!(
            check(&h("Nats-Expected-Last-Subject-Sequence", "0"), "s.a", "S", 4, || 2),
            Err(BrokerError::WrongLastSequence { expected: 0, actual: 2, .. })
        ));
        assert!(check(&h("Nats-Expected-Last-Subject-Sequence", "two"), "s.a", "S", 4, || 2).is_err());
        assert!(check(&h("Nats-Expected-Last-Sequence", "4"), "s.a", "S", 4, || 2).is_ok());
        assert!(check(&h("Nats-Expected-Last-Sequence", "3"), "s.a", "S", 4, || 2).is_err());
        assert!(check(&h("X-Other", "3"), "s.a", "S", 4, || 2).is_ok());
    }
}
