//! Per-task settings.

use crate::retry::RetryPolicy;
use std::time::Duration;

/// What a task failure does to the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Stop the container (the reference run loop's behaviour): the node exits with an error.
    #[default]
    FailContainer,
    /// Restart the failed task from its last commit; the container goes on.
    RestartTask,
}

/// Settings of one task (one input stream), with Flotilla's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskConfig {
    /// Messages processed at once per task (per partition for ordered inputs).
    pub max_concurrency: usize,
    /// How often `window` runs; `None` never.
    pub window_interval: Option<Duration>,
    /// How often a commit is forced; commits also happen whenever the task is idle or
    /// half its window is uncommitted.
    pub commit_interval: Duration,
    /// Let commits overlap processing.
    pub async_commit: bool,
    /// A `process` (with its deferred work and its outputs' publish) running longer
    /// than this fails the task; `None` never. The default,
    /// [`DEFAULT_CALLBACK_TIMEOUT`] (5 minutes), keeps a wedged handler from being
    /// kept alive by in-progress acks for ever (Temporal requires a start-to-close
    /// timeout for the same reason); a task whose messages may take longer sets its own.
    pub callback_timeout: Option<Duration>,
    /// Attempts and backoff for failing messages.
    pub retry: RetryPolicy,
    /// How long a graceful stop waits for in-flight work.
    pub drain_timeout: Duration,
    /// The broker's redelivery timeout for an unacknowledged message.
    pub ack_wait: Duration,
    /// Ordered inputs: messages claimed but not committed, per partition.
    pub window: u32,
    /// What a task failure does.
    pub failure_policy: FailurePolicy,
    /// Ordered inputs: how often a message may end its owner (a crash of the process,
    /// a hang past `callback_timeout`, a task failure) before it is dead-lettered as
    /// `crash-loop` instead of ending the next one. Counted across nodes in the job's
    /// KV bucket `SUSPECTS`; an owner that ends unseen (a crash, a lost lease) counts
    /// only within the message's first 10 s, so a long message is not blamed for
    /// unrelated ends, while a callback timeout or a fatal error counts at any time.
    pub crash_limit: u32,
    /// How often one attempt of a message is retried without counting while something
    /// is unavailable (its handler returned `TaskError::Unavailable`, or the broker
    /// could not store its outputs), with backoff from 200 ms doubling to 30 s and
    /// jitter: the default 50 is about 22 minutes. An attempt still unavailable after
    /// that counts as failed (so a dependency that never returns ends in the DLQ after
    /// `max_attempts` such attempts).
    pub unavailable_retries: u32,
}

/// The default [`TaskConfig::callback_timeout`]: 5 minutes.
pub const DEFAULT_CALLBACK_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            max_concurrency: 1,
            window_interval: None,
            commit_interval: Duration::from_secs(1),
            async_commit: false,
            callback_timeout: Some(DEFAULT_CALLBACK_TIMEOUT),
            retry: RetryPolicy::default(),
            drain_timeout: Duration::from_secs(30),
            ack_wait: Duration::from_secs(30),
            window: 256,
            failure_policy: FailurePolicy::default(),
            crash_limit: 3,
            unavailable_retries: 50,
        }
    }
}

/// A setting that cannot work, named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid setting {setting} of {task}: {problem}")]
pub struct ConfigError {
    /// The task (input stream) it belongs to.
    pub task: String,
    /// The setting's name, as the builder calls it.
    pub setting: &'static str,
    /// What is wrong and what would work.
    pub problem: String,
}

impl TaskConfig {
    /// Checks every setting.
    ///
    /// # Errors
    /// The first setting that cannot work, by name.
    pub fn validate(&self, task: &str) -> Result<(), ConfigError> {
        let err = |setting, problem: &str| ConfigError { task: task.to_owned(), setting, problem: problem.to_owned() };
        if self.max_concurrency == 0 {
            return Err(err("max_concurrency", "must be at least 1"));
        }
        if self.window_interval.is_some_and(|d| d.is_zero()) {
            return Err(err("window_every", "a window interval of 0 would run window continuously; use at least 1 ms"));
        }
        if self.commit_interval.is_zero() {
            return Err(err("commit_every", "must be greater than 0"));
        }
        if self.callback_timeout.is_some_and(|d| d.is_zero()) {
            return Err(err("callback_timeout", "must be greater than 0"));
        }
        if self.retry.max_attempts == 0 {
            return Err(err("max_attempts", "must be at least 1"));
        }
        if self.ack_wait < Duration::from_millis(100) {
            return Err(err("ack_wait", "must be at least 100 ms"));
        }
        if self.window == 0 {
            return Err(err("window", "must be at least 1"));
        }
        if self.crash_limit == 0 {
            return Err(err("crash_limit", "must be at least 1 (the times a message may end its owner)"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_named() {
        assert!(TaskConfig::default().validate("t").is_ok());
        let c = TaskConfig { window_interval: Some(Duration::ZERO), ..TaskConfig::default() };
        let e = c.validate("relay-in").expect_err("zero window");
        assert_eq!(e.setting, "window_every");
        assert!(e.to_string().contains("relay-in"), "{e}");
        let c = TaskConfig { max_concurrency: 0, ..TaskConfig::default() };
        assert_eq!(c.validate("t").expect_err("zero").setting, "max_concurrency");
    }
}
