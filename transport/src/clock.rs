//! The clock the embedded broker keeps time with.
//!
//! [`TokioClock`] follows tokio's clock, so a test that calls `tokio::time::pause()` (or
//! uses `start_paused`) moves ack-wait, nak delays and KV expiry forward in
//! milliseconds of real time.

use crate::broker::BoxFuture;
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

/// A source of time. The embedded broker reads `now` for deadlines, sleeps with
/// `sleep_until`, and stamps messages with `system_now`.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The monotonic now.
    fn now(&self) -> Instant;
    /// Wall-clock time consistent with [`now`](Self::now).
    fn system_now(&self) -> SystemTime;
    /// Resolves at `deadline`.
    fn sleep_until(&self, deadline: Instant) -> BoxFuture<()>;
}

/// tokio's clock, paused or not.
#[derive(Debug, Clone)]
pub struct TokioClock {
    base: Instant,
    base_system: SystemTime,
}

impl Default for TokioClock {
    fn default() -> Self {
        Self { base: Instant::now(), base_system: SystemTime::now() }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn system_now(&self) -> SystemTime {
        self.base_system + Instant::now().saturating_duration_since(self.base)
    }

    fn sleep_until(&self, deadline: Instant) -> BoxFuture<()> {
        Box::pin(tokio::time::sleep_until(deadline))
    }
}

/// Milliseconds since the Unix epoch (0 before it), as in the `Flotilla-Sent` header.
pub fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The inverse of [`unix_millis`].
pub fn from_unix_millis(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}
