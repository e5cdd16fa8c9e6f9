//! Properties of the run-loop state machine: arbitrary sequences of what the worker
//! may do (insert envelopes, take the next operation, finish processes, effects,
//! commits, windows and timers, restart a process, pause, step, resume, fail), with
//! the contract of DESIGN §6 checked after every step against a model that tracks
//! each envelope.

use super::*;
use proptest::prelude::*;

const RUN: &str = "run-1";

/// Picks one of the candidates an action applies to (shrinks toward the first).
#[derive(Debug, Clone, Copy)]
struct Pick(u16);

impl Pick {
    fn of<T: Copy>(self, among: &[T]) -> Option<T> {
        (!among.is_empty()).then(|| among[usize::from(self.0) % among.len()])
    }
}

/// What an inserted envelope is, as the generator chooses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Data,
    /// A drain marker of the current run.
    Drain,
    /// A drain marker of an earlier run (dropped).
    StaleDrain,
    End,
}

impl Kind {
    fn envelope(self) -> EnvelopeKind {
        match self {
            Kind::Data => EnvelopeKind::Data,
            Kind::Drain => EnvelopeKind::Drain { run_id: RUN.into() },
            Kind::StaleDrain => EnvelopeKind::Drain { run_id: "run-0".into() },
            Kind::End => EnvelopeKind::EndOfStream,
        }
    }
}

/// One thing the worker does. Actions that do not apply in the current state (finish
/// a commit that is not running, say) are skipped, as the worker never does them.
#[derive(Debug, Clone)]
enum Action {
    Insert(Pick, Kind),
    Next,
    ProcessDone(Pick),
    EffectsDone(Pick),
    Done(Pick),
    Restart(Pick),
    RequestCommit,
    RequestWindow,
    RequestTimer,
    CommitDone,
    WindowDone,
    TimerDone,
    Pause,
    Step,
    Resume,
    Fail,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![8 => Just(Kind::Data), 1 => Just(Kind::Drain), 1 => Just(Kind::StaleDrain), 1 => Just(Kind::End)]
}

fn action(markers: bool) -> impl Strategy<Value = Action> {
    let insert = if markers {
        (any::<u16>().prop_map(Pick), kind()).boxed()
    } else {
        (any::<u16>().prop_map(Pick), Just(Kind::Data)).boxed()
    };
    prop_oneof![
        6 => insert.prop_map(|(i, k)| Action::Insert(i, k)),
        8 => Just(Action::Next),
        3 => any::<u16>().prop_map(Pick).prop_map(Action::ProcessDone),
        3 => any::<u16>().prop_map(Pick).prop_map(Action::EffectsDone),
        3 => any::<u16>().prop_map(Pick).prop_map(Action::Done),
        1 => any::<u16>().prop_map(Pick).prop_map(Action::Restart),
        1 => Just(Action::RequestCommit),
        1 => Just(Action::RequestWindow),
        1 => Just(Action::RequestTimer),
        2 => Just(Action::CommitDone),
        2 => Just(Action::WindowDone),
        2 => Just(Action::TimerDone),
        1 => Just(Action::Pause),
        1 => Just(Action::Step),
        1 => Just(Action::Resume),
    ]
}

/// The task as the worker sees it, envelope by envelope.
struct Model {
    state: TaskState<()>,
    inputs: Vec<InputId>,
    max: usize,
    async_commit: bool,
    now: Instant,
    /// Every envelope inserted, by order.
    envelopes: BTreeMap<u64, (InputId, Kind)>,
    /// Orders handed to `process`, in the order they started.
    started: Vec<u64>,
    /// Processes running (counted against concurrency).
    running: BTreeSet<u64>,
    /// Processes that returned; their outputs are not stored yet.
    returned: BTreeSet<u64>,
    /// Processed, outputs stored.
    completed: BTreeSet<u64>,
    need_commit: bool,
    need_window: bool,
    need_timer: bool,
    commit_running: bool,
    window_running: bool,
    timer_running: bool,
    credits: Option<u32>,
    finished: bool,
    failed: bool,
    /// The committable positions last seen, and what commits covered.
    committable: BTreeMap<InputId, u64>,
    committed: BTreeMap<InputId, u64>,
}

impl Model {
    fn new(inputs: u32, max: usize, async_commit: bool) -> Self {
        let inputs: Vec<InputId> = (0..inputs).collect();
        Self {
            state: TaskState::new(inputs.iter().copied(), max, async_commit, RUN),
            inputs,
            max,
            async_commit,
            now: Instant::now(),
            envelopes: BTreeMap::new(),
            started: Vec::new(),
            running: BTreeSet::new(),
            returned: BTreeSet::new(),
            completed: BTreeSet::new(),
            need_commit: false,
            need_window: false,
            need_timer: false,
            commit_running: false,
            window_running: false,
            timer_running: false,
            credits: None,
            finished: false,
            failed: false,
            committable: BTreeMap::new(),
            committed: BTreeMap::new(),
        }
    }

    fn op_running(&self) -> bool {
        self.commit_running || self.window_running || self.timer_running
    }

    fn pick(set: &BTreeSet<u64>, i: Pick) -> Option<u64> {
        i.of(&set.iter().copied().collect::<Vec<_>>())
    }

    /// Envelopes of `input` before its first envelope of a kind in `stops`, if it has one.
    fn before_first(&self, input: InputId, stops: &[Kind]) -> Option<Vec<(u64, Kind)>> {
        let mut before = Vec::new();
        for (&order, &(i, k)) in &self.envelopes {
            if i != input {
                continue;
            }
            if stops.contains(&k) {
                return Some(before);
            }
            before.push((order, k));
        }
        None
    }

    /// Applies `action`; returns whether it was a `next_op` that answered `NoOp`.
    fn apply(&mut self, action: &Action) -> Result<bool, TestCaseError> {
        match action {
            Action::Insert(i, kind) => {
                let input = i.of(&self.inputs).unwrap_or(0);
                let order = self.state.insert(input, kind.envelope(), ());
                prop_assert!(!self.envelopes.contains_key(&order), "order {} given twice", order);
                prop_assert!(self.envelopes.keys().all(|&o| o < order), "orders grow with arrival");
                self.envelopes.insert(order, (input, *kind));
            }
            Action::Next => return self.next(),
            Action::ProcessDone(i) => {
                if let Some(o) = Self::pick(&self.running, *i) {
                    self.state.process_done(o);
                    self.running.remove(&o);
                    self.returned.insert(o);
                }
            }
            Action::EffectsDone(i) => {
                if let Some(o) = Self::pick(&self.returned, *i) {
                    let advanced = self.state.effects_done(o);
                    self.returned.remove(&o);
                    self.completed.insert(o);
                    self.check_advance(o, advanced)?;
                }
            }
            Action::Done(i) => {
                if let Some(o) = Self::pick(&self.running, *i) {
                    let advanced = self.state.done(o);
                    self.running.remove(&o);
                    self.completed.insert(o);
                    self.check_advance(o, advanced)?;
                }
            }
            Action::Restart(i) => {
                if let Some(o) = Self::pick(&self.returned, *i) {
                    self.state.restart(o, self.now);
                    self.returned.remove(&o);
                    self.running.insert(o);
                }
            }
            Action::RequestCommit => {
                self.state.request_commit();
                self.need_commit = true;
            }
            Action::RequestWindow => {
                self.state.request_window();
                self.need_window = true;
            }
            Action::RequestTimer => {
                self.state.request_timer();
                self.need_timer = true;
            }
            Action::CommitDone if self.commit_running => {
                let positions = self.state.committable().clone();
                for (&input, &pos) in &positions {
                    let e = self.committed.entry(input).or_insert(pos);
                    *e = (*e).max(pos);
                }
                self.state.commit_done(positions);
                self.commit_running = false;
            }
            Action::WindowDone if self.window_running => {
                self.state.window_done();
                self.window_running = false;
            }
            Action::TimerDone if self.timer_running => {
                self.state.timer_done();
                self.timer_running = false;
            }
            Action::CommitDone | Action::WindowDone | Action::TimerDone => {}
            Action::Pause => {
                self.state.pause();
                self.credits.get_or_insert(0);
            }
            Action::Step => {
                prop_assert_eq!(self.state.step(), self.credits.is_some());
                if let Some(c) = &mut self.credits {
                    *c += 1;
                }
            }
            Action::Resume => {
                self.state.resume();
                self.credits = None;
            }
            Action::Fail => {
                self.state.fail("boom");
                self.failed = true;
            }
        }
        Ok(false)
    }

    fn check_advance(&self, order: u64, advanced: Option<(InputId, u64)>) -> Result<(), TestCaseError> {
        let (input, _) = self.envelopes[&order];
        match advanced {
            Some((i, pos)) => {
                prop_assert_eq!(i, input, "the position advanced on the envelope's own input");
                prop_assert!(pos >= order, "an advance reaching {} does not cover {}", pos, order);
                prop_assert_eq!(self.state.committable_for(input), Some(pos));
            }
            None => prop_assert_eq!(
                self.state.committable_for(input),
                self.committable.get(&input).copied(),
                "no advance reported, but the position moved"
            ),
        }
        Ok(())
    }

    fn next(&mut self) -> Result<bool, TestCaseError> {
        let op = self.state.next_op(self.now);
        let idle_inputs = self.running.is_empty() && self.returned.is_empty();
        if self.finished || self.failed {
            prop_assert!(matches!(op, Op::NoOp), "a finished or failed task did {:?}", op);
            return Ok(true);
        }
        match op {
            Op::Process(p) => {
                prop_assert_eq!(&p.kind, &EnvelopeKind::Data, "a marker was handed to process");
                prop_assert_eq!(self.envelopes.get(&p.order).map(|e| e.0), Some(p.input));
                prop_assert!(
                    self.started.last().is_none_or(|&last| last < p.order),
                    "processes start in arrival order"
                );
                prop_assert!(
                    self.running.len() < self.max,
                    "started a process with {} of {} running",
                    self.running.len(),
                    self.max
                );
                prop_assert!(!self.window_running && !self.timer_running, "process overlaps a window or timer");
                prop_assert!(self.async_commit || !self.commit_running, "process overlaps a commit");
                prop_assert!(
                    !self.need_commit && !self.need_window && !self.need_timer,
                    "process started ahead of a commit, window or timer"
                );
                prop_assert!(self.credits != Some(0), "a paused task started a process without a step");
                prop_assert!(
                    !self
                        .envelopes
                        .range(..p.order)
                        .any(|(_, &(i, k))| i == p.input && matches!(k, Kind::Drain | Kind::End)),
                    "{} follows a current drain marker or the end of input {}, yet started",
                    p.order,
                    p.input
                );
                if let Some(c) = &mut self.credits {
                    *c -= 1;
                }
                self.started.push(p.order);
                self.running.insert(p.order);
            }
            Op::Commit => {
                prop_assert!(self.need_commit, "a commit nobody asked for");
                prop_assert!(self.async_commit || self.running.is_empty(), "a commit overlaps a process");
                prop_assert!(!self.op_running(), "a commit overlaps another operation");
                self.need_commit = false;
                self.commit_running = true;
            }
            Op::Window => {
                prop_assert!(self.need_window && !self.need_commit, "window out of priority");
                prop_assert!(self.running.is_empty() && !self.op_running(), "a window overlaps other work");
                self.need_window = false;
                self.window_running = true;
            }
            Op::Timer => {
                prop_assert!(self.need_timer && !self.need_commit && !self.need_window, "timer out of priority");
                prop_assert!(self.running.is_empty() && !self.op_running(), "a timer overlaps other work");
                self.need_timer = false;
                self.timer_running = true;
            }
            Op::EndOfStream | Op::Drain => {
                let drain = matches!(op, Op::Drain);
                prop_assert!(!self.need_commit && !self.need_window && !self.need_timer, "{:?} out of priority", op);
                prop_assert!(idle_inputs && !self.op_running(), "{:?} while work is unfinished", op);
                let stops: &[Kind] = if drain { &[Kind::Drain, Kind::End] } else { &[Kind::End] };
                for &input in &self.inputs {
                    let before = self.before_first(input, stops);
                    prop_assert!(before.is_some(), "{:?} but input {} has no marker for it", op, input);
                    for (order, kind) in before.unwrap_or_default() {
                        prop_assert!(
                            kind != Kind::Data || self.completed.contains(&order),
                            "{:?} before envelope {} (input {}) ahead of the marker completed",
                            op,
                            order,
                            input
                        );
                    }
                }
                prop_assert!(self.state.is_complete());
                self.finished = true;
            }
            Op::NoOp => {
                if self.need_commit && !self.op_running() && (self.async_commit || self.running.is_empty()) {
                    prop_assert!(false, "a requested commit could run, but the task did nothing");
                }
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The contract that holds between any two steps.
    fn check(&mut self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.state.in_flight(), self.running.len(), "in-flight count");
        // Callbacks the state times: exactly the started envelopes not finished.
        let timed: BTreeSet<u64> = self.state.timed_out(self.now, Duration::ZERO).into_iter().collect();
        let unfinished: BTreeSet<u64> = self.running.union(&self.returned).copied().collect();
        prop_assert_eq!(timed, unfinished, "started and not finished, as the state times them");
        let committable = self.state.committable().clone();
        for (&input, &pos) in &committable {
            prop_assert_eq!(
                self.envelopes.get(&pos).map(|e| e.0),
                Some(input),
                "position {} is not on input {}",
                pos,
                input
            );
            if let Some(&before) = self.committable.get(&input) {
                prop_assert!(pos >= before, "input {} committable went back from {} to {}", input, before, pos);
            }
            for (&order, &(i, kind)) in self.envelopes.range(..=pos) {
                prop_assert!(
                    i != input || kind != Kind::Data || self.completed.contains(&order),
                    "input {} committable to {} covers {}, which is not completed",
                    input,
                    pos,
                    order
                );
            }
        }
        prop_assert!(self.committable.keys().all(|i| committable.contains_key(i)), "a committable position vanished");
        self.committable = committable;
        for (input, &done) in &self.committed {
            prop_assert!(self.committable.get(input).is_some_and(|&able| done <= able), "committed past committable");
        }
        prop_assert_eq!(self.state.uncommitted(), self.committable != self.committed);
        if self.inputs.len() == 1 {
            let (lo, hi) = (self.committed.get(&0).map_or(0, |&c| c + 1), self.committable.get(&0).copied());
            let exact = hi.filter(|&hi| hi >= lo).map_or(0, |hi| self.envelopes.range(lo..=hi).count() as u64);
            prop_assert_eq!(self.state.uncommitted_count(0), exact, "uncommitted count of a single input");
        }
        prop_assert!(self.running.is_disjoint(&self.completed) && self.returned.is_disjoint(&self.completed));
        Ok(())
    }

    /// Finishes everything that runs and takes operations until the task rests.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        self.apply(&Action::Resume)?;
        let first = Pick(0);
        for _ in 0..10_000 {
            let action = if !self.running.is_empty() {
                Action::Done(first)
            } else if !self.returned.is_empty() {
                Action::EffectsDone(first)
            } else if self.commit_running {
                Action::CommitDone
            } else if self.window_running {
                Action::WindowDone
            } else if self.timer_running {
                Action::TimerDone
            } else {
                Action::Next
            };
            let rested = self.apply(&action)?;
            self.check()?;
            if rested {
                return Ok(());
            }
        }
        prop_assert!(false, "the task never came to rest");
        Ok(())
    }
}

fn run(inputs: u32, max: usize, async_commit: bool, actions: &[Action]) -> Result<Model, TestCaseError> {
    let mut m = Model::new(inputs, max, async_commit);
    for a in actions {
        m.apply(a)?;
        m.check()?;
    }
    Ok(m)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_step_keeps_the_run_loop_contract(
        inputs in 1u32..=3,
        max in 1usize..=4,
        async_commit in any::<bool>(),
        actions in proptest::collection::vec(action(true), 0..80),
    ) {
        let mut m = run(inputs, max, async_commit, &actions)?;
        m.settle()?;
    }

    #[test]
    fn a_failed_task_starts_nothing_more(
        max in 1usize..=4,
        before in proptest::collection::vec(action(true), 0..30),
        after in proptest::collection::vec(action(true), 0..30),
    ) {
        let mut m = run(2, max, false, &before)?;
        m.apply(&Action::Fail)?;
        let started = m.started.len();
        for a in &after {
            m.apply(a)?;
            m.check()?;
        }
        prop_assert_eq!(m.started.len(), started);
        prop_assert_eq!(m.state.failure(), Some("boom"));
    }

    #[test]
    fn without_markers_every_message_is_processed_once_and_committed(
        inputs in 1u32..=3,
        max in 1usize..=4,
        async_commit in any::<bool>(),
        actions in proptest::collection::vec(action(false), 0..80),
    ) {
        let mut m = run(inputs, max, async_commit, &actions)?;
        m.settle()?;
        prop_assert!(m.state.take_unstarted().is_empty(), "nothing may be left over");
        let started: BTreeSet<u64> = m.started.iter().copied().collect();
        prop_assert_eq!(started.len(), m.started.len(), "an envelope started twice");
        prop_assert_eq!(&started, &m.envelopes.keys().copied().collect::<BTreeSet<_>>(), "every message started");
        prop_assert_eq!(&m.completed, &started);
        for &input in &m.inputs {
            let last = m.envelopes.iter().rev().find(|(_, e)| e.0 == input).map(|(&o, _)| o);
            prop_assert_eq!(m.state.committable_for(input), last, "input {} committable to its last message", input);
        }
    }

    #[test]
    fn what_is_handed_back_was_never_started_nor_committed(
        inputs in 1u32..=3,
        max in 1usize..=4,
        async_commit in any::<bool>(),
        actions in proptest::collection::vec(action(true), 0..80),
    ) {
        let mut m = run(inputs, max, async_commit, &actions)?;
        m.settle()?;
        let back = m.state.take_unstarted();
        let started: BTreeSet<u64> = m.started.iter().copied().collect();
        for p in &back {
            prop_assert_eq!(m.envelopes.get(&p.order).map(|e| e.0), Some(p.input));
            prop_assert!(!started.contains(&p.order), "{} was started and handed back", p.order);
            prop_assert!(
                m.state.committable_for(p.input).is_none_or(|pos| pos < p.order),
                "{} is handed back but its input is committable past it", p.order
            );
        }
        // Every data envelope is accounted for exactly once: processed, or handed back.
        let back: BTreeSet<u64> = back.iter().map(|p| p.order).collect();
        for (order, (_, kind)) in &m.envelopes {
            if *kind == Kind::Data {
                prop_assert!(started.contains(order) != back.contains(order), "data {} processed and handed back, or neither", order);
            }
        }
    }
}
