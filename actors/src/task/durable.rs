//! Durable timers as outputs: arming and cancelling write to the timer stream, and
//! record the change for the worker that judges their fires
//! ([`task_worker::timers`](crate::task_worker::timers)).

use super::{Outputs, TaskError, check_delay};
use crate::task_worker::timers::{Change, timer_key};
use flotilla_transport::broker::OutboundMessage;
use flotilla_transport::clock::unix_millis;
use flotilla_transport::wire::{MessageId, StreamName, headers};
use std::time::{Duration, SystemTime};

/// What a durable timer does when it comes due late (its job was down, or busy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Misfire {
    /// Fire once, however late (the default).
    #[default]
    FireLate,
    /// Skip it when it comes due more than this late. Lateness is judged when the
    /// node's timer service takes it from the timer stream (normally within a second of
    /// its time; up to 5 s after a server restart), not when the partition runs it; so
    /// give more than a few seconds.
    SkipIfLateBy(Duration),
}

impl Outputs {
    /// Arms (or re-arms: a timer of the same name is replaced) the durable timer
    /// `name` of the task's `input` partition (`partition`; `None` for a queue input),
    /// while processing the input at stream sequence `at`.
    pub(super) fn arm_timer(
        &self,
        (input, partition, at): (&str, Option<u32>, Option<u64>),
        name: &str,
        after: Duration,
        misfire: Misfire,
    ) -> Result<(), TaskError> {
        check_delay(after, &format!("durable timer {name:?}"))?;
        let (subject, target, key) = self.timer_subjects(input, partition, name)?;
        let id = self.next_id();
        let mut timer = OutboundMessage::new(subject, bytes::Bytes::new());
        timer.headers.insert(headers::MSG_ID, format!("timer-{id}"));
        timer.headers.insert(headers::ARMING, id.clone());
        timer.headers.insert(headers::KIND, headers::MessageKind::Timer.as_str());
        timer.headers.insert(headers::TIMER, name.to_owned());
        timer.headers.insert(headers::DELAY, after.as_millis().to_string());
        timer.headers.insert(headers::TARGET, target);
        timer.headers.insert(headers::SENT, unix_millis(SystemTime::now()).to_string());
        if let MisfireHeader(Some(policy)) = MisfireHeader::of(misfire) {
            timer.headers.insert(headers::MISFIRE, policy);
        }
        if let Some(tp) = &self.traceparent {
            timer.headers.insert(headers::TRACEPARENT, tp.to_string());
        }
        self.shared().buffer.borrow_mut().push(timer);
        self.timer_changed(key, partition, Change { arming: Some(id), at });
        Ok(())
    }

    /// Cancels the durable timer `name`: a tombstone replaces it in the timer stream.
    pub(super) fn cancel_timer(
        &self,
        (input, partition, at): (&str, Option<u32>, Option<u64>),
        name: &str,
    ) -> Result<(), TaskError> {
        let (subject, _, key) = self.timer_subjects(input, partition, name)?;
        let id = self.next_id();
        let mut tombstone = OutboundMessage::new(subject, bytes::Bytes::new());
        tombstone.headers.insert(headers::MSG_ID, format!("cancel-{id}"));
        tombstone.headers.insert(headers::KIND, headers::TIMER_CANCELLED);
        tombstone.headers.insert(headers::TIMER, name.to_owned());
        self.shared().buffer.borrow_mut().push(tombstone);
        self.timer_changed(key, partition, Change { arming: None, at });
        Ok(())
    }

    /// Records `change` to the durable timer at `key` with the outputs (its fires still
    /// on their way are judged by it), and notes it for the worker of an ordered
    /// partition.
    fn timer_changed(&self, key: String, partition: Option<u32>, change: Change) {
        let shared = self.shared();
        shared.buffer.borrow_mut().push(crate::task_worker::timers::record(&change, &self.env.subjects, &key));
        if partition.is_some() {
            shared.timer_changes.borrow_mut().push((key, change));
        }
    }

    /// The timer stream subject of durable timer `name` (the same for every arming,
    /// so a new one replaces the last), the input subject it fires into, and its key.
    fn timer_subjects(
        &self,
        input: &str,
        partition: Option<u32>,
        name: &str,
    ) -> Result<(String, String, String), TaskError> {
        if let Some(problem) = headers::entry_problem(headers::TIMER, name) {
            return Err(TaskError::failed(format!(
                "timer name {name:?} cannot be used: names travel in the {} header, and {problem}",
                headers::TIMER
            )));
        }
        let stream = StreamName::new(input).map_err(|e| TaskError::fatal(e.to_string()))?;
        let target = match partition {
            Some(p) => self.env.subjects.ordered_partition(&stream, p),
            None => self.env.subjects.queue(&stream),
        };
        let key = timer_key(input, partition, name);
        Ok((self.env.subjects.timer(&format!("named-{key}")), target, key))
    }

    /// The id of this callback's next output: derived from its cause, else new.
    fn next_id(&self) -> String {
        let shared = self.shared();
        let index = shared.next_index.get();
        shared.next_index.set(index + 1);
        match &self.cause {
            Some(cause) => cause.derive_output_text(index),
            None => MessageId::new_v7().as_str().to_owned(),
        }
    }
}

/// A misfire policy as its header value (`None` for the default).
struct MisfireHeader(Option<String>);

impl MisfireHeader {
    fn of(misfire: Misfire) -> Self {
        match misfire {
            Misfire::FireLate => Self(None),
            Misfire::SkipIfLateBy(late) => Self(Some(format!("skip:{}", late.as_millis()))),
        }
    }
}
