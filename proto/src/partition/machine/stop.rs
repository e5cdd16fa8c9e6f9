//! How a worker ends: a graceful stop (hand back what has not started and what waits
//! out a back-off, finish what runs, commit, run `shutdown`), a stop after a lost
//! delivery (the same, then the partition is reset), and the end itself.
//!
//! A stop commits only what it may: once a message was handed back mid-retry, the
//! store changes of messages that finished after it cannot be committed apart from it
//! (the next owner would apply them twice), so the stop ends without a commit and the
//! next owner restores the last one ([`StopStep::EndWithoutCommit`]).

use super::event::{Event, sealed};
use super::{Delivered, Partition};
use std::time::Instant;

/// Where the worker is in its life.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Life {
    #[default]
    Running,
    Stopping,
    Ended,
}

/// What a stopping worker knows that the machine does not ([`Partition::stop_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopFacts {
    /// The task is home (no callback or hook has it checked out).
    pub task_home: bool,
    /// Outputs (of a message or a hook) are still on their way: a stop runs no
    /// half-done window, so the commit waits for them.
    pub outputs_in_flight: bool,
    /// The stores hold changes not committed yet (a hook changed them).
    pub stores_changed: bool,
}

/// What a stopping worker does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopStep {
    /// Something still runs, or a commit is on its way: wait.
    Wait,
    /// Messages finished after one handed back mid-retry: hand everything back and end
    /// without a commit.
    EndWithoutCommit,
    /// Commit, then run `shutdown`.
    Commit,
    /// Nothing to commit: run `shutdown`.
    Shutdown,
}

impl<M: Delivered> Partition<M> {
    /// A graceful stop was asked for (and not yet over).
    pub fn stopping(&self) -> bool {
        self.life == Life::Stopping
    }

    /// The worker ended: nothing more is started, acknowledged or handed back here.
    pub fn ended(&self) -> bool {
        self.life == Life::Ended
    }

    /// Why the stop resets the partition: a delivery was lost.
    pub fn resync(&self) -> Option<&str> {
        self.resync.as_deref()
    }

    /// While stopping, once no retry is due: what to do next.
    pub fn stop_step(&self, facts: StopFacts) -> StopStep {
        if self.life != Life::Stopping
            || !facts.task_home
            || !self.held.is_empty()
            || facts.outputs_in_flight
            || self.commit_in_progress()
        {
            return StopStep::Wait;
        }
        if self.commit_blocked_by_hand_back() {
            return StopStep::EndWithoutCommit;
        }
        if self.state.uncommitted() || facts.stores_changed { StopStep::Commit } else { StopStep::Shutdown }
    }

    fn begin_stop(&mut self) -> Option<usize> {
        if self.life != Life::Running {
            return None;
        }
        self.life = Life::Stopping;
        // Interrupted is not failed: what has not started goes back at once, and so
        // does what waits out a retry back-off.
        self.hand_back_unstarted();
        Some(self.hand_back_backing_off())
    }
}

/// A graceful stop begins. Answers how many messages waiting out a back-off were
/// handed back, `None` when the worker was stopping or had ended already.
#[derive(Debug)]
pub struct StopAsked;

/// A delivery was lost (a gap in the consumer's delivery sequence): nothing after it
/// is taken, what came before is finished and committed, and the stop that follows
/// ([`StopAsked`]) ends asking for a reset ([`Partition::resync`]). Answers whether
/// this is news (no loss was reported before and the worker has not ended).
#[derive(Debug)]
pub struct DeliveryLost(pub String);

/// The worker ends (drained, ended, stopped, failed, fenced): nothing more runs.
#[derive(Debug)]
pub struct Ended;

impl sealed::Sealed for StopAsked {}
impl<M: Delivered> Event<M> for StopAsked {
    type Reply = Option<usize>;
    fn apply(self, p: &mut Partition<M>, _now: Instant) -> Option<usize> {
        p.begin_stop()
    }
}

impl sealed::Sealed for DeliveryLost {}
impl<M: Delivered> Event<M> for DeliveryLost {
    type Reply = bool;
    fn apply(self, p: &mut Partition<M>, _now: Instant) -> bool {
        if p.resync.is_some() || p.life == Life::Ended {
            return false;
        }
        p.resync = Some(self.0);
        true
    }
}

impl sealed::Sealed for Ended {}
impl<M: Delivered> Event<M> for Ended {
    type Reply = ();
    fn apply(self, p: &mut Partition<M>, _now: Instant) {
        p.life = Life::Ended;
        p.state.mark_complete();
    }
}

#[cfg(test)]
mod tests {
    use super::super::event as ev;
    use super::super::tests::{Msg, complete, config, deliver_and_begin, effects, partition};
    use super::super::{CommitPlan, Effect};
    use super::*;
    use crate::partition::intake::Discipline;

    const IDLE: StopFacts = StopFacts { task_home: true, outputs_in_flight: false, stores_changed: false };

    #[test]
    fn a_stop_hands_back_what_has_not_started_and_waits_for_what_runs() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 1);
        let orders = deliver_and_begin(&mut p, &[1], now);
        p.handle(ev::Arrived { kind: crate::partition::EnvelopeKind::Data, msg: Msg { seq: 2, delivered: 1 } }, now);
        assert_eq!(p.stop_step(IDLE), StopStep::Wait, "not stopping");
        assert_eq!(p.handle(StopAsked, now), Some(0));
        assert_eq!(p.handle(StopAsked, now), None, "once");
        assert!(p.stopping());
        let handed: Vec<u64> = effects(&mut p)
            .iter()
            .filter_map(|e| if let Effect::HandBack { msg, .. } = e { Some(msg.seq) } else { None })
            .collect();
        assert_eq!(handed, vec![2], "the one not started goes back");
        assert_eq!(p.stop_step(IDLE), StopStep::Wait, "the first still runs");
        complete(&mut p, orders[0], now);
        assert_eq!(p.stop_step(StopFacts { outputs_in_flight: true, ..IDLE }), StopStep::Wait, "a hook's outputs");
        assert_eq!(p.stop_step(StopFacts { task_home: false, ..IDLE }), StopStep::Wait);
        assert_eq!(p.stop_step(IDLE), StopStep::Commit, "what finished is committed before shutdown");
        let CommitPlan::Ack(positions, _) = p.handle(ev::CommitStarts(super::super::AfterCommit::Shutdown), now) else {
            panic!("no stores: an ack");
        };
        p.handle(ev::Committed(positions), now);
        assert_eq!(p.stop_step(IDLE), StopStep::Shutdown);
        assert_eq!(p.stop_step(StopFacts { stores_changed: true, ..IDLE }), StopStep::Commit);
        p.handle(Ended, now);
        assert!(p.ended() && !p.stopping());
        assert_eq!(p.stop_step(IDLE), StopStep::Wait, "an ended worker does nothing");
        assert_eq!(p.handle(StopAsked, now), None);
    }

    #[test]
    fn a_stop_waits_for_a_commit_on_its_way() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 2);
        p.set_durable(true);
        p.handle(ev::Restored { position: 0, hooks: 0 }, now);
        let orders = deliver_and_begin(&mut p, &[1], now);
        complete(&mut p, orders[0], now);
        p.handle(StopAsked, now);
        assert_eq!(p.stop_step(IDLE), StopStep::Commit);
        assert!(matches!(
            p.handle(ev::CommitStarts(super::super::AfterCommit::Shutdown), now),
            CommitPlan::Flush { .. }
        ));
        assert_eq!(p.stop_step(IDLE), StopStep::Wait, "the state is being written");
        p.handle(ev::StateStored, now);
        assert_eq!(p.stop_step(IDLE), StopStep::Commit, "its positions are not acknowledged yet");
    }

    #[test]
    fn a_lost_delivery_is_recorded_once_for_the_stop_to_ask_for_a_reset() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 2);
        assert!(p.handle(DeliveryLost("gap".into()), now));
        assert_eq!(p.resync(), Some("gap"));
        assert_eq!(p.handle(StopAsked, now), Some(0));
        assert!(!p.handle(DeliveryLost("again".into()), now));
        assert_eq!(p.resync(), Some("gap"), "the first reason stays");
        p.handle(Ended, now);
        let mut q = partition(config(Discipline::Ordered), 2);
        q.handle(Ended, now);
        assert!(!q.handle(DeliveryLost("late".into()), now), "an ended worker takes no loss");
        assert_eq!(q.resync(), None);
    }
}
