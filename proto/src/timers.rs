//! Durable timers: when a timer's fire is stale, and the record of a timer's last
//! change.
//!
//! A durable timer's fire is promoted into its partition when due. When the partition
//! lags or is paused, messages already in it run after the promotion but before the
//! fire; one may cancel the timer or arm it again, and then the fire waiting behind is
//! stale: the `timer` hook must not see it. Each arming has an id (the fire's
//! `Flotilla-Arming` header), and the last change to each timer is kept (in the worker's
//! memory, and in the job's `ARMINGS` bucket as the record below).

use bytes::Bytes;

/// The last change to a durable timer: armed again (with the arming's id) or
/// cancelled, and where in the input that happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimerChange {
    /// The arming's id; `None` when cancelled.
    pub arming: Option<String>,
    /// The stream sequence of the input being processed when it was made (`None` in a
    /// hook that runs without one, such as `window`).
    pub at: Option<u64>,
}

impl TimerChange {
    /// Armed (again) with the arming `id`, while processing the input at `at`.
    pub fn armed(id: impl Into<String>, at: Option<u64>) -> Self {
        Self { arming: Some(id.into()), at }
    }

    /// Cancelled while processing the input at `at`.
    pub fn cancelled(at: Option<u64>) -> Self {
        Self { arming: None, at }
    }

    /// Whether the fire of `arming` at stream sequence `seq` is stale after this change.
    pub fn makes_stale(&self, arming: &str, seq: u64) -> bool {
        // Made while processing this fire, or after it: the fire runs again (a crash
        // before its commit), and ran before the change the first time.
        if self.at.is_some_and(|at| at >= seq) {
            return false;
        }
        self.arming.as_deref() != Some(arming)
    }

    /// The record's value: `armed <at> <id>` or `cancelled <at>`, `-` for no position.
    pub fn encode(&self) -> Bytes {
        let at = self.at.map_or_else(|| "-".to_owned(), |at| at.to_string());
        Bytes::from(match &self.arming {
            Some(id) => format!("armed {at} {id}"),
            None => format!("cancelled {at}"),
        })
    }

    /// A record's value; `None` when it is not one.
    pub fn decode(value: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(value).ok()?;
        let mut parts = text.split(' ');
        let (kind, at) = (parts.next()?, parts.next()?);
        let at = if at == "-" { None } else { Some(at.parse().ok()?) };
        let arming = match (kind, parts.next()) {
            ("armed", Some(id)) if !id.is_empty() => Some(id.to_owned()),
            ("cancelled", None) => None,
            _ => return None,
        };
        parts.next().is_none().then_some(Self { arming, at })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fire_is_stale_after_another_arming_or_a_cancel_made_before_its_turn() {
        assert!(!TimerChange::armed("a1", Some(3)).makes_stale("a1", 9), "its own arming is current");
        assert!(TimerChange::armed("a2", Some(7)).makes_stale("a1", 9), "armed again before the fire's turn");
        assert!(TimerChange::cancelled(Some(7)).makes_stale("a1", 9), "cancelled before its turn");
        assert!(TimerChange::armed("a2", None).makes_stale("a1", 9), "armed again in a hook: no position, before");
        assert!(!TimerChange::armed("a2", Some(9)).makes_stale("a1", 9), "armed again by this fire's own hook: it ran");
        assert!(!TimerChange::cancelled(Some(12)).makes_stale("a1", 9), "cancelled after its turn");
    }

    #[test]
    fn records_read_back_as_written_and_anything_else_is_no_record() {
        for change in
            [TimerChange::armed("0190b6a4-7d2c-7c3e-9a51-3f0e8b1c2d4e", Some(17)), TimerChange::armed("x", None)]
        {
            assert_eq!(TimerChange::decode(&change.encode()), Some(change));
        }
        let cancelled = TimerChange::cancelled(Some(4));
        assert_eq!(cancelled.encode(), Bytes::from("cancelled 4"));
        assert_eq!(TimerChange::decode(b"cancelled 4"), Some(cancelled));
        for bad in
            [&b""[..], b"armed", b"armed 3", b"armed x id", b"cancelled", b"cancelled 4 id", b"fired 3 a", b"\xff"]
        {
            assert_eq!(TimerChange::decode(bad), None, "{bad:?}");
        }
    }
}
