//! The task state machine of the reference run loop, as plain data and functions.
//!
//! No actors, no I/O, no clock of its own: the task worker (in `flotilla-actors`) feeds it
//! envelopes and completions and asks it what to do next; time comes in as arguments.
//!
//! Rules (DESIGN §6, the reference run loop's `AsyncTaskState`):
//!
//! * readiness — a requested commit is ready once nothing else runs (or alongside
//!   processing when async commit is on); window, timer, end-of-stream and drain need
//!   no message in flight; processing needs `in_flight < max_concurrency` and no window
//!   or timer running (nor a commit, unless async commit);
//! * priority — commit, then window, then timer, then end-of-stream and drain once the
//!   pending queue is empty, then process;
//! * in-order commit — completions may arrive out of order; the commit position only
//!   advances over the contiguous prefix of completed envelopes;
//! * drain — a marker whose run id is not the current one is dropped; when every input
//!   of the task has seen a current marker and everything before has been processed,
//!   the task drains, commits and completes; end-of-stream likewise.

mod coordinator;

pub use coordinator::{CoordinatorRequests, ShutdownScope};

use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;
use std::time::Instant;

/// Identifies one input partition of a task (co-partitioned inputs share a task).
pub type InputId = u32;

/// What an envelope carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvelopeKind {
    /// A user message.
    Data,
    /// A drain marker of the given run.
    Drain {
        /// The run id on the marker.
        run_id: String,
    },
    /// End of stream for the envelope's input.
    EndOfStream,
}

/// An envelope waiting in a task's queue. `M` is whatever the worker keeps with it.
#[derive(Debug)]
pub struct Pending<M> {
    /// Arrival order within the task (the in-order commit position).
    pub order: u64,
    /// Which input it came from.
    pub input: InputId,
    /// Data, drain or end of stream.
    pub kind: EnvelopeKind,
    /// The worker's payload.
    pub msg: M,
}

/// What the worker should do next.
#[derive(Debug)]
pub enum Op<M> {
    /// Run `process` on this envelope.
    Process(Pending<M>),
    /// Run the commit (user hook, then acknowledge the committable prefix).
    Commit,
    /// Run `window`.
    Window,
    /// Run due user timers.
    Timer,
    /// Every input ended: run `end_of_stream`, commit, complete.
    EndOfStream,
    /// Every input saw a current drain marker: run `drain`, commit, complete.
    Drain,
    /// Nothing to do now.
    NoOp,
}

/// The state of one task.
#[derive(Debug)]
pub struct TaskState<M> {
    max_concurrency: usize,
    async_commit: bool,
    run_id: String,
    pending: VecDeque<Pending<M>>,
    /// Envelopes that arrived on an input after its current drain marker: never
    /// processed nor acknowledged in this run.
    held: Vec<Pending<M>>,
    next_order: u64,
    /// Per input: started (or consumed) envelopes not yet in the committable prefix,
    /// (order, done) in ascending order (envelopes start in arrival order).
    outstanding: BTreeMap<InputId, VecDeque<(u64, bool)>>,
    /// Input of each started envelope.
    // Keyed by order (a counter): Fx hashing, not SipHash, on the per-message path.
    input_of: FxHashMap<u64, InputId>,
    started_at: FxHashMap<u64, Instant>,
    in_flight: usize,
    need_window: bool,
    need_commit: bool,
    need_timer: bool,
    window_in_flight: bool,
    commit_in_flight: bool,
    timer_in_flight: bool,
    open_inputs: BTreeSet<InputId>,
    undrained_inputs: BTreeSet<InputId>,
    end_of_stream: bool,
    should_drain: bool,
    complete: bool,
    failed: Option<String>,
    committable: BTreeMap<InputId, u64>,
    committed: BTreeMap<InputId, u64>,
    /// `Some(credits)` while intake is paused: only that many more envelopes start.
    paused: Option<u32>,
}

impl<M> TaskState<M> {
    /// A task over `inputs`, processing at most `max_concurrency` envelopes at once,
    /// in run `run_id`.
    pub fn new(
        inputs: impl IntoIterator<Item = InputId>,
        max_concurrency: usize,
        async_commit: bool,
        run_id: impl Into<String>,
    ) -> Self {
        let inputs: BTreeSet<InputId> = inputs.into_iter().collect();
        Self {
            max_concurrency: max_concurrency.max(1),
            async_commit,
            run_id: run_id.into(),
            pending: VecDeque::new(),
            held: Vec::new(),
            next_order: 0,
            outstanding: BTreeMap::new(),
            input_of: FxHashMap::default(),
            started_at: FxHashMap::default(),
            in_flight: 0,
            need_window: false,
            need_commit: false,
            need_timer: false,
            window_in_flight: false,
            commit_in_flight: false,
            timer_in_flight: false,
            undrained_inputs: inputs.clone(),
            open_inputs: inputs,
            end_of_stream: false,
            should_drain: false,
            complete: false,
            failed: None,
            committable: BTreeMap::new(),
            committed: BTreeMap::new(),
            paused: None,
        }
    }

    /// Pauses intake: no envelope starts (commits, windows and timers still run).
    pub fn pause(&mut self) {
        self.paused.get_or_insert(0);
    }

    /// Resumes intake.
    pub fn resume(&mut self) {
        self.paused = None;
    }

    /// While paused: lets exactly one more envelope start. Returns whether paused.
    pub fn step(&mut self) -> bool {
        match &mut self.paused {
            Some(credits) => {
                *credits += 1;
                true
            }
            None => false,
        }
    }

    /// Whether intake is paused.
    pub fn is_paused(&self) -> bool {
        self.paused.is_some()
    }

    /// Queues an envelope; returns its order.
    pub fn insert(&mut self, input: InputId, kind: EnvelopeKind, msg: M) -> u64 {
        let order = self.next_order;
        self.next_order += 1;
        self.pending.push_back(Pending { order, input, kind, msg });
        order
    }

    /// Envelopes queued and not started.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Envelopes being processed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether the task has completed (drained, ended, or stopped).
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Why the task failed, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// The window interval elapsed.
    pub fn request_window(&mut self) {
        self.need_window = true;
    }

    /// A commit is wanted (interval, the task's request, or the worker's).
    pub fn request_commit(&mut self) {
        self.need_commit = true;
    }

    /// Whether a commit is requested or running.
    pub fn commit_pending(&self) -> bool {
        self.need_commit || self.commit_in_flight
    }

    /// A user timer is due.
    pub fn request_timer(&mut self) {
        self.need_timer = true;
    }

    /// Marks the task failed: it does nothing more.
    pub fn fail(&mut self, reason: impl Into<String>) {
        if self.failed.is_none() {
            self.failed = Some(reason.into());
        }
    }

    /// Completes the task without draining (a stop or shutdown).
    pub fn mark_complete(&mut self) {
        self.complete = true;
    }

    fn consume_markers(&mut self) {
        // Markers at the head of the queue are consumed once everything before them
        // has been started; their positions complete at once.
        while let Some(head) = self.pending.front() {
            match &head.kind {
                // After an input's current drain marker (or its end), everything on it
                // is held: data and markers alike. A consumed marker would complete
                // its position and let the commit jump over what is held.
                _ if self.drained(head.input) || !self.open_inputs.contains(&head.input) => {
                    if let Some(p) = self.pending.pop_front() {
                        self.held.push(p);
                    }
                    continue;
                }
                EnvelopeKind::Data => break,
                EnvelopeKind::Drain { run_id } => {
                    if *run_id == self.run_id && !self.end_of_stream {
                        self.undrained_inputs.remove(&head.input);
                    }
                }
                EnvelopeKind::EndOfStream => {
                    self.open_inputs.remove(&head.input);
                    self.undrained_inputs.remove(&head.input);
                }
            }
            if let Some(p) = self.pending.pop_front() {
                self.outstanding.entry(p.input).or_default().push_back((p.order, true));
                self.advance_committable(p.input);
            }
        }
        if self.open_inputs.is_empty() {
            self.end_of_stream = true;
        } else if self.undrained_inputs.is_empty() {
            self.should_drain = true;
        }
    }

    /// Whether `input` has seen a current drain marker (and is still open).
    fn drained(&self, input: InputId) -> bool {
        self.open_inputs.contains(&input) && !self.undrained_inputs.contains(&input)
    }

    fn is_ready(&self) -> bool {
        let op_in_flight = self.window_in_flight || self.commit_in_flight || self.timer_in_flight;
        if self.need_commit {
            (self.in_flight == 0 || self.async_commit) && !op_in_flight
        } else if self.end_of_stream || self.should_drain {
            // Everything before the markers must be processed and stored, not only
            // returned from `process`.
            self.in_flight == 0 && self.input_of.is_empty() && !op_in_flight
        } else if self.need_window || self.need_timer {
            self.in_flight == 0 && !op_in_flight
        } else {
            self.in_flight < self.max_concurrency
                && !self.window_in_flight
                && !self.timer_in_flight
                && (self.async_commit || !self.commit_in_flight)
        }
    }

    /// The next operation, marking it started. `now` stamps a started process for the
    /// callback timeout.
    #[inline]
    pub fn next_op(&mut self, now: Instant) -> Op<M> {
        if self.complete || self.failed.is_some() {
            return Op::NoOp;
        }
        self.consume_markers();
        if !self.is_ready() {
            return Op::NoOp;
        }
        if self.need_commit {
            self.need_commit = false;
            self.commit_in_flight = true;
            Op::Commit
        } else if self.need_window {
            self.need_window = false;
            self.window_in_flight = true;
            Op::Window
        } else if self.need_timer {
            self.need_timer = false;
            self.timer_in_flight = true;
            Op::Timer
        } else if self.end_of_stream && self.pending.is_empty() {
            self.complete = true;
            Op::EndOfStream
        } else if self.should_drain && self.pending.is_empty() {
            self.complete = true;
            Op::Drain
        } else if self.paused == Some(0) {
            Op::NoOp
        } else if let Some(p) = self.pending.pop_front() {
            if let Some(credits) = &mut self.paused {
                *credits -= 1;
            }
            self.in_flight += 1;
            self.outstanding.entry(p.input).or_default().push_back((p.order, false));
            self.input_of.insert(p.order, p.input);
            self.started_at.insert(p.order, now);
            Op::Process(p)
        } else {
            Op::NoOp
        }
    }

    /// A `process` finished (its callback fired) — counts against concurrency no more.
    /// The envelope is not committable until [`effects_done`](Self::effects_done).
    pub fn process_done(&mut self, _order: u64) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// The envelope's effects (outputs) are stored: it may be committed. Returns its
    /// input and that input's new committable position when it advanced.
    pub fn effects_done(&mut self, order: u64) -> Option<(InputId, u64)> {
        self.started_at.remove(&order);
        let input = self.input_of.remove(&order)?;
        if let Some(o) = self.outstanding.get_mut(&input)
            && let Ok(at) = o.binary_search_by_key(&order, |&(order, _)| order)
        {
            o[at].1 = true;
        }
        self.advance_committable(input).map(|pos| (input, pos))
    }

    /// A retry of a started envelope begins now (its callback timeout restarts).
    pub fn attempt_started(&mut self, order: u64, now: Instant) {
        self.started_at.insert(order, now);
    }

    /// A started envelope waits (for example a retry backoff): no callback runs for it.
    pub fn attempt_paused(&mut self, order: u64) {
        self.started_at.remove(&order);
    }

    /// A started envelope is handed back unfinished (a stop interrupted its back-off):
    /// it no longer counts as in flight, and it stays outstanding, so the commit
    /// position never passes it.
    pub fn release(&mut self, order: u64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.started_at.remove(&order);
    }

    /// A process that finished must run again (its outputs were not stored): it counts
    /// as in flight again.
    pub fn restart(&mut self, order: u64, now: Instant) {
        self.in_flight += 1;
        self.started_at.insert(order, now);
    }

    /// `process_done` and `effects_done` at once.
    pub fn done(&mut self, order: u64) -> Option<(InputId, u64)> {
        self.process_done(order);
        self.effects_done(order)
    }

    fn advance_committable(&mut self, input: InputId) -> Option<u64> {
        let outstanding = self.outstanding.get_mut(&input)?;
        let mut advanced = None;
        while let Some(&(order, true)) = outstanding.front() {
            outstanding.pop_front();
            advanced = Some(order);
        }
        if let Some(pos) = advanced {
            self.committable.insert(input, pos);
        }
        advanced
    }

    /// Per input, the highest order whose envelope and every earlier one of that input
    /// completed.
    pub fn committable(&self) -> &BTreeMap<InputId, u64> {
        &self.committable
    }

    /// The committable position of one input.
    pub fn committable_for(&self, input: InputId) -> Option<u64> {
        self.committable.get(&input).copied()
    }

    /// How many orders of `input` are committable and not committed yet. Orders count
    /// envelopes of all inputs, so this is exact for a task with one input and an upper
    /// bound otherwise.
    pub fn uncommitted_count(&self, input: InputId) -> u64 {
        match (self.committable.get(&input), self.committed.get(&input)) {
            (Some(&able), Some(&done)) => able.saturating_sub(done),
            (Some(&able), None) => able + 1,
            (None, _) => 0,
        }
    }

    /// Completions the last commit has not covered yet.
    pub fn uncommitted(&self) -> bool {
        self.committable != self.committed
    }

    /// The commit finished, covering `positions` (what [`committable`](Self::committable)
    /// was when it started).
    pub fn commit_done(&mut self, positions: BTreeMap<InputId, u64>) {
        self.commit_in_flight = false;
        for (input, pos) in positions {
            let e = self.committed.entry(input).or_insert(pos);
            *e = (*e).max(pos);
        }
    }

    /// The window finished.
    pub fn window_done(&mut self) {
        self.window_in_flight = false;
    }

    /// The timer callbacks finished.
    pub fn timer_done(&mut self) {
        self.timer_in_flight = false;
    }

    /// Orders of processes running for longer than `timeout`.
    pub fn timed_out(&self, now: Instant, timeout: Duration) -> Vec<u64> {
        let mut late: Vec<u64> = self
            .started_at
            .iter()
            .filter(|(_, started)| now.saturating_duration_since(**started) >= timeout)
            .map(|(o, _)| *o)
            .collect();
        late.sort_unstable();
        late
    }

    /// Takes every queued envelope that has not started (to hand back to the broker).
    pub fn take_unstarted(&mut self) -> Vec<Pending<M>> {
        let mut out: Vec<Pending<M>> = self.held.drain(..).collect();
        out.extend(self.pending.drain(..));
        out
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
