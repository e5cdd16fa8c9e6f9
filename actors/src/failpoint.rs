//! Failpoints: crash the process at a chosen point, for the fault-matrix tests.
//!
//! `FLOTILLA_FAILPOINT=<point>:<n>` makes the process abort (`std::process::abort`, as a
//! kill -9 or an out-of-memory kill would end it: no destructors, no acks, no lease
//! release) the `n`-th time it reaches `<point>`. The variable is read once; when it is
//! unset, [`hit`] costs one atomic load and a branch.
//!
//! | point | where |
//! |---|---|
//! | `effects-stored-before-ack` | a task worker has its outputs' publish acks back and is about to acknowledge the input: ordered inputs before the cumulative ack of a commit, queue inputs before the message's ack |
//! | `state-records-stored` | a task with stores has written a flush's changelog records and not yet its commit record |
//! | `state-committed-before-ack` | a task with stores has written a flush's commit record and not yet acknowledged the inputs it covers |
//!
//! A value that does not parse is reported once (a warning) and arms nothing.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that arms a failpoint.
pub const ENV: &str = "FLOTILLA_FAILPOINT";

/// A place in the code where a failpoint can fire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// Outputs stored, input not yet acknowledged.
    EffectsStoredBeforeAck,
    /// A state flush's records stored, its commit record not yet written.
    StateRecordsStored,
    /// A state flush's commit record stored, its inputs not yet acknowledged.
    StateCommittedBeforeAck,
}

impl Point {
    /// The point's name in [`ENV`].
    pub fn name(self) -> &'static str {
        match self {
            Point::EffectsStoredBeforeAck => "effects-stored-before-ack",
            Point::StateRecordsStored => "state-records-stored",
            Point::StateCommittedBeforeAck => "state-committed-before-ack",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Point::EffectsStoredBeforeAck, Point::StateRecordsStored, Point::StateCommittedBeforeAck]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

/// An armed failpoint: fire at the `at`-th hit of `point` (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// Where.
    pub point: Point,
    /// Which hit fires (1 = the first).
    pub at: u64,
}

/// Reads a value of [`ENV`]: `<point>:<n>` with `n` ≥ 1.
///
/// # Errors
/// What is wrong with it, naming the known points.
pub fn parse(value: &str) -> Result<Spec, String> {
    let known = || {
        [Point::EffectsStoredBeforeAck, Point::StateRecordsStored, Point::StateCommittedBeforeAck]
            .map(Point::name)
            .join(", ")
    };
    let (name, n) = value
        .trim()
        .split_once(':')
        .ok_or_else(|| format!("{ENV}={value:?}: write <point>:<n>, e.g. effects-stored-before-ack:3"))?;
    let point = Point::from_name(name)
        .ok_or_else(|| format!("{ENV}={value:?}: unknown point {name:?} (known: {})", known()))?;
    match n.parse::<u64>() {
        Ok(at) if at >= 1 => Ok(Spec { point, at }),
        _ => Err(format!("{ENV}={value:?}: {n:?} is not a count of 1 or more")),
    }
}

/// Counts hits and says when to fire: plain data, so the rule is tested without
/// aborting anything.
#[derive(Debug)]
pub struct Armed {
    spec: Spec,
    hits: AtomicU64,
}

impl Armed {
    /// Armed as `spec` says, with no hits yet.
    pub fn new(spec: Spec) -> Self {
        Self { spec, hits: AtomicU64::new(0) }
    }

    /// Counts a hit of `point`; whether this is the one that fires.
    pub fn hit(&self, point: Point) -> bool {
        point == self.spec.point && self.hits.fetch_add(1, Ordering::Relaxed) + 1 == self.spec.at
    }
}

static ARMED: OnceLock<Option<Armed>> = OnceLock::new();

fn from_env() -> Option<Armed> {
    let value = std::env::var(ENV).ok()?;
    match parse(&value) {
        Ok(spec) => {
            tracing::warn!(point = spec.point.name(), at = spec.at, "failpoint armed: this process will abort there");
            Some(Armed::new(spec))
        }
        Err(problem) => {
            tracing::warn!(%problem, "failpoint not armed");
            None
        }
    }
}

/// Marks that the process reached `point`: aborts it if this is the armed hit.
#[inline]
pub fn hit(point: Point) {
    if let Some(armed) = ARMED.get_or_init(from_env)
        && armed.hit(point)
    {
        eprintln!("flotilla: failpoint {}:{} fired; aborting", point.name(), armed.spec.at);
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_read_strictly() {
        assert_eq!(parse("effects-stored-before-ack:3"), Ok(Spec { point: Point::EffectsStoredBeforeAck, at: 3 }));
        for bad in
            ["effects-stored-before-ack", "effects-stored-before-ack:0", "effects-stored-before-ack:x", "nope:1", ""]
        {
            let err = parse(bad).expect_err(bad);
            assert!(err.contains(ENV), "{err}");
        }
        assert!(parse("nope:1").expect_err("unknown").contains("effects-stored-before-ack"), "names the known points");
    }

    #[test]
    fn only_the_nth_hit_fires() {
        let armed = Armed::new(Spec { point: Point::EffectsStoredBeforeAck, at: 3 });
        let fired: Vec<bool> = (0..5).map(|_| armed.hit(Point::EffectsStoredBeforeAck)).collect();
        assert_eq!(fired, [false, false, true, false, false]);
    }
}
