use actix::prelude::*;
use std::time::Duration;

/// What a timer tells its target.
#[derive(Debug, Clone, PartialEq, Eq, Message)]
#[rtype(result = "()")]
pub enum Tick {
    /// The window interval elapsed.
    Window,
    /// A user timer is due.
    UserTimer(String),
    /// A task worker's partition has a deadline now (a retry's back-off, the commit
    /// interval, a keep-alive, the callback check).
    Deadline,
    /// Time to look at the backlog.
    Backlog,
    /// Time to sweep for stranded messages.
    Sweep,
    /// A back-off wait is over.
    Resume,
    /// Restart the task of this container slot.
    Restart(usize),
    /// Time to look at the cluster (members, leases, desired state).
    Scan,
    /// Time to renew this node's membership and leases.
    Renew,
}

/// Ticks `target` every `period` until it stops (or the timer is cancelled).
#[derive(Debug, Message)]
#[rtype(result = "TimerId")]
pub struct Every {
    /// The interval.
    pub period: Duration,
    /// Who gets the ticks.
    pub target: Recipient<Tick>,
    /// What to send.
    pub tick: Tick,
}

/// Ticks `target` once after `delay`.
#[derive(Debug, Message)]
#[rtype(result = "TimerId")]
pub struct After {
    /// The delay.
    pub delay: Duration,
    /// Who gets the tick.
    pub target: Recipient<Tick>,
    /// What to send.
    pub tick: Tick,
}

/// Cancels a timer.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Cancel(pub TimerId);

/// Identifies a timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TimerId(pub(crate) u64);
