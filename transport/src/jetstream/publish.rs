//! JetStream publishes, through the connection's [`Publisher`](super::publisher::Publisher).

use super::{Inner, publisher};
use crate::broker::{BrokerError, BrokerResult, OutboundMessage, PendingBatch, PendingPublish, PublishAck};
use std::sync::Arc;

/// Refuses a payload the server would not take (its `max_payload`), before it is sent.
pub(super) fn publish_payload_check(msg: &OutboundMessage, limit: usize) -> BrokerResult<()> {
    let size = msg.wire_size();
    if size > limit {
        return Err(BrokerError::PayloadTooLarge { size, limit });
    }
    Ok(())
}

/// The ack of a one-message batch.
fn only_ack(acks: Vec<BrokerResult<PublishAck>>) -> BrokerResult<PublishAck> {
    acks.into_iter().next().unwrap_or_else(|| Err(BrokerError::other("publish", "no ack for the message")))
}

impl Inner {
    pub(super) async fn publish(&self, msg: OutboundMessage) -> BrokerResult<PublishAck> {
        let batch = self.publisher.send(Arc::from([msg]), publisher::Want::Acks).await?;
        only_ack(batch.acks().await?)
    }

    pub(super) async fn publish_pipelined(&self, msg: OutboundMessage) -> BrokerResult<PendingPublish> {
        let batch = self.publisher.send(Arc::from([msg]), publisher::Want::Acks).await?;
        let pending: crate::broker::PendingPublish = Box::pin(async move { only_ack(batch.acks().await?) });
        Ok(pending)
    }

    pub(super) async fn publish_pipelined_batch(&self, msgs: Arc<[OutboundMessage]>) -> BrokerResult<PendingBatch> {
        let batch = self.publisher.send(msgs, publisher::Want::FirstRefusal).await?;
        let stored: PendingBatch = Box::pin(async move { batch.acks().await.map(|_| ()) });
        Ok(stored)
    }

    pub(super) async fn publish_batch(&self, msgs: Vec<OutboundMessage>) -> Vec<BrokerResult<PublishAck>> {
        let n = msgs.len();
        let acks = match self.publisher.send(msgs.into(), publisher::Want::Acks).await {
            Ok(batch) => batch.acks().await,
            Err(e) => Err(e),
        };
        // A batch that failed as a whole: each message may or may not be stored.
        acks.unwrap_or_else(|e| vec![Err(e); n])
    }
}
