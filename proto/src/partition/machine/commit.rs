//! Commits with stores (DESIGN §5): the order in which a commit writes the state and
//! acknowledges the inputs, and the numbering of hooks at an input position.
//!
//! A commit acknowledges the committable positions as they were when it began. With
//! stores, it first waits for messages whose changes are applied but whose outputs are
//! not stored yet (so the state it writes is that of exactly the inputs it
//! acknowledges), then has the worker write what changed and the commit record at the
//! committable position ([`CommitPlan::Flush`]), and acknowledges only once that is
//! stored ([`StateStored`]). While it is on its way nothing starts: a retry would change
//! the state it writes ([`Partition::commit_in_progress`]).
//!
//! Hooks (`window`, timers, `shutdown`…) derive their outputs' ids from the input
//! position they ran at and how many hooks ran there before, so that a hook run again
//! at the same position on the same (restored) state sends the same ids, which the
//! broker drops. The count at the position is part of each commit record and comes
//! back with a restore.

use super::event::{Event, sealed};
use super::{Delivered, Partition};
use std::collections::BTreeMap;
use std::time::Instant;

/// What follows a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCommit {
    /// Go on processing.
    Drive,
    /// Every input saw a current drain marker: hand back what has not started, end
    /// drained.
    Drained,
    /// Every input ended: hand back what has not started, end.
    EndOfStream,
    /// A graceful stop: run `shutdown`.
    Shutdown,
}

/// How a commit goes on ([`CommitStarts`]).
#[derive(Debug, PartialEq, Eq)]
pub enum CommitPlan {
    /// Acknowledge these positions (report [`Committed`](super::event::Committed)),
    /// then do what follows.
    Ack(BTreeMap<u32, u64>, AfterCommit),
    /// Nothing to commit (the stores were never restored, so nothing ran): do what
    /// follows.
    Nothing(AfterCommit),
    /// Messages whose store changes are applied have to finish first: the commit
    /// comes back through [`Partition::resume_commit`].
    Wait,
    /// Take the stores' changes and write them with a commit record at stream
    /// sequence `position` counting `hooks` hooks run there, then report
    /// [`StateStored`] (or [`StateRefused`]). When nothing changed and `moved` is
    /// false, there is nothing to write: report [`StateStored`] at once.
    Flush {
        /// The stream sequence the commit record stands for.
        position: u64,
        /// Hooks run at that position, in the state written.
        hooks: u32,
        /// The position moved since the last commit record.
        moved: bool,
    },
}

/// Where a commit with stores stands.
#[derive(Debug, Default)]
pub(super) enum Phase {
    /// No commit on its way.
    #[default]
    Idle,
    /// It waits for applied messages to finish.
    Waiting(AfterCommit),
    /// Its state is being written with a commit record at stream sequence `at`; then
    /// `positions` are acknowledged.
    Writing { positions: BTreeMap<u32, u64>, at: u64, then: AfterCommit },
}

/// Tasks with stores: where their state stands.
#[derive(Debug, Default)]
pub(super) struct Stores {
    /// Restored: the changelog's last commit record is at this stream sequence.
    pub(super) stored_at: Option<u64>,
    /// Hooks run at an input position: (position, how many).
    pub(super) hooks_at: (u64, u32),
    pub(super) phase: Phase,
}

impl<M: Delivered> Partition<M> {
    /// Whether a commit of a task with stores is on its way (waiting for applied
    /// messages, or writing): nothing starts meanwhile.
    pub fn commit_in_progress(&self) -> bool {
        !matches!(self.stores.phase, Phase::Idle)
    }

    /// Whether the stores were restored (tasks with stores; nothing runs before).
    pub fn restored(&self) -> bool {
        self.stores.stored_at.is_some()
    }

    /// A commit that waited for applied messages goes on once none is left: what was
    /// to follow it, to start it again with [`CommitStarts`].
    pub fn resume_commit(&mut self) -> Option<AfterCommit> {
        if self.any_applied() {
            return None;
        }
        match std::mem::take(&mut self.stores.phase) {
            Phase::Waiting(then) => Some(then),
            other => {
                self.stores.phase = other;
                None
            }
        }
    }

    fn plan_commit(&mut self, then: AfterCommit) -> CommitPlan {
        let positions = self.state.committable().clone();
        if !self.durable {
            return CommitPlan::Ack(positions, then);
        }
        if self.any_applied() {
            self.stores.phase = Phase::Waiting(then);
            return CommitPlan::Wait;
        }
        let Some(stored_at) = self.stores.stored_at else { return CommitPlan::Nothing(then) };
        let position = self.committable_seq().unwrap_or(0).max(stored_at);
        let hooks = if self.stores.hooks_at.0 == position { self.stores.hooks_at.1 } else { 0 };
        self.stores.phase = Phase::Writing { positions, at: position, then };
        CommitPlan::Flush { position, hooks, moved: position != stored_at }
    }

    /// A hook starts: the number its outputs' ids take at the input position it runs
    /// at, with that position. `init` takes no number of its own (it runs after every
    /// restore, where the run before ran none): it takes one only once it changed the
    /// state ([`InitRan`]). `None` without stores (a restarted worker's hooks would
    /// then reuse ids of outputs that said something else).
    fn hook_started(&mut self, init: bool) -> Option<(u64, u32)> {
        if !self.durable {
            return None;
        }
        let position = self.applied_through;
        let n = if self.stores.hooks_at.0 == position { self.stores.hooks_at.1 } else { 0 };
        if !init {
            self.stores.hooks_at = (position, n + 1);
        }
        Some((position, n))
    }
}

/// A commit begins (the commit hook ran, a drain or the end of the stream, a stop):
/// answers how it goes on.
#[derive(Debug)]
pub struct CommitStarts(pub AfterCommit);

/// The state a [`CommitPlan::Flush`] wrote is stored (or there was nothing to write):
/// answers the positions to acknowledge and what follows.
#[derive(Debug)]
pub struct StateStored;

/// The state could not be stored (someone else wrote the changelog, or the broker
/// failed for good): the commit being written is over, acknowledging nothing. (A
/// commit that waits for applied messages is not one being written: it stays.)
#[derive(Debug)]
pub struct StateRefused;

/// The stores were restored to the commit record at stream sequence `position`,
/// which counted `hooks` hooks run there.
#[derive(Debug)]
pub struct Restored {
    /// The record's input position.
    pub position: u64,
    /// Hooks run at that position.
    pub hooks: u32,
}

/// A hook starts (`init` or another). Answers the number its outputs' ids take and
/// the position it runs at, `None` without stores.
#[derive(Debug)]
pub struct HookStarted {
    /// It is `init`.
    pub init: bool,
}

/// `init` ran and its outputs are stored; `changed_state` when it changed the stores
/// (then it counts as a hook run at its position).
#[derive(Debug)]
pub struct InitRan {
    /// It changed the stores.
    pub changed_state: bool,
}

impl sealed::Sealed for CommitStarts {}
impl<M: Delivered> Event<M> for CommitStarts {
    type Reply = CommitPlan;
    fn apply(self, p: &mut Partition<M>, _now: Instant) -> CommitPlan {
        p.plan_commit(self.0)
    }
}

impl sealed::Sealed for StateStored {}
impl<M: Delivered> Event<M> for StateStored {
    type Reply = Option<(BTreeMap<u32, u64>, AfterCommit)>;
    fn apply(self, p: &mut Partition<M>, _now: Instant) -> Self::Reply {
        if !matches!(p.stores.phase, Phase::Writing { .. }) {
            return None;
        }
        let Phase::Writing { positions, at, then } = std::mem::take(&mut p.stores.phase) else { return None };
        p.stores.stored_at = Some(at);
        Some((positions, then))
    }
}

impl sealed::Sealed for StateRefused {}
impl<M: Delivered> Event<M> for StateRefused {
    type Reply = ();
    fn apply(self, p: &mut Partition<M>, _now: Instant) {
        if matches!(p.stores.phase, Phase::Writing { .. }) {
            p.stores.phase = Phase::Idle;
        }
    }
}

impl sealed::Sealed for Restored {}
impl<M: Delivered> Event<M> for Restored {
    type Reply = ();
    fn apply(self, p: &mut Partition<M>, _now: Instant) {
        p.applied_through = self.position;
        p.stores.stored_at = Some(self.position);
        p.stores.hooks_at = (self.position, self.hooks);
    }
}

impl sealed::Sealed for HookStarted {}
impl<M: Delivered> Event<M> for HookStarted {
    type Reply = Option<(u64, u32)>;
    fn apply(self, p: &mut Partition<M>, _now: Instant) -> Self::Reply {
        p.hook_started(self.init)
    }
}

impl sealed::Sealed for InitRan {}
impl<M: Delivered> Event<M> for InitRan {
    type Reply = ();
    fn apply(self, p: &mut Partition<M>, _now: Instant) {
        if self.changed_state && p.stores.hooks_at.0 == p.applied_through {
            p.stores.hooks_at.1 += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::event as ev;
    use super::super::tests::{acks, complete, config, deliver_and_begin, effects, partition};
    use super::*;
    use crate::partition::AckKind;
    use crate::partition::intake::Discipline;

    #[test]
    fn without_stores_a_commit_acknowledges_the_committable_positions_at_once() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 4);
        let orders = deliver_and_begin(&mut p, &[1, 2], now);
        complete(&mut p, orders[0], now);
        match p.handle(CommitStarts(AfterCommit::Drive), now) {
            CommitPlan::Ack(positions, AfterCommit::Drive) => assert_eq!(positions.get(&0), Some(&orders[0])),
            other => panic!("expected an ack, got {other:?}"),
        }
        assert!(!p.commit_in_progress());
    }

    #[test]
    fn with_stores_nothing_is_committed_before_the_restore() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 4);
        p.set_durable(true);
        assert_eq!(p.handle(CommitStarts(AfterCommit::Shutdown), now), CommitPlan::Nothing(AfterCommit::Shutdown));
        assert!(!p.restored());
    }

    #[test]
    fn with_stores_a_commit_waits_for_applied_messages_then_writes_then_acknowledges() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 4);
        p.set_durable(true);
        p.handle(Restored { position: 0, hooks: 0 }, now);
        let orders = deliver_and_begin(&mut p, &[1, 2, 3], now);
        complete(&mut p, orders[0], now);
        // The second returned (its changes are applied) but its outputs are on their way.
        p.handle(ev::ReturnedOk(orders[1]), now);
        assert_eq!(p.handle(CommitStarts(AfterCommit::Drive), now), CommitPlan::Wait);
        assert!(p.commit_in_progress(), "nothing starts while a commit waits");
        assert_eq!(p.resume_commit(), None, "not while one is applied");
        p.handle(ev::CallbacksDone(orders[1]), now);
        p.handle(ev::EffectsStored(orders[1]), now);
        assert_eq!(p.resume_commit(), Some(AfterCommit::Drive));
        // It writes the state of exactly the two finished inputs, at the second's sequence.
        assert_eq!(
            p.handle(CommitStarts(AfterCommit::Drive), now),
            CommitPlan::Flush { position: 2, hooks: 0, moved: true }
        );
        assert!(p.commit_in_progress());
        effects(&mut p);
        let (positions, then) = p.handle(StateStored, now).expect("a commit was writing");
        assert_eq!(then, AfterCommit::Drive);
        assert!(acks(&effects(&mut p)).is_empty(), "nothing is acknowledged before the worker commits the positions");
        assert_eq!(p.handle(ev::Committed(positions), now), 2);
        assert_eq!(acks(&effects(&mut p)), vec![(2, AckKind::Ack)], "one ack-all of the last covered");
        assert!(!p.commit_in_progress());
        // Nothing new finished: the next commit has nothing to move.
        assert_eq!(
            p.handle(CommitStarts(AfterCommit::Shutdown), now),
            CommitPlan::Flush { position: 2, hooks: 0, moved: false }
        );
        p.handle(StateRefused, now);
        assert!(!p.commit_in_progress(), "a refused write ends the commit");
        assert_eq!(p.handle(StateStored, now), None, "and nothing is acknowledged for it");
        // A commit that waits is not cancelled by a late answer to a write.
        let orders = deliver_and_begin(&mut p, &[4], now);
        p.handle(ev::ReturnedOk(orders[0]), now);
        assert_eq!(p.handle(CommitStarts(AfterCommit::Drained), now), CommitPlan::Wait);
        assert_eq!(p.handle(StateStored, now), None);
        p.handle(StateRefused, now);
        assert!(p.commit_in_progress(), "still waiting");
        p.handle(ev::CallbacksDone(orders[0]), now);
        p.handle(ev::EffectsStored(orders[0]), now);
        assert_eq!(p.resume_commit(), Some(AfterCommit::Drained), "what follows it is kept");
    }

    #[test]
    fn hooks_are_numbered_at_their_position_and_init_only_once_it_changed_state() {
        let now = Instant::now();
        let mut p = partition(config(Discipline::Ordered), 4);
        assert_eq!(p.handle(HookStarted { init: false }, now), None, "no numbers without stores");
        p.set_durable(true);
        p.handle(Restored { position: 7, hooks: 2 }, now);
        assert_eq!(p.handle(HookStarted { init: true }, now), Some((7, 2)), "init takes the next number");
        assert_eq!(p.handle(HookStarted { init: false }, now), Some((7, 2)), "and does not keep it");
        assert_eq!(p.handle(HookStarted { init: false }, now), Some((7, 3)));
        p.handle(InitRan { changed_state: true }, now);
        assert_eq!(p.handle(HookStarted { init: false }, now), Some((7, 5)), "an init that changed state counts");
        // A hook at a later position starts again from 0, and the commit record counts it.
        let orders = deliver_and_begin(&mut p, &[8], now);
        complete(&mut p, orders[0], now);
        assert_eq!(p.handle(HookStarted { init: false }, now), Some((8, 0)));
        assert_eq!(
            p.handle(CommitStarts(AfterCommit::Drive), now),
            CommitPlan::Flush { position: 8, hooks: 1, moved: true }
        );
    }
}
