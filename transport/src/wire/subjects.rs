//! Subjects and JetStream object names of a job.
//!
//! | what | subject | JetStream object |
//! |---|---|---|
//! | ordered input, partition `p` | `flotilla.<job>.<stream>.<p>` | stream `FLOTILLA_<job>_<stream>`, consumer `<stream>-p<p>` |
//! | queue input | `flotilla.<job>.<stream>` | stream `FLOTILLA_<job>_<stream>`, consumer `<stream>-workers` |
//! | dead letters | `flotilla.<job>._dlq.<stream>` (`_dlq._timers` for broken timers) | stream `FLOTILLA_<job>_DLQ` |
//! | timers | `flotilla.<job>._timer.<id>` | stream `FLOTILLA_<job>_TIMERS` |
//! | control | `flotilla.<job>._ctl.<…>` | core NATS request/reply |
//! | events | `flotilla.<job>._evt.<type>` | core NATS |
//! | KV buckets | `$KV.FLOTILLA_<job>_<BUCKET>.<key>` | stream `KV_FLOTILLA_<job>_<BUCKET>` |
//!
//! Job and stream names follow [`NAME_RULE`](super::names::NAME_RULE), so a user stream
//! can never collide with the `_`-prefixed subjects Flotilla reserves.

use super::names::{JobName, StreamName};

/// Builds the subjects and object names of one job.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subjects {
    job: JobName,
}

impl Subjects {
    /// The subjects of `job`.
    pub fn new(job: JobName) -> Self {
        Self { job }
    }

    /// The job's name.
    pub fn job(&self) -> &JobName {
        &self.job
    }

    /// `flotilla.<job>.<stream>.<partition>`: where producers publish into an ordered stream.
    pub fn ordered_partition(&self, stream: &StreamName, partition: u32) -> String {
        format!("flotilla.{}.{}.{}", self.job, stream, partition)
    }

    /// `flotilla.<job>.<stream>.*`: every partition of an ordered stream.
    pub fn ordered_all(&self, stream: &StreamName) -> String {
        format!("flotilla.{}.{}.*", self.job, stream)
    }

    /// `flotilla.<job>.<stream>`: where producers publish into a queue stream.
    pub fn queue(&self, stream: &StreamName) -> String {
        format!("flotilla.{}.{}", self.job, stream)
    }

    /// `flotilla.<job>._dlq.<stream>`: dead letters of one input stream.
    pub fn dlq(&self, stream: &StreamName) -> String {
        format!("flotilla.{}._dlq.{}", self.job, stream)
    }

    /// `flotilla.<job>._dlq._timers`: dead letters of the timer stream (a delayed
    /// message whose target or delay is unusable).
    pub fn dlq_timers(&self) -> String {
        format!("flotilla.{}._dlq._timers", self.job)
    }

    /// What is wrong with `subject` as the target of a delayed message, if anything: a
    /// target must be a data subject of this job, `flotilla.<job>.<stream>` (queue) or
    /// `flotilla.<job>.<stream>.<partition>` (ordered), with a valid stream name. So a
    /// timer can never publish to another job, to Flotilla's reserved `_` subjects
    /// (control, timers, dead letters) or to the JetStream API.
    pub fn data_target_problem(&self, subject: &str) -> Option<String> {
        let prefix = format!("flotilla.{}.", self.job);
        let Some(rest) = subject.strip_prefix(&prefix) else {
            return Some(format!("{subject:?} is not a subject of job {} (it must start with {prefix:?})", self.job));
        };
        let (stream, partition) = match rest.split_once('.') {
            Some((stream, partition)) => (stream, Some(partition)),
            None => (rest, None),
        };
        if let Err(e) = StreamName::new(stream) {
            return Some(format!("{subject:?} does not name a data stream: {e}"));
        }
        match partition {
            Some(p) if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) || p.parse::<u32>().is_err() => {
                Some(format!("{subject:?} does not end in a partition number"))
            }
            _ => None,
        }
    }

    /// `flotilla.<job>._parked.<stream>`: messages of parked keys of a queue input.
    pub fn parked(&self, stream: &StreamName) -> String {
        format!("flotilla.{}._parked.{}", self.job, stream)
    }

    /// `flotilla.<job>._parked.>`: every parked message of the job.
    pub fn parked_all(&self) -> String {
        format!("flotilla.{}._parked.>", self.job)
    }

    /// `FLOTILLA_<job>_PARKED`: the job's stream of parked messages.
    pub fn parked_stream_name(&self) -> String {
        format!("FLOTILLA_{}_PARKED", self.job)
    }

    /// `flotilla.<job>._dlq.>`: all dead letters of the job.
    pub fn dlq_all(&self) -> String {
        format!("flotilla.{}._dlq.>", self.job)
    }

    /// `flotilla.<job>._timer.<id>`: one durable timer (re-arming replaces it).
    pub fn timer(&self, id: &str) -> String {
        format!("flotilla.{}._timer.{}", self.job, id)
    }

    /// `flotilla.<job>._timer.>`: all timers of the job.
    pub fn timer_all(&self) -> String {
        format!("flotilla.{}._timer.>", self.job)
    }

    /// `flotilla.<job>._ctl.<rest>`: a control-plane subject.
    pub fn control(&self, rest: &str) -> String {
        format!("flotilla.{}._ctl.{}", self.job, rest)
    }

    /// `flotilla.<job>._evt.<event_type>`: where typed runtime events are published.
    pub fn event(&self, event_type: &str) -> String {
        format!("flotilla.{}._evt.{}", self.job, event_type)
    }

    /// `FLOTILLA_<job>_<stream>`: the JetStream stream holding an input stream.
    pub fn stream_name(&self, stream: &StreamName) -> String {
        format!("FLOTILLA_{}_{}", self.job, stream)
    }

    /// `FLOTILLA_<job>_DLQ`: the job's dead-letter stream.
    pub fn dlq_stream_name(&self) -> String {
        format!("FLOTILLA_{}_DLQ", self.job)
    }

    /// `FLOTILLA_<job>_TIMERS`: the job's timer stream.
    pub fn timer_stream_name(&self) -> String {
        format!("FLOTILLA_{}_TIMERS", self.job)
    }

    /// `FLOTILLA_<job>_<BUCKET>`: a KV bucket of the job (`NODES`, `LEASES`, `STATE`).
    pub fn bucket_name(&self, bucket: &str) -> String {
        format!("FLOTILLA_{}_{}", self.job, bucket)
    }

    /// `<stream>-p<partition>`: the durable consumer of one ordered partition.
    pub fn partition_consumer(stream: &StreamName, partition: u32) -> String {
        format!("{stream}-p{partition}")
    }

    /// `<stream>-workers`: the shared durable consumer of a queue stream.
    pub fn queue_consumer(stream: &StreamName) -> String {
        format!("{stream}-workers")
    }

    /// `$KV.<bucket>.<key>`: the subject a write of `key` in the KV bucket named
    /// `bucket` (a full name, as [`bucket_name`](Self::bucket_name) makes it) goes to,
    /// so a put can be published with other messages.
    pub fn kv_subject(bucket: &str, key: &str) -> String {
        format!("{}{key}", Self::kv_prefix(bucket))
    }

    /// `$KV.<bucket>.`: what every key subject of the KV bucket named `bucket` starts with.
    pub fn kv_prefix(bucket: &str) -> String {
        format!("$KV.{bucket}.")
    }

    /// The key a subject of the KV bucket named `bucket` writes, or `None` when the
    /// subject is not one of the bucket's ([`kv_subject`](Self::kv_subject) undone).
    pub fn kv_key<'a>(bucket: &str, subject: &'a str) -> Option<&'a str> {
        subject.strip_prefix("$KV.")?.strip_prefix(bucket)?.strip_prefix('.')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_subjects_round_trip() {
        let s = Subjects::kv_subject("FLOTILLA_j_STATE", "in.3.c");
        assert_eq!(s, "$KV.FLOTILLA_j_STATE.in.3.c");
        assert!(s.starts_with(&Subjects::kv_prefix("FLOTILLA_j_STATE")));
        assert_eq!(Subjects::kv_key("FLOTILLA_j_STATE", &s), Some("in.3.c"));
        assert_eq!(Subjects::kv_key("FLOTILLA_j_STAT", &s), None);
        assert_eq!(Subjects::kv_key("FLOTILLA_j_STATE", "flotilla.j.in.3"), None);
    }

    #[test]
    fn subjects_follow_the_contract() {
        let s = Subjects::new(JobName::new("relay").expect("job"));
        let input = StreamName::new("relay-in").expect("stream");
        assert_eq!(s.ordered_partition(&input, 3), "flotilla.relay.relay-in.3");
        assert_eq!(s.ordered_all(&input), "flotilla.relay.relay-in.*");
        assert_eq!(s.queue(&input), "flotilla.relay.relay-in");
        assert_eq!(s.dlq(&input), "flotilla.relay._dlq.relay-in");
        assert_eq!(s.timer("t1"), "flotilla.relay._timer.t1");
        assert_eq!(s.control("drain"), "flotilla.relay._ctl.drain");
        assert_eq!(s.event("degraded"), "flotilla.relay._evt.degraded");
        assert_eq!(s.stream_name(&input), "FLOTILLA_relay_relay-in");
        assert_eq!(s.dlq_stream_name(), "FLOTILLA_relay_DLQ");
        assert_eq!(s.bucket_name("LEASES"), "FLOTILLA_relay_LEASES");
        assert_eq!(Subjects::partition_consumer(&input, 7), "relay-in-p7");
        assert_eq!(Subjects::queue_consumer(&input), "relay-in-workers");
        assert_eq!(s.dlq_timers(), "flotilla.relay._dlq._timers");
    }

    #[test]
    fn delayed_messages_may_target_only_the_job_s_data_subjects() {
        let s = Subjects::new(JobName::new("relay").expect("job"));
        for ok in ["flotilla.relay.relay-out.3", "flotilla.relay.jobs", "flotilla.relay.a.0"] {
            assert_eq!(s.data_target_problem(ok), None, "{ok}");
        }
        for bad in [
            "$JS.API.STREAM.DELETE.FLOTILLA_relay_relay-in",
            "flotilla.relay._ctl.all.shutdown",
            "flotilla.relay._timer.x",
            "flotilla.relay._dlq.relay-in",
            "flotilla.other.relay-out.1",
            "flotilla.relay.relay-out.x",
            "flotilla.relay.relay-out.1.2",
            "flotilla.relay.relay-out.",
            "flotilla.relay.relay-out.99999999999",
            "flotilla.relay.",
            "flotilla.relay.Upper",
            "flotilla.relay.a.>",
        ] {
            assert!(s.data_target_problem(bad).is_some(), "{bad} was accepted");
        }
    }
}
