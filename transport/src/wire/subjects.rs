//! Subjects and JetStream object names of a job.
//!
//! | what | subject | JetStream object |
//! |---|---|---|
//! | ordered input, partition `p` | `flotilla.<job>.<stream>.<p>` | stream `FLOTILLA_<job>_<stream>`, consumer `<stream>-p<p>` |
//! | queue input | `flotilla.<job>.<stream>` | stream `FLOTILLA_<job>_<stream>`, consumer `<stream>-workers` |
//! | dead letters | `flotilla.<job>._dlq.<stream>` | stream `FLOTILLA_<job>_DLQ` |
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
