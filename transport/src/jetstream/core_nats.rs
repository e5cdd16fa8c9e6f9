//! Core NATS: plain publishes, subscriptions, requests and flushes.

use super::Inner;
use super::headers::{from_header_map, to_header_map};
use crate::broker::{BoxStream, BrokerError, BrokerResult, CoreMessage};
use futures::StreamExt;
use std::time::Duration;

fn core_from(msg: async_nats::Message) -> CoreMessage {
    CoreMessage {
        subject: msg.subject.to_string(),
        reply: msg.reply.map(|r| r.to_string()),
        headers: from_header_map(msg.headers.as_ref()),
        payload: msg.payload,
    }
}

impl Inner {
    pub(super) async fn core_publish(&self, msg: CoreMessage) -> BrokerResult<()> {
        let CoreMessage { subject, reply, headers, payload } = msg;
        let op = || format!("publish to {subject}");
        let res = match reply {
            Some(r) => {
                self.client.publish_with_reply_and_headers(subject.clone(), r, to_header_map(&headers)?, payload).await
            }
            None => self.client.publish_with_headers(subject.clone(), to_header_map(&headers)?, payload).await,
        };
        res.map_err(|e| BrokerError::Disconnected { operation: op(), reason: e.to_string() })
    }

    pub(super) async fn subscribe(
        &self,
        subject: String,
        group: Option<String>,
    ) -> BrokerResult<BoxStream<CoreMessage>> {
        let sub = match group {
            Some(g) => self.client.queue_subscribe(subject.clone(), g).await,
            None => self.client.subscribe(subject.clone()).await,
        }
        .map_err(|e| BrokerError::Disconnected {
            operation: format!("subscribe to {subject}"),
            reason: e.to_string(),
        })?;
        Ok(sub.map(core_from).boxed())
    }

    pub(super) async fn request(&self, msg: CoreMessage, timeout: Duration) -> BrokerResult<CoreMessage> {
        let subject = msg.subject.clone();
        let req = async_nats::Request::new()
            .payload(msg.payload)
            .headers(to_header_map(&msg.headers)?)
            .timeout(Some(timeout));
        self.client.send_request(subject.clone(), req).await.map(core_from).map_err(|e| match e.kind() {
            async_nats::RequestErrorKind::NoResponders => BrokerError::NoResponders { subject },
            async_nats::RequestErrorKind::TimedOut => {
                BrokerError::TimedOut { operation: format!("request on {subject}"), after: timeout }
            }
            _ => BrokerError::Disconnected { operation: format!("request on {subject}"), reason: e.to_string() },
        })
    }

    pub(super) async fn flush(&self) -> BrokerResult<()> {
        self.client
            .flush()
            .await
            .map_err(|e| BrokerError::Disconnected { operation: "flush".into(), reason: e.to_string() })
    }
}
