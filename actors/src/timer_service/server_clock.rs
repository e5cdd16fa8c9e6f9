//! An estimate of the NATS server's clock, so that delayed messages are judged on the
//! clock that stamped them.
//!
//! A delayed message is due `delay` after the server stored it (the stream message's
//! timestamp is the server's clock). Judged against the node's own clock, a node whose
//! clock runs 90 s ahead promotes it up to 90 s early, and one 90 s behind holds it
//! 90 s too long. The timer service probes the server instead: it writes the key
//! [`CLOCK_KEY`] in the job's CONTROL bucket and reads back the timestamp the server
//! stored with it. The server stamped it between sending and receiving the reply, so
//! `offset = server_time − (sent + received) / 2`, within half the round trip, and the
//! server's time now is the local time plus that offset.
//!
//! Plain data: the probe's I/O lives in the timer service.

use std::time::{Duration, SystemTime};

/// The key probes write in the job's CONTROL bucket.
pub const CLOCK_KEY: &str = "clock";
/// How often the timer service probes (also once at start).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(60);
/// A probe whose round trip took longer than this says too little about the offset: it
/// is ignored.
pub const MAX_ROUND_TRIP: Duration = Duration::from_secs(2);
/// How long an estimate is used after the last good probe; after that (every probe
/// failing) the node falls back to its own clock.
pub const MAX_AGE: Duration = Duration::from_secs(5 * 60);

/// One probe: local times around a write, and the server's timestamp of that write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// Local time just before the write was sent.
    pub sent: SystemTime,
    /// Local time just after its acknowledgement arrived.
    pub received: SystemTime,
    /// The time the server stored with the write.
    pub server: SystemTime,
}

impl Probe {
    /// The server's clock minus the local one, in milliseconds (positive: the server is
    /// ahead), or `None` when the probe is unusable: the local clock went backwards
    /// during it, or the round trip was longer than [`MAX_ROUND_TRIP`].
    pub fn offset_ms(&self) -> Option<i64> {
        let round_trip = self.received.duration_since(self.sent).ok()?;
        if round_trip > MAX_ROUND_TRIP {
            return None;
        }
        let midpoint = self.sent.checked_add(round_trip / 2)?;
        Some(match self.server.duration_since(midpoint) {
            Ok(ahead) => i64::try_from(ahead.as_millis()).ok()?,
            Err(behind) => -i64::try_from(behind.duration().as_millis()).ok()?,
        })
    }
}

/// The current estimate of the server's clock; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerClock {
    /// The offset (ms) and the local time of the probe that measured it.
    estimate: Option<(i64, SystemTime)>,
}

impl ServerClock {
    /// Takes a probe's result into account; the offset it measured, if it was usable
    /// (an unusable probe leaves the estimate as it was).
    pub fn observe(&mut self, probe: &Probe) -> Option<i64> {
        let offset = probe.offset_ms()?;
        self.estimate = Some((offset, probe.received));
        Some(offset)
    }

    /// The offset (ms) in use at local time `local`: `None` when there is no estimate,
    /// or it is older than [`MAX_AGE`] (the node then uses its own clock).
    pub fn offset_ms(&self, local: SystemTime) -> Option<i64> {
        let (offset, at) = self.estimate?;
        // A local clock stepped back since the probe reads as age zero.
        let age = local.duration_since(at).unwrap_or_default();
        (age <= MAX_AGE).then_some(offset)
    }

    /// The server's time when the local clock reads `local`: `local` corrected by the
    /// offset, or `local` itself without a usable estimate.
    pub fn now(&self, local: SystemTime) -> SystemTime {
        match self.offset_ms(local) {
            Some(ms) if ms >= 0 => local.checked_add(Duration::from_millis(ms.unsigned_abs())).unwrap_or(local),
            Some(ms) => local.checked_sub(Duration::from_millis(ms.unsigned_abs())).unwrap_or(local),
            None => local,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_000 + ms)
    }

    #[test]
    fn the_offset_is_measured_from_the_midpoint_of_the_round_trip() {
        // Local 0 → 40 ms; the server stamped the write at local 20 ms + 90 s.
        let ahead = Probe { sent: at(0), received: at(40), server: at(90_020) };
        assert_eq!(ahead.offset_ms(), Some(90_000));
        let behind = Probe { sent: at(100_000), received: at(100_010), server: at(10_005) };
        assert_eq!(behind.offset_ms(), Some(-90_000));
        let same = Probe { sent: at(5), received: at(5), server: at(5) };
        assert_eq!(same.offset_ms(), Some(0));
    }

    #[test]
    fn unusable_probes_change_nothing() {
        let mut clock = ServerClock::default();
        assert_eq!(clock.observe(&Probe { sent: at(0), received: at(10), server: at(5_005) }), Some(5_000));
        let backwards = Probe { sent: at(50), received: at(10), server: at(0) };
        let slow = Probe { sent: at(0), received: at(3_000), server: at(0) };
        assert_eq!(clock.observe(&backwards), None);
        assert_eq!(clock.observe(&slow), None);
        assert_eq!(clock.offset_ms(at(20)), Some(5_000), "the last good estimate stays");
    }

    #[test]
    fn now_is_the_local_clock_corrected_or_the_local_clock_alone() {
        let mut clock = ServerClock::default();
        assert_eq!(clock.now(at(1_000)), at(1_000), "no probe yet: the local clock");
        clock.observe(&Probe { sent: at(100_000), received: at(100_000), server: at(10_000) });
        assert_eq!(clock.now(at(100_500)), at(10_500), "a node 90 s ahead reads the server's time");
        clock.observe(&Probe { sent: at(0), received: at(0), server: at(90_000) });
        assert_eq!(clock.now(at(1_000)), at(91_000), "a node 90 s behind too");
        let stale = at(1_000) + MAX_AGE + Duration::from_secs(1);
        assert_eq!(clock.now(stale), stale, "an estimate older than MAX_AGE is dropped");
    }
}
