//! When a partition is done in a run, and when the run is over: one rule for the
//! drain's wait (`flotilla drain`), the nodes' leave, which partitions a node still
//! acquires, `status`, and a joining node's look at the current run.
//!
//! A partition is done in run R once its `ended.<stream>.<p>` record names R (it
//! reached its end of stream, or its task asked to shut down), or once its
//! `drained.<stream>.<p>` record names R while a drain of R is asked (a drained
//! record of a cancelled drain no longer counts). The run is over once every ordered
//! partition of the job is done in it.

use super::control::{DrainedRecord, EndedRecord};

/// What a partition's drained and ended records say about one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PartitionEnd {
    /// It processed the run's drain marker.
    pub drained: bool,
    /// It reached its end of stream in the run (or its task asked to shut down).
    pub ended: bool,
}

impl PartitionEnd {
    /// From the partition's records (`None`: missing or undecodable), for run `run`.
    pub fn of(drained: Option<&DrainedRecord>, ended: Option<&EndedRecord>, run: &str) -> Self {
        Self { drained: drained.is_some_and(|r| r.run_id == run), ended: ended.is_some_and(|r| r.run_id == run) }
    }

    /// Whether the partition is done in the run: ended, or drained while a drain of the
    /// run is asked.
    pub fn done(self, drain_asked: bool) -> bool {
        self.ended || (self.drained && drain_asked)
    }
}

/// Whether the run is over: the job has partitions and every one is done in it.
pub fn run_over(ends: impl IntoIterator<Item = PartitionEnd>, drain_asked: bool) -> bool {
    let mut any = false;
    for end in ends {
        if !end.done(drain_asked) {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(run: &str) -> DrainedRecord {
        DrainedRecord { run_id: run.into(), node: "a".into() }
    }

    #[test]
    fn only_records_of_the_run_count() {
        let old = rec("r1");
        let cur = rec("r2");
        assert_eq!(PartitionEnd::of(Some(&old), Some(&old), "r2"), PartitionEnd::default());
        assert_eq!(PartitionEnd::of(Some(&cur), None, "r2"), PartitionEnd { drained: true, ended: false });
        assert_eq!(PartitionEnd::of(None, Some(&cur), "r2"), PartitionEnd { drained: false, ended: true });
    }

    #[test]
    fn a_drained_partition_is_done_only_while_the_drain_is_asked() {
        let drained = PartitionEnd { drained: true, ended: false };
        assert!(drained.done(true));
        assert!(!drained.done(false), "a cancelled drain's records no longer count");
        let ended = PartitionEnd { drained: false, ended: true };
        assert!(ended.done(false) && ended.done(true), "an end of stream always counts");
    }

    #[test]
    fn a_run_is_over_once_every_partition_is_done_and_never_without_partitions() {
        let drained = PartitionEnd { drained: true, ended: false };
        let ended = PartitionEnd { drained: false, ended: true };
        assert!(run_over([drained, ended], true));
        assert!(!run_over([drained, ended], false));
        assert!(run_over([ended, ended], false));
        assert!(!run_over([ended, PartitionEnd::default()], true));
        assert!(!run_over([], true), "a job without ordered partitions never ends by its records");
    }
}
