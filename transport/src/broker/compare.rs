//! Comparing an existing configuration with the wanted one, shared by both backends.

use super::{BrokerError, ConsumerSpec, KvSpec, StreamSpec};
use std::fmt::Debug;

fn field<T: Debug + PartialEq>(object: &str, name: &str, existing: &T, wanted: &T) -> Result<(), BrokerError> {
    if existing == wanted {
        Ok(())
    } else {
        Err(BrokerError::ConfigMismatch {
            object: object.to_owned(),
            field: name.to_owned(),
            existing: format!("{existing:?}"),
            wanted: format!("{wanted:?}"),
        })
    }
}

/// `Ok` when `existing` is `wanted` in every field Flotilla sets.
pub(crate) fn stream(existing: &StreamSpec, wanted: &StreamSpec) -> Result<(), BrokerError> {
    let object = format!("stream {}", wanted.name);
    let mut a = existing.subjects.clone();
    let mut b = wanted.subjects.clone();
    a.sort();
    b.sort();
    field(&object, "subjects", &a, &b)?;
    field(&object, "retention", &existing.retention, &wanted.retention)?;
    field(&object, "storage", &existing.storage, &wanted.storage)?;
    field(&object, "max_age", &existing.max_age, &wanted.max_age)?;
    field(&object, "max_msgs_per_subject", &existing.max_msgs_per_subject, &wanted.max_msgs_per_subject)?;
    field(&object, "max_msgs", &existing.max_msgs, &wanted.max_msgs)?;
    field(&object, "discard", &existing.discard, &wanted.discard)?;
    field(&object, "duplicate_window", &existing.duplicate_window, &wanted.duplicate_window)?;
    field(&object, "replicas", &existing.replicas, &wanted.replicas)
}

/// `Ok` when `existing` is `wanted` in every field Flotilla sets.
pub(crate) fn consumer(stream: &str, existing: &ConsumerSpec, wanted: &ConsumerSpec) -> Result<(), BrokerError> {
    consumer_fixed(stream, existing, wanted)?;
    let object = format!("consumer {} of stream {stream}", wanted.name);
    field(&object, "ack_wait", &existing.ack_wait, &wanted.ack_wait)?;
    field(&object, "max_deliver", &existing.max_deliver, &wanted.max_deliver)?;
    field(&object, "max_ack_pending", &existing.max_ack_pending, &wanted.max_ack_pending)
}

/// `Ok` when the fields that cannot change on a live consumer (what it reads and how
/// it acknowledges) are the wanted ones. The others (ack-wait, max deliveries, max
/// ack-pending) are updated in place.
pub(crate) fn consumer_fixed(stream: &str, existing: &ConsumerSpec, wanted: &ConsumerSpec) -> Result<(), BrokerError> {
    let object = format!("consumer {} of stream {stream}", wanted.name);
    field(&object, "filter_subject", &existing.filter_subject, &wanted.filter_subject)?;
    field(&object, "ack_policy", &existing.ack_policy, &wanted.ack_policy)
}

/// `Ok` when the bucket's history and expiry are the wanted ones.
pub(crate) fn kv(existing: &KvSpec, wanted: &KvSpec) -> Result<(), BrokerError> {
    let object = format!("KV bucket {}", wanted.bucket);
    field(&object, "history", &existing.history, &wanted.history)?;
    field(&object, "max_age", &existing.max_age, &wanted.max_age)?;
    field(&object, "storage", &existing.storage, &wanted.storage)
}

/// The stream that backs a KV bucket, as NATS clients create it.
pub(crate) fn kv_stream(spec: &KvSpec) -> StreamSpec {
    use super::{Discard, Retention};
    use std::time::Duration;
    let mut s =
        StreamSpec::new(format!("KV_{}", spec.bucket), vec![format!("$KV.{}.>", spec.bucket)], Retention::Limits);
    s.storage = spec.storage;
    s.max_age = spec.max_age;
    s.max_msgs_per_subject = Some(u64::from(spec.history.max(1)));
    s.discard = Discard::New;
    // The server refuses a duplicate window longer than max_age.
    s.duplicate_window = match spec.max_age {
        Some(age) if age < Duration::from_secs(120) => age,
        _ => Duration::from_secs(120),
    };
    s
}

/// Checks a KV bucket name: `[A-Za-z0-9_-]+`.
pub(crate) fn validate_bucket(bucket: &str) -> Result<(), BrokerError> {
    if !bucket.is_empty() && bucket.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        Ok(())
    } else {
        Err(BrokerError::other(
            "create KV bucket",
            format!("invalid bucket name {bucket:?}: use 1 or more characters from [A-Za-z0-9_-]"),
        ))
    }
}

/// Checks a KV key: `[-/_=.A-Za-z0-9]+`, not starting or ending with `.`.
pub(crate) fn validate_key(key: &str) -> Result<(), BrokerError> {
    let ok = !key.is_empty()
        && !key.starts_with('.')
        && !key.ends_with('.')
        && key.chars().all(|c| c.is_ascii_alphanumeric() || "-/_=.".contains(c));
    if ok {
        Ok(())
    } else {
        Err(BrokerError::other(
            "KV operation",
            format!("invalid key {key:?}: use characters from [-/_=.A-Za-z0-9], not starting or ending with '.'"),
        ))
    }
}

/// Whether a NATS subject matches a pattern with `*` (one token) and `>` (the rest).
pub(crate) fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Whether two subject patterns can match a common subject.
pub(crate) fn subjects_overlap(a: &str, b: &str) -> bool {
    let mut x = a.split('.');
    let mut y = b.split('.');
    loop {
        match (x.next(), y.next()) {
            (Some(">"), Some(_)) | (Some(_), Some(">")) => return true,
            (Some("*"), Some(_)) | (Some(_), Some("*")) => {}
            (Some(p), Some(q)) if p == q => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching_follows_nats_wildcards() {
        assert!(subject_matches("a.b", "a.b"));
        assert!(subject_matches("a.*", "a.b"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(!subject_matches("a.b", "a.b.c"));
        assert!(subjects_overlap("a.*", "a.b"));
        assert!(subjects_overlap("a.>", "a.*.c"));
        assert!(!subjects_overlap("a.b", "a.c"));
        assert!(!subjects_overlap("flotilla.j.s.*", "flotilla.j._dlq.>"));
    }

    #[test]
    fn keys_and_buckets_are_checked() {
        assert!(validate_key("p.3").is_ok());
        assert!(validate_key("node-a/x=1").is_ok());
        assert!(validate_key("").is_err());
        assert!(validate_key(".a").is_err());
        assert!(validate_key("a b").is_err());
        assert!(validate_key("a*").is_err());
        assert!(validate_bucket("FLOTILLA_relay_LEASES").is_ok());
        assert!(validate_bucket("a.b").is_err());
    }
}
