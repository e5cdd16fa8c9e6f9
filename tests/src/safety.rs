//! Safety and liveness assertions for the suites CI runs twice on failure (`fault_*`,
//! `cluster`: `.config/nextest.toml`).
//!
//! A **safety** failure is a broken guarantee: a record missing, stored or counted
//! twice, a stale-epoch write accepted, a wrong total, a wrong dead letter. It must fail
//! CI even when the retry passes, so [`safety!`](crate::safety!) and
//! [`safety_eq!`](crate::safety_eq!) first append a line (test, attempt, place, message)
//! to `violations.txt` in the directory named by [`LOG_ENV`] (`scripts/test` sets it
//! and fails the run when that file is not empty), then panic with a message that
//! starts `SAFETY:`.
//!
//! A **liveness** failure is something that did not happen in time (a wait that timed
//! out, a node that did not exit). [`liveness!`](crate::liveness!) panics with a
//! message that starts `LIVENESS:` and records nothing: a retry may pass it, and nextest
//! reports the test as flaky.
//!
//! ```
//! use flotilla_tests::{liveness, safety, safety_eq};
//! let (stored, published) = (3, 3);
//! safety_eq!(stored, published, "every published record is stored once");
//! safety!(stored <= published, "nothing is stored that was never published");
//! liveness!(true, "the node exited within 30 s");
//! ```

use std::io::Write;
use std::path::PathBuf;

/// The environment variable naming the directory where safety violations are written.
pub const LOG_ENV: &str = "FLOTILLA_SAFETY_LOG";
/// The file, in that directory, that holds one line per violation.
pub const LOG_FILE: &str = "violations.txt";

/// Where violations go: `$FLOTILLA_SAFETY_LOG/violations.txt` (a relative directory is
/// taken from the workspace root), or `None` when the variable is unset.
pub fn log_path() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os(LOG_ENV).filter(|v| !v.is_empty())?);
    let dir = if dir.is_absolute() {
        dir
    } else {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(std::path::Path::new(".")).join(dir)
    };
    Some(dir.join(LOG_FILE))
}

/// The running test: nextest's `NEXTEST_BINARY_ID` and `NEXTEST_TEST_NAME`, else the
/// test thread's name.
fn test_name() -> String {
    let name = std::env::var("NEXTEST_TEST_NAME")
        .ok()
        .or_else(|| std::thread::current().name().map(str::to_owned))
        .unwrap_or_else(|| "(unknown test)".to_owned());
    match std::env::var("NEXTEST_BINARY_ID") {
        Ok(binary) => format!("{binary} {name}"),
        Err(_) => name,
    }
}

/// The line [`violated`] writes: test, attempt, place and the message's first line
/// (at most 400 characters: messages often carry node logs after it).
pub fn violation_line(test: &str, attempt: Option<&str>, place: &str, message: &str) -> String {
    let first: String = message.lines().next().unwrap_or_default().chars().take(400).collect();
    let attempt = attempt.map(|a| format!(" (attempt {a})")).unwrap_or_default();
    format!("{test}{attempt} at {place}: {first}\n")
}

/// `message` with ` (left: …, right: …)` at the end of its first line (what follows,
/// often node logs, stays after it).
pub fn with_values(message: &str, left: &str, right: &str) -> String {
    let (first, rest) = message.split_once('\n').map_or((message, None), |(f, r)| (f, Some(r)));
    let mut out = format!("{first} (left: {left}, right: {right})");
    if let Some(rest) = rest {
        out.push('\n');
        out.push_str(rest);
    }
    out
}

/// Records a safety violation (see the [module docs](self)) and panics with
/// `SAFETY: <message>`. Called by [`safety!`](crate::safety!) and
/// [`safety_eq!`](crate::safety_eq!).
///
/// # Panics
/// Always.
#[track_caller]
pub fn violated(place: &str, message: &str) -> ! {
    if let Some(path) = log_path() {
        let line = violation_line(&test_name(), std::env::var("NEXTEST_ATTEMPT").ok().as_deref(), place, message);
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(&path))
            // One write of the whole line: appends from parallel tests do not interleave.
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            eprintln!("cannot record the safety violation in {}: {e}", path.display());
        }
    }
    panic!("SAFETY: {message}");
}

/// Asserts a safety invariant: when `cond` is false, records the violation for CI and
/// panics with `SAFETY: <message>` (see the [module docs](mod@crate::safety)).
#[macro_export]
macro_rules! safety {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            $crate::safety::violated(concat!(file!(), ":", line!()), &format!($($arg)+));
        }
    };
}

/// Asserts that two values are equal as a safety invariant, showing both when they are
/// not (see [`safety!`](crate::safety!)).
#[macro_export]
macro_rules! safety_eq {
    ($left:expr, $right:expr, $($arg:tt)+) => {
        match (&$left, &$right) {
            (left, right) => {
                if !(*left == *right) {
                    $crate::safety::violated(
                        concat!(file!(), ":", line!()),
                        &$crate::safety::with_values(&format!($($arg)+), &format!("{left:?}"), &format!("{right:?}")),
                    );
                }
            }
        }
    };
}

/// Asserts a liveness property (something happened in time): panics with
/// `LIVENESS: <message>` and records nothing, so a retry may pass it.
#[macro_export]
macro_rules! liveness {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            panic!("LIVENESS: {}", format!($($arg)+));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_violation_line_is_one_line_naming_test_attempt_and_place() {
        let line = violation_line("t::x", Some("2"), "tests/a.rs:3", "lost 4 records\n----- node a -----\nlog");
        assert_eq!(line, "t::x (attempt 2) at tests/a.rs:3: lost 4 records\n");
        let long = violation_line("t", None, "p", &"x".repeat(1000));
        assert_eq!(long.len(), "t at p: ".len() + 400 + 1);
        assert_eq!(with_values("lost\nlogs", "1", "2"), "lost (left: 1, right: 2)\nlogs");
        assert_eq!(with_values("lost", "1", "2"), "lost (left: 1, right: 2)");
    }
}
