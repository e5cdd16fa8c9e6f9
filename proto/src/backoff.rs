//! The one back-off, and the retry policy a task's failing messages follow.
//!
//! Every wait in Flotilla that grows after a failure is a [`Backoff`]: `first` after the
//! first failure, times `multiplier` per failure after it, at most `cap`, then scaled by
//! a jitter factor in `[1 - spread, 1 + spread]` so that many parts retrying after one
//! outage do not come back at once. The rules draw no randomness of their own: the
//! caller passes a uniform sample in `[0, 1)` (a seeded source in a simulation, the
//! thread's generator in a node). The named back-offs below are every such wait the
//! runtime uses, so they can be read and compared in one place.

use std::time::Duration;

/// An exponential back-off with a cap and a jitter spread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The wait after the first failure (before jitter).
    pub first: Duration,
    /// Growth per failure after the first (at least 1).
    pub multiplier: f64,
    /// Upper bound of a wait (before jitter).
    pub cap: Duration,
    /// Jitter: a wait is scaled by a factor in `[1 - spread, 1 + spread]` (0 to 1).
    pub spread: f64,
}

impl Backoff {
    /// Doubling from `first` to `cap`, spread by `spread`.
    pub const fn doubling(first: Duration, cap: Duration, spread: f64) -> Self {
        Self { first, multiplier: 2.0, cap, spread }
    }

    /// The wait after failure number `n` (1 for the first; 0 counts as 1), before jitter.
    pub fn base(&self, n: u32) -> Duration {
        let exp = self.multiplier.max(1.0).powi(n.saturating_sub(1).min(64) as i32);
        let secs = (self.first.as_secs_f64() * exp).min(self.cap.as_secs_f64());
        Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(self.cap)
    }

    /// The wait after failure number `n`, jittered by `sample`, a uniform draw in
    /// `[0, 1)` (clamped into it): `sample` 0 gives the shortest wait, 0.5 the base.
    pub fn wait(&self, n: u32, sample: f64) -> Duration {
        let base = self.base(n);
        let factor = jitter_factor(self.spread, sample);
        Duration::try_from_secs_f64((base.as_secs_f64() * factor).max(0.0)).unwrap_or(base)
    }
}

/// The jitter factor for `spread` (clamped to 0..=1) and a uniform `sample` in `[0, 1)`:
/// `1 - spread` at 0, `1 + spread` towards 1.
pub fn jitter_factor(spread: f64, sample: f64) -> f64 {
    let spread = if spread.is_finite() { spread.clamp(0.0, 1.0) } else { 0.0 };
    let sample = if sample.is_finite() { sample.clamp(0.0, 1.0) } else { 0.5 };
    1.0 - spread + 2.0 * spread * sample
}

/// A task's worker while the broker or a store is unreachable (a publish, a restore, a
/// store commit, an `Unavailable` from the task): 200 ms doubling to 30 s, ±50 %.
pub const UNAVAILABLE: Backoff = Backoff::doubling(Duration::from_millis(200), Duration::from_secs(30), 0.5);

/// A parked key's message that the PARKED stream refused, after its n-th delivery:
/// 200 ms doubling to 5 min, ±50 % (see `partition::intake::park_retry_delay`).
pub const PARK: Backoff = Backoff::doubling(Duration::from_millis(200), Duration::from_secs(300), 0.5);

/// Reconnecting to the server after n failed attempts: 100 ms doubling to 5 s, ±50 %
/// (the first failed attempt is n = 1; a first connect has no wait).
pub const RECONNECT: Backoff = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(5), 0.5);

/// A partition's done record (drained, ended) that could not be stored: 200 ms doubling
/// to 30 s, ±50 %.
pub const DONE_RECORD: Backoff = UNAVAILABLE;

/// A control record (parked keys, pause) that could not be read or written: the default
/// retry policy's 200 ms doubling to 30 s, ±20 %.
pub const CONTROL_RECORD: Backoff = Backoff::doubling(Duration::from_millis(200), Duration::from_secs(30), 0.2);

/// A slot's claim from the broker that failed: 200 ms doubling to 5 s, ±50 %.
pub const CLAIM_FAILED: Backoff = Backoff::doubling(Duration::from_millis(200), Duration::from_secs(5), 0.5);

/// A partition whose consumer could not be reset: 500 ms doubling to 5 s, ±50 %.
pub const PARTITION_RESET: Backoff = Backoff::doubling(Duration::from_millis(500), Duration::from_secs(5), 0.5);

/// A partition restored from its last commit again (its stores' changes could not be
/// kept) after the first restore, which waits for nothing: 100 ms doubling to 30 s, ±20 %.
pub const RESTORE: Backoff = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(30), 0.2);

/// A failed task restarted by its container: 200 ms doubling to 30 s, ±20 %.
pub const TASK_RESTART: Backoff = Backoff::doubling(Duration::from_millis(200), Duration::from_secs(30), 0.2);

/// Exponential backoff with jitter, bounded by a number of attempts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all (the first included) before the message is dead-lettered.
    pub max_attempts: u32,
    /// Wait after the first failure.
    pub initial_backoff: Duration,
    /// Upper bound of a wait.
    pub max_backoff: Duration,
    /// Growth per attempt.
    pub multiplier: f64,
    /// Random spread: a wait is scaled by a factor in `[1 - jitter, 1 + jitter]`.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// The policy's waits as a [`Backoff`].
    pub fn as_backoff(&self) -> Backoff {
        Backoff { first: self.initial_backoff, multiplier: self.multiplier, cap: self.max_backoff, spread: self.jitter }
    }

    /// The wait after failed attempt number `attempt` (1 for the first), jittered by
    /// `sample`, a uniform draw in `[0, 1)`.
    pub fn backoff(&self, attempt: u32, sample: f64) -> Duration {
        self.as_backoff().wait(attempt, sample)
    }

    /// Whether attempt number `attempt` was the last one allowed.
    pub fn exhausted(&self, attempt: u32) -> bool {
        attempt >= self.max_attempts.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn backoff_grows_and_is_capped_with_jitter() {
        let p = RetryPolicy { jitter: 0.0, ..RetryPolicy::default() };
        assert_eq!(p.backoff(1, 0.9), Duration::from_millis(200));
        assert_eq!(p.backoff(2, 0.1), Duration::from_millis(400));
        assert_eq!(p.backoff(3, 0.5), Duration::from_millis(800));
        assert_eq!(p.backoff(40, 0.5), Duration::from_secs(30));
        let j = RetryPolicy::default();
        assert_eq!(j.backoff(1, 0.0), Duration::from_millis(160));
        assert_eq!(j.backoff(1, 0.5), Duration::from_millis(200));
        assert!(j.backoff(1, 0.999_999) <= Duration::from_millis(240));
        assert!(!j.exhausted(2));
        let huge = RetryPolicy { initial_backoff: Duration::MAX, max_backoff: Duration::MAX, ..RetryPolicy::default() };
        assert!(huge.backoff(3, 0.99) > Duration::from_secs(1), "no overflow panic");
        assert!(j.exhausted(3));
    }

    #[test]
    fn the_named_back_offs_keep_the_waits_they_had() {
        // Each was its own formula before; these are the waits those formulas gave.
        assert_eq!(UNAVAILABLE.base(1), Duration::from_millis(200));
        assert_eq!(UNAVAILABLE.base(9), Duration::from_secs(30));
        assert_eq!(RECONNECT.base(1), Duration::from_millis(100));
        assert_eq!(RECONNECT.base(7), Duration::from_secs(5));
        assert_eq!(PARK.base(12), Duration::from_secs(300));
        assert_eq!(CLAIM_FAILED.base(1), Duration::from_millis(200));
        assert_eq!(PARTITION_RESET.base(1), Duration::from_millis(500));
        assert_eq!(PARTITION_RESET.base(5), Duration::from_secs(5));
        assert_eq!(TASK_RESTART.base(1), Duration::from_millis(200));
        assert_eq!(RESTORE.base(1), Duration::from_millis(100));
        assert_eq!(TASK_RESTART.base(20), Duration::from_secs(30));
        assert_eq!(UNAVAILABLE.wait(1, 0.0), Duration::from_millis(100));
        assert_eq!(TASK_RESTART.wait(1, 0.0), Duration::from_millis(160));
    }

    #[test]
    fn nonsense_samples_and_spreads_stay_in_bounds() {
        assert_eq!(jitter_factor(0.5, f64::NAN), 1.0);
        assert_eq!(jitter_factor(f64::INFINITY, 0.3), 1.0);
        assert_eq!(jitter_factor(7.0, 0.0), 0.0);
        assert_eq!(jitter_factor(0.5, -3.0), 0.5);
        assert_eq!(jitter_factor(0.5, 9.0), 1.5);
    }

    proptest! {
        #[test]
        fn a_wait_never_shrinks_with_failures_and_stays_within_its_spread(
            first_ms in 0u64..10_000, cap_ms in 0u64..100_000, multiplier in 0.0f64..8.0,
            spread in 0.0f64..1.0, n in 0u32..200, sample in 0.0f64..1.0,
        ) {
            let b = Backoff { first: Duration::from_millis(first_ms), multiplier, cap: Duration::from_millis(cap_ms), spread };
            prop_assert!(b.base(n + 1) >= b.base(n));
            prop_assert!(b.base(n) <= b.cap);
            let w = b.wait(n, sample).as_secs_f64();
            let base = b.base(n).as_secs_f64();
            prop_assert!(w >= base * (1.0 - spread) - 1e-9 && w <= base * (1.0 + spread) + 1e-9, "{w} outside {base} ± {spread}");
        }
    }
}
