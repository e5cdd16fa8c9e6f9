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

/// A difference between an existing stream or bucket and what Flotilla asks for that
/// is safe to keep: an operator's choice (more replicas, an age or size limit) that
/// changes how long or where data is kept, not what Flotilla reads or how it acks.
/// Kept as it is, with a logged note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tolerated {
    /// `stream NAME` or `KV bucket NAME`.
    pub object: String,
    /// The setting that differs.
    pub field: &'static str,
    /// Its value on the server.
    pub existing: String,
    /// What Flotilla would have created.
    pub wanted: String,
}

impl Tolerated {
    /// Fewer replicas than asked for: the data is less safe than the job was told.
    pub fn is_fewer_replicas(&self) -> bool {
        self.field == "replicas"
            && matches!((self.existing.parse::<usize>(), self.wanted.parse::<usize>()), (Ok(e), Ok(w)) if e < w)
    }

    /// Logs the note: a warning when the object is less replicated than asked, else info.
    pub fn log(&self) {
        let Self { object, field, existing, wanted } = self;
        if self.is_fewer_replicas() {
            tracing::warn!(
                %object, field, %existing, %wanted,
                "kept as it is, with fewer replicas than asked: raise them with `nats stream edit --replicas {wanted}`"
            );
        } else if *field == "subjects" {
            tracing::info!(
                %object, %existing, %wanted,
                "kept the subjects of a stream created before streams listed their partitions: it also takes records for partitions that do not exist, which no consumer reads (`status` counts them)"
            );
        } else {
            tracing::info!(%object, field, %existing, %wanted, "kept the operator's setting (safe to differ)");
        }
    }
}

/// A limit Flotilla does not set (`None`) may have been set by an operator; one it sets
/// must match.
fn limit<T: Debug + PartialEq>(
    object: &str,
    name: &'static str,
    existing: &Option<T>,
    wanted: &Option<T>,
    tolerated: &mut Vec<Tolerated>,
) -> Result<(), BrokerError> {
    match (existing, wanted) {
        (Some(e), None) => {
            tolerated.push(Tolerated {
                object: object.to_owned(),
                field: name,
                existing: format!("{e:?}"),
                wanted: "none".into(),
            });
            Ok(())
        }
        _ => field(object, name, existing, wanted),
    }
}

/// Replicas may always differ: a note when they do.
fn replicas(object: String, existing: usize, wanted: usize) -> Option<Tolerated> {
    (existing != wanted).then(|| Tolerated {
        object,
        field: "replicas",
        existing: existing.to_string(),
        wanted: wanted.to_string(),
    })
}

/// `Ok` when `existing` is `wanted` in every field that decides what Flotilla reads and
/// how it acknowledges; with the differences that are safe to keep (replicas, and
/// age, count and size limits Flotilla does not set itself).
///
/// # Errors
/// [`BrokerError::ConfigMismatch`] naming the first field that must not differ.
pub(crate) fn stream(existing: &StreamSpec, wanted: &StreamSpec) -> Result<Vec<Tolerated>, BrokerError> {
    let object = format!("stream {}", wanted.name);
    let mut tolerated = Vec::new();
    subjects(&object, &existing.subjects, &wanted.subjects, &mut tolerated)?;
    field(&object, "retention", &existing.retention, &wanted.retention)?;
    field(&object, "storage", &existing.storage, &wanted.storage)?;
    if wanted.keep_all {
        keeps_all(&object, existing)?;
    }
    limit(&object, "max_age", &existing.max_age, &wanted.max_age, &mut tolerated)?;
    field(&object, "max_msgs_per_subject", &existing.max_msgs_per_subject, &wanted.max_msgs_per_subject)?;
    limit(&object, "max_msgs", &existing.max_msgs, &wanted.max_msgs, &mut tolerated)?;
    limit(&object, "max_bytes", &existing.max_bytes, &wanted.max_bytes, &mut tolerated)?;
    field(&object, "discard", &existing.discard, &wanted.discard)?;
    // A KV bucket's window follows its max age (the server refuses a longer one), so
    // an operator's max age on a bucket moves it too.
    if !wanted.name.starts_with("KV_") {
        field(&object, "duplicate_window", &existing.duplicate_window, &wanted.duplicate_window)?;
    }
    tolerated.extend(replicas(object, existing.replicas, wanted.replicas));
    Ok(tolerated)
}

/// `Ok` when the stream `existing` (or a KV bucket's stream) has no limit that drops or
/// refuses messages: no max age, message count or byte size. For a stream every
/// message of which is needed (a changelog); `object` names it in the error.
///
/// # Errors
/// [`BrokerError::LosesRecords`] naming the first such limit and the `nats` command
/// that removes it.
pub(crate) fn keeps_all(object: &str, existing: &StreamSpec) -> Result<(), BrokerError> {
    let refused = |field, value, flag: &str| BrokerError::LosesRecords {
        object: object.to_owned(),
        field,
        existing: value,
        fix: format!("nats stream edit {} {flag}", existing.name),
    };
    if let Some(age) = existing.max_age {
        return Err(refused("max_age", format!("{age:?}"), "--max-age=0"));
    }
    if let Some(n) = existing.max_msgs {
        return Err(refused("max_msgs", n.to_string(), "--max-msgs=-1"));
    }
    if let Some(n) = existing.max_bytes {
        return Err(refused("max_bytes", n.to_string(), "--max-bytes=-1"));
    }
    Ok(())
}

/// The partition numbers of an ordered stream's subjects (`<prefix>.0` to
/// `<prefix>.<n-1>`, as `topology::ordered_stream` lists them), with their prefix.
fn partition_subjects(subjects: &[String]) -> Option<(&str, Vec<u32>)> {
    let mut prefix = None;
    let mut partitions = Vec::with_capacity(subjects.len());
    for s in subjects {
        let (p, n) = s.rsplit_once('.')?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || prefix.is_some_and(|q| q != p) {
            return None;
        }
        prefix = Some(p);
        partitions.push(n.parse().ok()?);
    }
    partitions.sort_unstable();
    Some((prefix?, partitions))
}

/// Subjects must match, with one exception: an ordered stream created before streams
/// listed their partitions takes `<prefix>.*`, which reads the same partitions (it
/// also accepts records for partitions that do not exist, which `status` reports).
fn subjects(
    object: &str,
    existing: &[String],
    wanted: &[String],
    tolerated: &mut Vec<Tolerated>,
) -> Result<(), BrokerError> {
    let mut a = existing.to_vec();
    let mut b = wanted.to_vec();
    a.sort();
    b.sort();
    if a == b {
        return Ok(());
    }
    match (partition_subjects(&a), partition_subjects(&b)) {
        (_, Some((prefix, _))) if a.len() == 1 && a[0] == format!("{prefix}.*") => {
            tolerated.push(Tolerated {
                object: object.to_owned(),
                field: "subjects",
                existing: a[0].clone(),
                wanted: format!("{prefix}.0 to {prefix}.{}", b.len() - 1),
            });
            Ok(())
        }
        (Some((p, had)), Some((q, want))) if p == q => Err(BrokerError::ConfigMismatch {
            object: object.to_owned(),
            field: "partitions".into(),
            existing: had.len().to_string(),
            wanted: format!("{} (a key's partition depends on the count, so it is fixed at creation)", want.len()),
        }),
        _ => field(object, "subjects", &a, &b),
    }
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

/// `Ok` when the bucket's history and storage are the wanted ones, and its expiry where
/// Flotilla sets one (a TTL that leases and liveness depend on); with the differences
/// that are safe to keep.
///
/// # Errors
/// [`BrokerError::ConfigMismatch`] naming the first field that must not differ.
pub(crate) fn kv(existing: &KvSpec, wanted: &KvSpec) -> Result<Vec<Tolerated>, BrokerError> {
    let object = format!("KV bucket {}", wanted.bucket);
    let mut tolerated = Vec::new();
    field(&object, "history", &existing.history, &wanted.history)?;
    if wanted.keep_all
        && let Some(age) = existing.max_age
    {
        let mut stream = kv_stream(wanted);
        stream.max_age = Some(age);
        keeps_all(&object, &stream)?;
    }
    limit(&object, "max_age", &existing.max_age, &wanted.max_age, &mut tolerated)?;
    field(&object, "storage", &existing.storage, &wanted.storage)?;
    tolerated.extend(replicas(object, existing.replicas, wanted.replicas));
    Ok(tolerated)
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
    s.replicas = spec.replicas;
    s.keep_all = spec.keep_all;
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
    fn replicas_and_limits_an_operator_set_are_tolerated_the_rest_is_not() {
        let wanted = StreamSpec::new("S", vec!["s.*".into()], super::super::Retention::Limits).with_replicas(3);
        let mut existing = wanted.clone();
        existing.replicas = 1;
        existing.max_age = Some(std::time::Duration::from_secs(60));
        existing.max_bytes = Some(1 << 20);
        let notes = stream(&existing, &wanted).expect("safe differences");
        let fields: Vec<&str> = notes.iter().map(|n| n.field).collect();
        assert_eq!(fields, ["max_age", "max_bytes", "replicas"]);
        assert!(notes[2].is_fewer_replicas(), "R1 where R3 was asked is less safe: {notes:?}");
        let more = StreamSpec { replicas: 5, ..wanted.clone() };
        let notes = stream(&more, &wanted).expect("more replicas");
        assert!(!notes[0].is_fewer_replicas());
        // What Flotilla sets itself must match.
        let mut aged = wanted.clone();
        aged.max_age = Some(std::time::Duration::from_secs(10));
        let mut other_age = wanted.clone();
        other_age.max_age = Some(std::time::Duration::from_secs(20));
        assert!(stream(&other_age, &aged).is_err(), "a max age Flotilla sets is compared");
        let mut resubjected = wanted.clone();
        resubjected.subjects = vec!["t.*".into()];
        assert!(stream(&resubjected, &wanted).is_err());
        // An ordered stream's partitions: the old wildcard is kept, another count is not.
        let listed = |n: u32| (0..n).map(|p| format!("f.j.s.{p}")).collect::<Vec<_>>();
        let four = StreamSpec::new("S", listed(4), super::super::Retention::Limits);
        let old = StreamSpec::new("S", vec!["f.j.s.*".into()], super::super::Retention::Limits);
        let notes = stream(&old, &four).expect("the wildcard reads the same partitions");
        assert_eq!((notes[0].field, notes[0].wanted.as_str()), ("subjects", "f.j.s.0 to f.j.s.3"));
        let eight = StreamSpec::new("S", listed(8), super::super::Retention::Limits);
        let err = stream(&eight, &four).expect_err("another partition count").to_string();
        assert!(err.contains("partitions = 8") && err.contains("wants 4"), "{err}");
        let bucket = KvSpec::new("LEASES", Some(std::time::Duration::from_secs(6)));
        let other_ttl = KvSpec::new("LEASES", Some(std::time::Duration::from_secs(9)));
        assert!(kv(&other_ttl, &bucket).is_err(), "a lease TTL is never tolerated");
        let control = KvSpec::new("CONTROL", None);
        let aged_control = KvSpec::new("CONTROL", Some(std::time::Duration::from_secs(86_400))).with_replicas(3);
        assert_eq!(kv(&aged_control, &control).expect("tolerated").len(), 2);
    }

    #[test]
    fn a_changelog_refuses_every_limit_that_drops_or_refuses_records() {
        let hour = std::time::Duration::from_secs(3600);
        let state = KvSpec::new("FLOTILLA_j_STATE", None).keeping_all();
        // Elsewhere an operator's max age is kept; on a changelog it is refused.
        assert_eq!(
            kv(&KvSpec::new("FLOTILLA_j_STATE", Some(hour)), &KvSpec::new("FLOTILLA_j_STATE", None))
                .map(|t| t.len())
                .ok(),
            Some(1)
        );
        let err = kv(&KvSpec::new("FLOTILLA_j_STATE", Some(hour)), &state).expect_err("max age on a changelog");
        assert!(matches!(&err, BrokerError::LosesRecords { field, .. } if *field == "max_age"), "{err}");
        let text = err.to_string();
        for part in [
            "KV bucket FLOTILLA_j_STATE has max_age = 3600s",
            "silently rolls back",
            "`nats stream edit KV_FLOTILLA_j_STATE --max-age=0`",
        ] {
            assert!(text.contains(part), "{part:?} in {text}");
        }
        assert!(kv(&KvSpec::new("FLOTILLA_j_STATE", None).with_replicas(3), &state).is_ok(), "replicas may differ");
        // The bucket's stream: age, count and size limits are refused, replicas kept.
        let wanted = kv_stream(&state);
        assert!(wanted.keep_all);
        for (field, limited) in [
            ("max_age", StreamSpec { max_age: Some(hour), ..wanted.clone() }),
            ("max_msgs", StreamSpec { max_msgs: Some(1000), ..wanted.clone() }),
            ("max_bytes", StreamSpec { max_bytes: Some(1 << 20), ..wanted.clone() }),
        ] {
            let err = stream(&limited, &wanted).expect_err(field);
            assert!(matches!(&err, BrokerError::LosesRecords { field: f, .. } if *f == field), "{err}");
            assert!(err.to_string().contains("nats stream edit KV_FLOTILLA_j_STATE --max-"), "{err}");
        }
        assert_eq!(stream(&StreamSpec { replicas: 3, ..wanted.clone() }, &wanted).map(|t| t.len()).ok(), Some(1));
        // History and discard policy were never safe to differ.
        let history = StreamSpec { max_msgs_per_subject: Some(5), ..wanted.clone() };
        assert!(matches!(stream(&history, &wanted), Err(BrokerError::ConfigMismatch { .. })));
        let discard_old = StreamSpec { discard: super::super::Discard::Old, ..wanted.clone() };
        assert!(matches!(stream(&discard_old, &wanted), Err(BrokerError::ConfigMismatch { .. })));
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
