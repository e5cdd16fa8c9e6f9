//! What the worker tells the partition machine: one type per event, each with the
//! answer it gets, handed in with the time through [`Partition::handle`].
//!
//! Events are values (they print with `Debug`), so a driver that records what it fed
//! the machine, as a simulator does, has the whole input; what the machine decided
//! comes out of [`Partition::poll_effect`], [`Partition::next`] and
//! [`Partition::poll_timeout`]. Each event is a struct rather than a variant of one
//! enum so that its answer is typed (a start answers whether it runs, a dead letter
//! stored answers what finished) and so that the hot path builds nothing it does not
//! use.

pub use super::commit::{CommitStarts, HookStarted, InitRan, Restored, StateRefused, StateStored};
pub use super::pull::{ClaimFailed, ClaimReturned};
pub use super::route::{ReleasesCounted, SuspectJudged};
pub use super::stop::{DeliveryLost, Ended, StopAsked};
use super::{Delivered, Finished, Held, Partition};
use crate::partition::intake::{Admission, AfterFailure};
use crate::partition::readiness::EnvelopeKind;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub(super) mod sealed {
    pub trait Sealed {}
}

/// An event the partition machine handles ([`Partition::handle`]).
pub trait Event<M: Delivered>: sealed::Sealed {
    /// What the machine answers.
    type Reply;
    /// Applies the event at `now`.
    fn apply(self, part: &mut Partition<M>, now: Instant) -> Self::Reply;
}

impl<M: Delivered> Partition<M> {
    /// Handles `event` at `now` and answers it; the effects it decided wait in
    /// [`poll_effect`](Self::poll_effect).
    #[inline]
    pub fn handle<E: Event<M>>(&mut self, event: E, now: Instant) -> E::Reply {
        event.apply(self, now)
    }
}

/// A delivery of an ordered partition came: whether to take it (a redelivery is
/// dropped, a gap in the consumer's deliveries means one was lost).
#[derive(Debug)]
pub struct Offered {
    /// Its position in the stream.
    pub stream_seq: u64,
    /// Its delivery sequence on the partition's consumer.
    pub consumer_seq: u64,
}

/// Deliveries dropped on arrival (redeliveries, a stopping worker's hand-backs):
/// their claim credit goes back.
#[derive(Debug)]
pub struct Dropped(pub usize);

/// The message's next attempt starts. Answers whether it runs (it is held, and its
/// dead letter is not due again instead).
#[derive(Debug)]
pub struct Started(pub u64);

/// It decoded: the task's `process` runs for this attempt.
#[derive(Debug)]
pub struct Running(pub u64);

/// `process` returned `Ok` (with stores: its changes are applied).
#[derive(Debug)]
pub struct ReturnedOk(pub u64);

/// Its applied store changes were undone.
#[derive(Debug)]
pub struct Unapplied(pub u64);

/// Its callbacks returned: it counts against concurrency no more.
#[derive(Debug)]
pub struct CallbacksDone(pub u64);

/// Its outputs were refused after it returned: it counts as in flight again.
#[derive(Debug)]
pub struct OutputsRefused(pub u64);

/// An attempt failed for `reason`; `sample` (uniform in [0, 1)) jitters the
/// back-off. Answers what follows, `None` when it is not held.
#[derive(Debug)]
pub struct Failed<'a> {
    /// The message.
    pub order: u64,
    /// Why, for people (a dead letter's: machine-readable).
    pub reason: &'a str,
    /// A uniform draw in [0, 1) that jitters the back-off.
    pub sample: f64,
}

/// Something it needs was unreachable. Answers the wait before it runs again
/// uncounted, `None` once that counted as a failed attempt.
#[derive(Debug)]
pub struct Unavailable<'a> {
    /// The message.
    pub order: u64,
    /// Why, for people (a dead letter's: machine-readable).
    pub reason: &'a str,
    /// A uniform draw in [0, 1) that jitters the back-off.
    pub sample: f64,
}

/// The message can never succeed (it does not decode, its outputs are refused for
/// good, it ended too many owners, its attempts are spent): it goes to the
/// dead-letter stream.
#[derive(Debug)]
pub struct Poison {
    /// The message.
    pub order: u64,
    /// Why, for people (a dead letter's: machine-readable).
    pub reason: &'static str,
    /// What happened, for people.
    pub detail: String,
}

/// Its dead letter is stored. Answers what finished.
#[derive(Debug)]
pub struct DeadLettered(pub u64);

/// Its dead letter could not be stored: tried again later.
#[derive(Debug)]
pub struct DeadLetterRefused {
    /// The message.
    pub order: u64,
    /// Why, for people (a dead letter's: machine-readable).
    pub reason: &'static str,
    /// What happened, for people.
    pub detail: String,
}

/// It is processed and its outputs are stored. Answers what finished.
#[derive(Debug)]
pub struct EffectsStored(pub u64);

/// Done with it without acknowledging it here (nak'd, terminated, parked, handed
/// back). Answers the message, `None` when it was not held any more.
#[derive(Debug)]
pub struct Forgotten(pub u64);

/// A commit up to these committable positions began: acknowledge what it covers.
/// Answers how many claimed messages it covered.
#[derive(Debug)]
pub struct Committed(pub BTreeMap<u32, u64>);

/// A drain or the end of the stream: hand back what was claimed and never started.
#[derive(Debug)]
pub struct HandBackUnstarted;

/// The worker ends with work held: hand everything back; `interrupted` when that
/// is not the messages' fault.
#[derive(Debug)]
pub struct ReleaseAll {
    /// Not the messages' fault.
    pub interrupted: bool,
}

/// The lease is lost: forget everything, acknowledge and hand back nothing.
#[derive(Debug)]
pub struct LeaseLost;

/// An operator paused the partition: nothing new starts.
#[derive(Debug)]
pub struct Paused;

/// An operator resumed it.
#[derive(Debug)]
pub struct Resumed;

/// An operator let one message through a pause. Answers `false` when not paused.
#[derive(Debug)]
pub struct Stepped;

/// The window interval passed: run `window` next.
#[derive(Debug)]
pub struct WindowDue;

/// Durable timers came due: run them next.
#[derive(Debug)]
pub struct TimersDue;

/// Something asks for a commit now (a hook, a flush).
#[derive(Debug)]
pub struct CommitRequested;

/// `window` finished.
#[derive(Debug)]
pub struct WindowRan;

/// The due timers ran.
#[derive(Debug)]
pub struct TimersRan;

/// The task failed: nothing more runs.
#[derive(Debug)]
pub struct TaskFailed(pub String);

/// A delivery was taken: it queues for its first attempt. Answers its order. Every
/// message of an ordered input is claimed until committed, and so is a queue input's
/// marker.
#[derive(Debug)]
pub struct Arrived<M> {
    /// Data or a marker.
    pub kind: EnvelopeKind,
    /// The delivery.
    pub msg: M,
}

impl<M> sealed::Sealed for Arrived<M> {}
impl<M: Delivered> Event<M> for Arrived<M> {
    type Reply = u64;
    #[inline]
    fn apply(self, part: &mut Partition<M>, now: Instant) -> u64 {
        part.arrive(self.kind, self.msg, now)
    }
}

macro_rules! events {
    ($($name:ident $(<$lt:lifetime>)? => $reply:ty, |$part:ident, $ev:ident, $now:ident| $body:expr;)*) => {$(
        impl $(<$lt>)? sealed::Sealed for $name $(<$lt>)? {}
        impl<$($lt,)? M: Delivered> Event<M> for $name $(<$lt>)? {
            type Reply = $reply;
            #[inline]
            #[allow(unused_variables)]
            fn apply(self, $part: &mut Partition<M>, $now: Instant) -> $reply {
                let $ev = self;
                $body
            }
        }
    )*};
}

events! {
    Offered => Admission, |p, e, now| p.intake.admit(e.stream_seq, e.consumer_seq);
    Dropped => (), |p, e, now| p.dropped(e.0);
    Started => bool, |p, e, now| p.start(e.0, now);
    Running => (), |p, e, now| p.running(e.0);
    ReturnedOk => (), |p, e, now| p.returned_ok(e.0);
    Unapplied => (), |p, e, now| p.unapplied(e.0);
    CallbacksDone => (), |p, e, now| p.process_done(e.0);
    OutputsRefused => (), |p, e, now| p.recount(e.0, now);
    Failed<'a> => Option<AfterFailure>, |p, e, now| p.failed(e.order, e.reason, now, e.sample);
    Unavailable<'a> => Option<Duration>, |p, e, now| p.unavailable(e.order, e.reason, now, e.sample);
    Poison => (), |p, e, now| p.dead_letter(e.order, e.reason, e.detail);
    DeadLettered => Option<Finished>, |p, e, now| p.dead_lettered(e.0);
    DeadLetterRefused => (), |p, e, now| p.dead_letter_refused(e.order, e.reason, e.detail, now);
    EffectsStored => Option<Finished>, |p, e, now| p.effects_stored(e.0);
    Forgotten => Option<Held<M>>, |p, e, now| p.forget(e.0);
    Committed => usize, |p, e, now| p.commit(e.0);
    HandBackUnstarted => (), |p, e, now| p.hand_back_unstarted();
    ReleaseAll => (), |p, e, now| p.release_all(e.interrupted);
    LeaseLost => (), |p, e, now| p.abandon();
    Paused => (), |p, e, now| { p.state.pause(); p.pull.paused_or_resumed() };
    Resumed => (), |p, e, now| { p.state.resume(); p.pull.paused_or_resumed() };
    Stepped => bool, |p, e, now| p.state.step() && { p.pull.stepped(); true };
    WindowDue => (), |p, e, now| p.state.request_window();
    TimersDue => (), |p, e, now| p.state.request_timer();
    CommitRequested => (), |p, e, now| p.state.request_commit();
    WindowRan => (), |p, e, now| p.state.window_done();
    TimersRan => (), |p, e, now| p.state.timer_done();
    TaskFailed => (), |p, e, now| p.state.fail(e.0);
}
