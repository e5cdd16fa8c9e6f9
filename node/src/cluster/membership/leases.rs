//! Keeping the node's registration and its leases: the heartbeat, renewals by
//! compare-and-set, self-fencing, acquiring through the reaper, handing over and
//! deleting.

use super::{Held, Membership, Part};
use actix::prelude::*;
use bytes::Bytes;
use flotilla_actors::container::{AddSlot, ReleaseSlot};
use flotilla_actors::events::{Event, emit};
use flotilla_actors::fence::Fence;
use flotilla_actors::reaper::AcquireLease;
use flotilla_proto::cluster::control::{LeaseRecord, NodeRecord, decode, keys};
use flotilla_transport::broker::{BrokerError, CoreMessage, SharedBroker};
use tokio::time::Instant;
use tracing::{debug, info, warn};

impl Membership {
    pub(super) fn heartbeat(&mut self, ctx: &mut Context<Self>) {
        if self.beating {
            return;
        }
        self.beating = true;
        let broker = self.s.broker.clone();
        let (bucket, node, value) = (self.buckets.nodes.clone(), self.s.node.clone(), self.s.node_value.clone());
        let registered = self.registered;
        let revision = self.s.node_revision;
        let fut = async move {
            if registered {
                broker.kv_update(&bucket, &node, value, revision).await.map(|r| (r, false))
            } else {
                broker.kv_create(&bucket, &node, value).await.map(|r| (r, true))
            }
        };
        ctx.spawn(fut.into_actor(self).map(move |result, act, _| {
            act.beating = false;
            match result {
                Ok((rev, rejoined)) => {
                    act.s.node_revision = rev;
                    if rejoined {
                        info!(node = %act.s.node, "registered again");
                        act.registered = true;
                    }
                }
                Err(BrokerError::KvWrongRevision { .. } | BrokerError::KvKeyExists { .. }) if registered => {
                    warn!(node = %act.s.node, "membership lost (heartbeat refused): stopping every partition and registering again");
                    act.registered = false;
                    let parts: Vec<Part> = act.held.keys().cloned().collect();
                    for part in parts {
                        act.lose(&part, "membership lost");
                    }
                }
                Err(e) => debug!(error = %e, "heartbeat failed; retrying"),
            }
        }));
    }

    /// Renews every held lease (on each renewal tick, a quarter of the TTL).
    pub(super) fn renew_all(&mut self, ctx: &mut Context<Self>) {
        let due: Vec<Part> = self.held.iter().filter(|(_, h)| !h.renewing).map(|(p, _)| p.clone()).collect();
        for part in due {
            self.renew(part, ctx);
        }
    }

    /// Renews one lease by compare-and-set. A renewal that takes longer than a sixth of
    /// the TTL is abandoned and tried again on the next beat, so one lost request does
    /// not let the fence run out. A refused one whose write did land (the reply was
    /// lost) is recognised by re-reading the key: it still names this node and epoch.
    pub(super) fn renew(&mut self, part: Part, ctx: &mut Context<Self>) {
        let Some(h) = self.held.get_mut(&part) else { return };
        h.renewing = true;
        let epoch = h.epoch;
        let value = self.lease_value(epoch);
        let Some(h) = self.held.get_mut(&part) else { return };
        let (broker, bucket, key) = (self.s.broker.clone(), self.buckets.leases.clone(), keys::lease(&part.0, part.1));
        let (node, incarnation) = (self.s.node.clone(), self.s.incarnation.clone());
        let update = broker.kv_update(&bucket, &key, value, h.revision);
        let limit = self.s.config.lease_ttl / 6;
        let fut = async move {
            match tokio::time::timeout(limit, update).await {
                Err(_) => Err(BrokerError::TimedOut { operation: format!("renew lease {key}"), after: limit }),
                Ok(Err(BrokerError::KvWrongRevision { .. })) => match broker.kv_get(&bucket, &key).await {
                    Ok(Some(e))
                        if decode::<LeaseRecord>(&key, &e.value)
                            .is_ok_and(|r| r.held_by(&node, &incarnation) && r.epoch == epoch) =>
                    {
                        Ok((e.revision, false))
                    }
                    Ok(_) => Err(BrokerError::KvWrongRevision { bucket, key, expected: 0 }),
                    Err(e) => Err(e),
                },
                Ok(result) => result.map(|rev| (rev, true)),
            }
        };
        let sent = Instant::now();
        ctx.spawn(fut.into_actor(self).map(move |result, act, _| {
            let until = act.valid_after(sent);
            let took = sent.elapsed();
            if took > act.s.config.lease_ttl / 6 {
                warn!(stream = %part.0, partition = part.1, ?took, "lease renewal was slow");
            }
            let Some(h) = act.held.get_mut(&part) else { return };
            h.renewing = false;
            match result {
                Ok((rev, renewed)) => {
                    h.revision = rev;
                    if renewed {
                        h.fence.extend(until);
                    }
                }
                Err(BrokerError::KvWrongRevision { .. } | BrokerError::KvKeyExists { .. }) => {
                    act.lose(&part, "lease renewal refused");
                }
                Err(e) => {
                    debug!(stream = %part.0, partition = part.1, error = %e, "lease renewal failed; retrying")
                }
            }
        }));
    }

    /// Partitions whose fence ran out (no renewal for two thirds of the TTL): stop them.
    pub(super) fn fence_expired(&mut self, _ctx: &mut Context<Self>) {
        let expired: Vec<Part> = self.held.iter().filter(|(_, h)| !h.fence.valid()).map(|(p, _)| p.clone()).collect();
        for part in expired {
            self.lose(&part, "the lease could not be renewed in time (self-fencing)");
        }
    }

    /// The lease is gone: revoke the fence (the worker acts no more) and stop the slot.
    pub(super) fn lose(&mut self, part: &Part, why: &str) {
        if let Some(h) = self.held.remove(part) {
            warn!(stream = %part.0, partition = part.1, epoch = h.epoch, why, "partition lost");
            flotilla_actors::metrics::lease_lost(&part.0);
            let event = Event::PartitionLost {
                stream: part.0.clone(),
                partition: part.1,
                node: self.s.node.clone(),
                why: why.to_owned(),
            };
            emit(&self.s.broker, &self.s.subjects, event);
            self.report_owned();
            h.fence.revoke();
            if let Some(slot) = h.slot {
                self.slot_of.remove(&slot);
                self.s.container.do_send(ReleaseSlot(slot));
            }
        }
    }

    pub(super) fn release(&mut self, part: &Part) {
        if let Some(h) = self.held.get_mut(part) {
            h.releasing = true;
            match h.slot {
                Some(slot) => self.s.container.do_send(ReleaseSlot(slot)),
                None => {
                    let part = part.clone();
                    self.delete_lease(&part);
                }
            }
        }
    }

    /// Acquires `part`'s lease: creates it, or replaces it at `replace` (a lease a
    /// dead incarnation of this node left).
    pub(super) fn acquire(&mut self, part: Part, replace: Option<u64>, how: &'static str, ctx: &mut Context<Self>) {
        if !self.acquiring.insert(part.clone()) {
            return;
        }
        let Some((js_stream, consumer)) = (self.s.takeover)(&part.0, part.1) else {
            self.acquiring.remove(&part);
            return;
        };
        let msg = AcquireLease {
            bucket: self.buckets.leases.clone(),
            key: keys::lease(&part.0, part.1),
            value: self.lease_value(0),
            replace,
            js_stream,
            consumer: Some(consumer),
        };
        let sent = Instant::now();
        let fut = self.s.reaper.send(msg);
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            act.acquiring.remove(&part);
            let acquired = match result {
                Ok(Ok(Some(acquired))) => acquired,
                Ok(Ok(None)) => return,
                Ok(Err(e)) => {
                    debug!(stream = %part.0, partition = part.1, error = %e, "could not acquire the lease");
                    return;
                }
                Err(_) => return,
            };
            let revision = acquired.revision;
            let fence = Fence::until(act.valid_after(sent));
            if act.leaving.is_some() || !act.registered {
                // Too late: give it back.
                act.held.insert(part.clone(), Held::new(revision, fence));
                act.delete_lease(&part);
                return;
            }
            let paused = act.paused.covers(&part.0, Some(part.1));
            let spec = AddSlot {
                stream: part.0.clone(),
                partition: part.1,
                epoch: revision,
                fence: fence.clone(),
                paused,
                start: acquired.start,
            };
            info!(stream = %part.0, partition = part.1, epoch = revision, how, "lease acquired");
            flotilla_actors::metrics::lease_acquired(&part.0, how);
            emit(
                &act.s.broker,
                &act.s.subjects,
                Event::PartitionAcquired {
                    stream: part.0.clone(),
                    partition: part.1,
                    node: act.s.node.clone(),
                    epoch: revision,
                    how: how.to_owned(),
                },
            );
            act.unleased_since.remove(&part);
            act.held.insert(part.clone(), Held::new(revision, fence));
            act.report_owned();
            // The record was created before its revision was known: write the epoch
            // into it now, so readers of LEASES see it at once.
            act.renew(part.clone(), ctx);
            let add = act.s.container.send(spec);
            ctx.spawn(add.into_actor(act).map(move |slot, act, _| {
                let Ok(Some(slot)) = slot else { return };
                match act.held.get_mut(&part) {
                    Some(h) => {
                        h.slot = Some(slot);
                        act.slot_of.insert(slot, part.clone());
                        if h.releasing {
                            act.s.container.do_send(ReleaseSlot(slot));
                        }
                    }
                    // Lost while the slot was being added.
                    None => act.s.container.do_send(ReleaseSlot(slot)),
                }
            }));
        }));
    }

    /// Deletes a held lease (only if it is still at our revision) and tells the others.
    pub(super) fn delete_lease(&mut self, part: &Part) {
        let Some(h) = self.held.remove(part) else { return };
        h.fence.revoke();
        flotilla_actors::metrics::lease_released(&part.0);
        let event = Event::PartitionReleased { stream: part.0.clone(), partition: part.1, node: self.s.node.clone() };
        emit(&self.s.broker, &self.s.subjects, event);
        self.report_owned();
        if let Some(slot) = h.slot {
            self.slot_of.remove(&slot);
        }
        let del = release_lease(
            self.s.broker.clone(),
            self.buckets.leases.clone(),
            keys::lease(&part.0, part.1),
            (self.s.node.clone(), self.s.incarnation.clone()),
            h.revision,
        );
        let notify = self.s.broker.core_publish(CoreMessage::new(self.s.subjects.control("all.changed"), Bytes::new()));
        let part = part.clone();
        actix::spawn(async move {
            match del.await {
                Ok(()) => {
                    info!(stream = %part.0, partition = part.1, "lease released");
                    let _ = notify.await;
                }
                Err(e) => {
                    warn!(stream = %part.0, partition = part.1, error = %e, "could not delete the lease; it expires on its own")
                }
            }
        });
    }
}

/// Deletes this process's membership key, compare-and-set, unless another process
/// holds the id by now.
pub(super) async fn release_membership(
    broker: &SharedBroker,
    bucket: &str,
    (node, incarnation): &(String, String),
) -> Result<(), BrokerError> {
    for _ in 0..5 {
        let Some(e) = broker.kv_get(bucket, node).await? else { return Ok(()) };
        let mine = decode::<NodeRecord>(node, &e.value).is_ok_and(|r| &r.node == node && &r.incarnation == incarnation);
        if !mine {
            return Ok(());
        }
        match broker.kv_delete(bucket, node, Some(e.revision)).await {
            Err(BrokerError::KvWrongRevision { .. }) => {}
            other => return other,
        }
    }
    Ok(())
}

/// Deletes a lease this node holds. A renewal may have moved its revision since we
/// last looked: re-read, and delete only while the record still names this node.
pub(super) async fn release_lease(
    broker: SharedBroker,
    bucket: String,
    key: String,
    (node, incarnation): (String, String),
    mut revision: u64,
) -> Result<(), BrokerError> {
    for _ in 0..5 {
        match broker.kv_delete(&bucket, &key, Some(revision)).await {
            Err(BrokerError::KvWrongRevision { .. }) => {}
            other => return other,
        }
        match broker.kv_get(&bucket, &key).await? {
            Some(e) if decode::<LeaseRecord>(&key, &e.value).is_ok_and(|r| r.held_by(&node, &incarnation)) => {
                revision = e.revision;
            }
            // Gone, or someone else's by now: nothing of ours to delete.
            _ => return Ok(()),
        }
    }
    Err(BrokerError::KvWrongRevision { bucket, key, expected: revision })
}
