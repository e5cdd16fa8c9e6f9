//! Job and stream names, and the rule they follow.
//!
//! Names appear inside NATS subjects (`flotilla.<job>.<stream>`), JetStream stream
//! names (`FLOTILLA_<job>_<stream>`) and KV bucket names, so they are restricted to
//! characters that are valid and unambiguous in all three.

use std::fmt;

/// The longest job or stream name accepted.
pub const MAX_NAME_LEN: usize = 64;

/// The rule every job and stream name follows, as shown in errors.
pub const NAME_RULE: &str = "1 to 64 characters from [a-z0-9-] (lowercase ASCII letters, digits and '-'); a leading '_' is reserved for Flotilla";

/// A name that breaks [`NAME_RULE`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} name {name:?}: {problem}; the rule is {NAME_RULE}")]
pub struct NameError {
    /// What was being named: `job` or `stream`.
    pub what: &'static str,
    /// The name as given.
    pub name: String,
    /// Which part of the rule it breaks.
    pub problem: String,
}

/// Checks `name` against [`NAME_RULE`]; `what` (`"job"`, `"stream"`) goes into the error.
///
/// # Errors
/// [`NameError`] naming the first offending character or the length problem.
pub fn validate_name(what: &'static str, name: &str) -> Result<(), NameError> {
    let err = |problem: String| NameError { what, name: name.to_owned(), problem };
    if name.is_empty() {
        return Err(err("it is empty".into()));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(err(format!("it is {} bytes long", name.len())));
    }
    if name.starts_with('_') {
        return Err(err("a leading '_' is reserved for Flotilla's own subjects".into()));
    }
    if let Some((i, c)) =
        name.char_indices().find(|(_, c)| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(err(format!("character {c:?} at byte {i} is not allowed")));
    }
    Ok(())
}

/// A validated job name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobName(String);

impl JobName {
    /// Validates and wraps a job name.
    ///
    /// # Errors
    /// [`NameError`] when `name` breaks [`NAME_RULE`].
    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        validate_name("job", &name)?;
        Ok(Self(name))
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A validated stream name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamName(String);

impl StreamName {
    /// Validates and wraps a stream name.
    ///
    /// # Errors
    /// [`NameError`] when `name` breaks [`NAME_RULE`].
    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        validate_name("stream", &name)?;
        Ok(Self(name))
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StreamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_lowercase_digits_and_dashes() {
        for ok in ["relay", "relay-in", "a", "0", "word-count-2", &"x".repeat(64)] {
            assert!(JobName::new(ok).is_ok(), "{ok}");
            assert!(StreamName::new(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn refuses_and_names_the_rule() {
        for (bad, needle) in [
            ("", "empty"),
            ("Relay", "'R'"),
            ("relay.in", "'.'"),
            ("relay_in", "'_'"),
            ("_dlq", "reserved"),
            ("a b", "' '"),
            ("relay>", "'>'"),
            ("ü", "'ü'"),
        ] {
            let err = StreamName::new(bad).expect_err(bad).to_string();
            assert!(err.contains(needle), "{err}");
            assert!(err.contains("[a-z0-9-]"), "{err}");
        }
        let long = "x".repeat(65);
        assert!(JobName::new(long).expect_err("too long").to_string().contains("65 bytes"));
    }
}
