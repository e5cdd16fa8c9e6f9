//! Retry policy: how often a failing message is tried, and how long to wait between.

use rand::Rng;
use std::time::Duration;

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
    /// The wait after failed attempt number `attempt` (1 for the first).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.multiplier.max(1.0).powi(attempt.saturating_sub(1).min(64) as i32);
        let base = self.initial_backoff.as_secs_f64() * exp;
        let capped = base.min(self.max_backoff.as_secs_f64());
        let jitter = self.jitter.clamp(0.0, 1.0);
        let factor = if jitter > 0.0 { rand::rng().random_range(1.0 - jitter..=1.0 + jitter) } else { 1.0 };
        Duration::try_from_secs_f64((capped * factor).max(0.0)).unwrap_or(self.max_backoff)
    }

    /// Whether attempt number `attempt` was the last one allowed.
    pub fn exhausted(&self, attempt: u32) -> bool {
        attempt >= self.max_attempts.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped_with_jitter() {
        let p = RetryPolicy { jitter: 0.0, ..RetryPolicy::default() };
        assert_eq!(p.backoff(1), Duration::from_millis(200));
        assert_eq!(p.backoff(2), Duration::from_millis(400));
        assert_eq!(p.backoff(3), Duration::from_millis(800));
        assert_eq!(p.backoff(40), Duration::from_secs(30));
        let j = RetryPolicy::default();
        for _ in 0..100 {
            let d = j.backoff(1);
            assert!(d >= Duration::from_millis(160) && d <= Duration::from_millis(240), "{d:?}");
        }
        assert!(!j.exhausted(2));
        let huge = RetryPolicy { initial_backoff: Duration::MAX, max_backoff: Duration::MAX, ..RetryPolicy::default() };
        assert!(huge.backoff(3) > Duration::from_secs(1), "no overflow panic");
        assert!(j.exhausted(3));
    }
}
