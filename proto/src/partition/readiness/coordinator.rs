//! Shutdown requests: what a task may ask of its container, and when the container
//! stops because of them.

use std::collections::BTreeSet;

/// Scope of a task's shutdown request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShutdownScope {
    /// Stop this task; the container stops once every task asked.
    CurrentTask,
    /// Stop the whole container.
    AllTasksInContainer,
}

/// Shutdown requests of the tasks in one container (the reference's
/// `CoordinatorRequests`): the container stops when any task asks for all, or when
/// every task asked for itself.
#[derive(Debug, Default)]
pub struct CoordinatorRequests<K: Ord> {
    tasks: BTreeSet<K>,
    asked: BTreeSet<K>,
    all: bool,
}

impl<K: Ord + Clone> CoordinatorRequests<K> {
    /// Requests over these tasks.
    pub fn new(tasks: impl IntoIterator<Item = K>) -> Self {
        Self { tasks: tasks.into_iter().collect(), asked: BTreeSet::new(), all: false }
    }

    /// A task asked to shut down.
    pub fn request(&mut self, task: K, scope: ShutdownScope) {
        match scope {
            ShutdownScope::CurrentTask => {
                self.asked.insert(task);
            }
            ShutdownScope::AllTasksInContainer => self.all = true,
        }
    }

    /// Whether `task` asked to stop.
    pub fn asked(&self, task: &K) -> bool {
        self.all || self.asked.contains(task)
    }

    /// Whether the container should stop now.
    pub fn should_shutdown(&self) -> bool {
        self.all || (!self.tasks.is_empty() && self.tasks.iter().all(|t| self.asked.contains(t)))
    }
}
