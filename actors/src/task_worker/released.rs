//! Interrupted is not failed, for queue inputs. JetStream counts every delivery, and a
//! queue message handed back (a stop, a drain deadline, a back-off cut short) comes
//! again as one more delivery. So before handing one back the worker counts the
//! release in the job's `RELEASED` bucket (key `<stream>.<seq>`), and a redelivered
//! message's attempt is its deliveries less its releases (the machine's rule,
//! [`attempt_after_releases`](flotilla_proto::partition::machine::attempt_after_releases)).
//! The count is written before the nak, so whoever gets the message next reads it.

use flotilla_transport::broker::{BrokerError, SharedBroker};

pub use flotilla_proto::partition::intake::RELEASE_ALLOWANCE;

/// The bucket of release counts, `FLOTILLA_<job>_RELEASED` (kept 7 days).
pub const RELEASED: &str = "RELEASED";

/// How long a release count is kept: a message waiting longer than this in its queue
/// counts its releases as attempts again.
pub const RELEASED_TTL: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// The key of the message at `seq` of queue input `stream`.
pub(crate) fn key(stream: &str, seq: u64) -> String {
    format!("{stream}.{seq}")
}

/// Adds one release to the count at `key`.
/// The count is a decimal number, which is its JSON too.
pub(crate) async fn record(broker: &SharedBroker, bucket: &str, key: &str) -> Result<u64, BrokerError> {
    let count = flotilla_transport::kv::TypedKey::<u64>::new(broker.clone(), bucket, key).with_tries(5);
    Ok(count
        .modify(|n| {
            let n = n.unwrap_or(0) + 1;
            flotilla_transport::kv::Edit::Write(n, n)
        })
        .await?)
}

/// The releases counted at `key` (0 when none, or when the bucket does not exist).
pub(crate) async fn count(broker: &SharedBroker, bucket: &str, key: &str) -> Result<u64, BrokerError> {
    match broker.kv_get(bucket, key).await {
        Ok(entry) => Ok(entry.and_then(|e| std::str::from_utf8(&e.value).ok()?.parse::<u64>().ok()).unwrap_or(0)),
        Err(BrokerError::BucketNotFound { .. } | BrokerError::StreamNotFound { .. }) => Ok(0),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[actix_rt::test]
    async fn counts_add_up_and_a_missing_bucket_counts_none() {
        let b = flotilla_transport::EmbeddedBroker::new().shared();
        assert_eq!(count(&b, "FLOTILLA_t_RELEASED", "jobs.7").await.expect("no bucket"), 0);
        b.ensure_kv(flotilla_transport::broker::KvSpec::new("FLOTILLA_t_RELEASED", None)).await.expect("bucket");
        assert_eq!(record(&b, "FLOTILLA_t_RELEASED", "jobs.7").await.expect("one"), 1);
        assert_eq!(record(&b, "FLOTILLA_t_RELEASED", "jobs.7").await.expect("two"), 2);
        assert_eq!(count(&b, "FLOTILLA_t_RELEASED", "jobs.7").await.expect("read"), 2);
    }
}
