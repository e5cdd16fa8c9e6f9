//! Which panics a node survives.
//!
//! A task's own code — `process`, its hooks, deferred work, blocking work it spawns,
//! the `Deserialize` of its input — runs *supervised*: a panic there is caught and
//! becomes a failed attempt (or a failed task, under its
//! [`FailurePolicy`](crate::FailurePolicy)), and the worker goes on. A panic anywhere
//! else (the run loop's actors, timers, membership) would leave a zombie: a process
//! that keeps renewing its leases while the actor that served them is gone. A node
//! process therefore ends at such a panic, with a non-zero status, so that its leases
//! expire and other nodes take its partitions over. [`in_task_code`] tells the two
//! apart; the node runner's panic hook asks it.

use pin_project_lite::pin_project;
use std::any::Any;
use std::cell::Cell;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

thread_local! {
    /// How deeply this thread is inside supervised task code.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is running a task's own code now (so a panic here is caught
/// and handled by the task's failure policy).
pub fn in_task_code() -> bool {
    DEPTH.with(|d| d.get() > 0)
}

/// What a caught panic carries.
pub type Panic = Box<dyn Any + Send>;

/// Marks the thread as inside task code while alive (also while unwinding).
struct Mark;

impl Mark {
    fn enter() -> Self {
        DEPTH.with(|d| d.set(d.get() + 1));
        Mark
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Runs task code `f`; a panic comes back as `Err`.
///
/// # Errors
/// The panic's payload when `f` panicked.
pub fn supervised<R>(f: impl FnOnce() -> R) -> Result<R, Panic> {
    let _mark = Mark::enter();
    std::panic::catch_unwind(AssertUnwindSafe(f))
}

pin_project! {
    /// A future running task code: each poll is supervised, and a panic ends it with
    /// `Err` (it is not polled again).
    #[must_use = "futures do nothing unless polled"]
    pub struct Supervised<F> {
        #[pin]
        inner: F,
        done: bool,
    }
}

impl<F> Supervised<F> {
    /// Supervises `inner`.
    pub fn new(inner: F) -> Self {
        Self { inner, done: false }
    }
}

impl<F: Future> Future for Supervised<F> {
    type Output = Result<F::Output, Panic>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if *this.done {
            return Poll::Pending;
        }
        let inner = this.inner;
        match supervised(|| inner.poll(cx)) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => {
                *this.done = true;
                Poll::Ready(Ok(v))
            }
            Err(panic) => {
                *this.done = true;
                Poll::Ready(Err(panic))
            }
        }
    }
}

/// The text of a panic's payload.
pub fn panic_text(panic: &Panic) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic payload".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_code_is_marked_while_it_runs_and_its_panics_are_caught() {
        assert!(!in_task_code());
        let inside = supervised(in_task_code).expect("no panic");
        assert!(inside);
        let caught = supervised(|| -> u32 { panic!("boom {}", 7) }).expect_err("caught");
        assert_eq!(panic_text(&caught), "boom 7");
        assert!(!in_task_code(), "the mark is gone after a panic unwound through it");
    }

    #[test]
    fn a_supervised_future_marks_each_poll_and_returns_its_panic() {
        let seen = futures::executor::block_on(Supervised::new(async {
            let first = in_task_code();
            tokio::task::yield_now().await;
            (first, in_task_code())
        }));
        assert_eq!(seen.ok(), Some((true, true)));
        assert!(!in_task_code());
        let panicked = futures::executor::block_on(Supervised::new(async {
            tokio::task::yield_now().await;
            panic!("later");
        }));
        assert_eq!(panicked.map_err(|p| panic_text(&p)).err().as_deref(), Some("later"));
        assert!(!in_task_code());
    }
}
