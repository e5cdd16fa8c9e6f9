//! A partition's fence: whether this node may still act for it (DESIGN §7). The lease
//! holder pushes it out on each renewal and revokes it when the lease is lost; the
//! partition's worker and the container check it before acting.

use std::sync::{Arc, Mutex, PoisonError};
use tokio::time::Instant;

/// Whether a node may still act for a partition: valid until a deadline that each
/// lease renewal pushes out, revoked at once when the lease is lost. Shared between
/// the lease holder and the partition's worker.
#[derive(Clone, Default)]
pub struct Fence(Arc<Mutex<Option<Instant>>>);

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fence(valid: {})", self.valid())
    }
}

impl Fence {
    /// A fence valid until `until`.
    pub fn until(until: Instant) -> Self {
        Self(Arc::new(Mutex::new(Some(until))))
    }

    fn get(&self) -> Option<Instant> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether work for the partition may go on now.
    pub fn valid(&self) -> bool {
        self.get().is_some_and(|t| Instant::now() < t)
    }

    /// Pushes the deadline out (never back).
    pub fn extend(&self, until: Instant) {
        let mut guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = *guard {
            *guard = Some(t.max(until));
        }
    }

    /// The lease is lost: nothing more for this partition.
    pub fn revoke(&self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn fence_expires_extends_and_revokes() {
        let f = Fence::until(Instant::now() + Duration::from_secs(2));
        assert!(f.valid());
        f.extend(Instant::now() + Duration::from_secs(4));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(f.valid());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!f.valid());
        let g = Fence::until(Instant::now() + Duration::from_secs(10));
        g.revoke();
        assert!(!g.valid());
        g.extend(Instant::now() + Duration::from_secs(10));
        assert!(!g.valid(), "a revoked fence stays revoked");
    }
}
