//! The changelog's records as plain data: how a key's record and a partition's commit
//! record are encoded, which value of a key a restore takes ([`Resolution`]), the claim a
//! new writer makes, and the changelog's key names.

use serde::{Deserialize, Serialize};

/// One key's changelog record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The writer's generation (one per restore of the partition).
    pub generation: u64,
    /// The writer's flush number within its generation (from 1; 0 for what a restore
    /// writes).
    pub flush: u64,
    /// The value written; `None` for a delete.
    pub value: Option<bytes::Bytes>,
    /// The key's value at the writer's last commit (what a restore takes when this
    /// record's flush never completed).
    pub committed: Option<bytes::Bytes>,
}

const RECORD_VERSION: u8 = 1;

impl Record {
    /// The record's bytes: version, generation, flush, then each value as a presence
    /// byte and a length-prefixed body.
    pub fn encode(&self) -> bytes::Bytes {
        let len =
            18 + self.value.as_ref().map_or(0, |v| v.len() + 4) + self.committed.as_ref().map_or(0, |v| v.len() + 4);
        let mut out = Vec::with_capacity(len);
        out.push(RECORD_VERSION);
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.flush.to_le_bytes());
        for v in [&self.value, &self.committed] {
            match v {
                None => out.push(0),
                Some(v) => {
                    out.push(1);
                    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                    out.extend_from_slice(v);
                }
            }
        }
        out.into()
    }

    /// Reads a record.
    ///
    /// # Errors
    /// What is wrong with the bytes.
    pub fn decode(bytes: &bytes::Bytes) -> Result<Self, String> {
        let mut at = 0usize;
        let take = |at: &mut usize, n: usize| -> Result<bytes::Bytes, String> {
            if bytes.len() < *at + n {
                return Err(format!("record cut short at byte {} of {}", *at, bytes.len()));
            }
            let b = bytes.slice(*at..*at + n);
            *at += n;
            Ok(b)
        };
        let version = take(&mut at, 1)?[0];
        if version != RECORD_VERSION {
            return Err(format!("record version {version} is not {RECORD_VERSION}"));
        }
        let u64_at = |b: bytes::Bytes| u64::from_le_bytes(b.as_ref().try_into().unwrap_or([0; 8]));
        let generation = u64_at(take(&mut at, 8)?);
        let flush = u64_at(take(&mut at, 8)?);
        let mut values = [None, None];
        for v in &mut values {
            match take(&mut at, 1)?[0] {
                0 => {}
                1 => {
                    let n = u32::from_le_bytes(take(&mut at, 4)?.as_ref().try_into().unwrap_or([0; 4])) as usize;
                    *v = Some(take(&mut at, n)?);
                }
                other => return Err(format!("record presence byte {other} is not 0 or 1")),
            }
        }
        let [value, committed] = values;
        if at != bytes.len() {
            return Err(format!("{} bytes after the record", bytes.len() - at));
        }
        Ok(Self { generation, flush, value, committed })
    }
}

/// A partition's commit record: what its last complete flush was.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CommitRecord {
    /// The generation of the writer that made it.
    pub generation: u64,
    /// That writer's last complete flush (0: none yet; the claim at restore).
    pub flush: u64,
    /// The stream sequence of the last input the state reflects: inputs up to it are
    /// applied, and are skipped when they come again.
    pub position: u64,
    /// Hooks that ran at `position` and whose changes the state holds: the next hook
    /// there derives its output ids from this count on, so it never reuses theirs.
    #[serde(default)]
    pub hooks: u32,
    /// The lease epoch of the writer (for people reading it; the compare-and-set fences).
    pub epoch: u64,
    /// The last complete flush of each earlier generation whose records are still the
    /// latest of some key.
    pub earlier: Vec<(u64, u64)>,
}

impl CommitRecord {
    /// The last complete flush of `generation`, if it is known.
    pub fn bound(&self, generation: u64) -> Option<u64> {
        if generation == self.generation {
            return Some(self.flush);
        }
        self.earlier.iter().find(|(g, _)| *g == generation).map(|(_, f)| *f)
    }

    /// Whether `record` belongs to a complete flush.
    pub fn covers(&self, record: &Record) -> bool {
        self.bound(record.generation).is_some_and(|bound| record.flush <= bound)
    }
}

/// Which value a restore takes for one key, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The record's flush completed: its value (`None`: deleted).
    Written(Option<bytes::Bytes>),
    /// The record's flush never completed (interrupted, or a stale owner's): the
    /// value the key had at its writer's last commit.
    Committed(Option<bytes::Bytes>),
}

impl Resolution {
    /// The value a restore takes (`None`: the key is absent).
    pub fn value(&self) -> Option<&bytes::Bytes> {
        match self {
            Resolution::Written(v) | Resolution::Committed(v) => v.as_ref(),
        }
    }
}

/// The value of a key whose latest record is `record`, under `commit`.
pub fn resolve(commit: &CommitRecord, record: &Record) -> Resolution {
    if commit.covers(record) {
        Resolution::Written(record.value.clone())
    } else {
        Resolution::Committed(record.committed.clone())
    }
}

/// The commit record a new writer claims the partition with, after reading `previous`
/// and resolving every key: its generation follows, and it keeps the bounds of the
/// earlier generations whose records are still taken as written (`referenced`).
pub fn claim(previous: &CommitRecord, referenced: impl IntoIterator<Item = u64>, epoch: u64) -> CommitRecord {
    let mut earlier: Vec<(u64, u64)> = Vec::new();
    for g in referenced {
        if earlier.iter().any(|(e, _)| *e == g) {
            continue;
        }
        if let Some(bound) = previous.bound(g) {
            earlier.push((g, bound));
        }
    }
    earlier.sort_unstable();
    CommitRecord {
        generation: previous.generation + 1,
        flush: 0,
        position: previous.position,
        hooks: previous.hooks,
        epoch,
        earlier,
    }
}

/// The changelog key of a store key.
pub fn record_key(prefix: &str, store: &str, key_hex: &str) -> String {
    format!("{prefix}.{store}.{key_hex}")
}

/// The changelog key of a partition's commit record.
pub fn commit_key(prefix: &str) -> String {
    format!("{prefix}._commit")
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// The bytes of lowercase hex `s`.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    s.as_bytes().chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(generation: u64, flush: u64, value: Option<&str>, committed: Option<&str>) -> Record {
        Record {
            generation,
            flush,
            value: value.map(|v| bytes::Bytes::from(v.to_owned())),
            committed: committed.map(|v| bytes::Bytes::from(v.to_owned())),
        }
    }

    #[test]
    fn records_round_trip_and_bad_bytes_are_named() {
        for r in [rec(3, 7, Some("new"), Some("old")), rec(0, 0, None, None), rec(1, 2, None, Some(""))] {
            assert_eq!(Record::decode(&r.encode()).expect("decodes"), r);
        }
        let good = rec(1, 1, Some("v"), None).encode();
        assert!(Record::decode(&good.slice(..good.len() - 1)).unwrap_err().contains("cut short"));
        let mut bad = good.to_vec();
        bad[0] = 9;
        assert!(Record::decode(&bad.into()).unwrap_err().contains("version 9"));
    }

    #[test]
    fn an_interrupted_flush_resolves_to_the_committed_value() {
        let commit = CommitRecord { generation: 2, flush: 5, position: 100, hooks: 0, epoch: 9, earlier: vec![(1, 3)] };
        // The current writer's complete flushes.
        assert_eq!(resolve(&commit, &rec(2, 5, Some("b"), Some("a"))), Resolution::Written(Some("b".into())));
        // Its flush 6 never got its commit record.
        assert_eq!(resolve(&commit, &rec(2, 6, Some("c"), Some("b"))), Resolution::Committed(Some("b".into())));
        // An earlier writer's complete and incomplete flushes.
        assert_eq!(resolve(&commit, &rec(1, 3, None, Some("x"))), Resolution::Written(None));
        assert_eq!(resolve(&commit, &rec(1, 4, Some("y"), None)), Resolution::Committed(None));
        // A generation the commit record does not know wrote after the claim that
        // dropped it: a stale owner's write.
        assert_eq!(resolve(&commit, &rec(0, 1, Some("z"), Some("w"))), Resolution::Committed(Some("w".into())));
    }

    #[test]
    fn a_claim_keeps_the_bounds_of_referenced_generations_only() {
        let previous = CommitRecord {
            generation: 4,
            flush: 12,
            position: 77,
            hooks: 2,
            epoch: 3,
            earlier: vec![(1, 2), (2, 9), (3, 1)],
        };
        let claimed = claim(&previous, [4, 2, 4, 7], 11);
        assert_eq!(
            claimed,
            CommitRecord { generation: 5, flush: 0, position: 77, hooks: 2, epoch: 11, earlier: vec![(2, 9), (4, 12)] }
        );
        // What generation 4 wrote past its flush 12 stays invisible after the claim.
        assert!(!claimed.covers(&rec(4, 13, Some("v"), None)));
        assert!(claimed.covers(&rec(4, 12, Some("v"), None)));
        assert!(claimed.covers(&rec(5, 0, Some("repair"), None)));
        assert!(!claimed.covers(&rec(5, 1, Some("next"), None)));
    }

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&bytes)).expect("hex"), bytes);
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("abc"), None);
    }
}
