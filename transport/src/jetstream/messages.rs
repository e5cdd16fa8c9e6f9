//! Stored messages read and deleted by sequence.

use super::Inner;
use super::errors::{api_error, js_code};
use super::headers::from_header_map;
use crate::broker::{BrokerError, BrokerResult, StoredMessage};
use async_nats::jetstream::stream;
use bytes::Bytes;
use std::time::SystemTime;

impl Inner {
    pub(super) async fn get_message(&self, stream: String, seq: u64) -> BrokerResult<Option<StoredMessage>> {
        let s = self.stream_handle(&stream).await?;
        match s.get_raw_message(seq).await {
            Ok(m) => Ok(Some(StoredMessage {
                subject: m.subject.to_string(),
                seq: m.sequence,
                headers: from_header_map(Some(&m.headers)),
                payload: m.payload,
                published: SystemTime::from(m.time),
            })),
            Err(e)
                if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound)
                    || js_code(&e) == Some(10037) =>
            {
                Ok(None)
            }
            Err(e) => Err(api_error(&format!("get message {seq} of {stream}"), e, self.request_timeout)),
        }
    }

    pub(super) async fn get_next_message(
        &self,
        stream: String,
        seq: u64,
        subject: String,
    ) -> BrokerResult<Option<StoredMessage>> {
        let s = self.stream_handle(&stream).await?;
        // `$JS.API.STREAM.MSG.GET` with `seq` and `next_by_subj` (2.9+): the server
        // skips deleted sequences and other subjects itself.
        match s.raw_message_builder().sequence(seq.max(1)).next_by_subject(subject.clone()).send().await {
            Ok(m) => Ok(Some(StoredMessage {
                subject: m.subject.to_string(),
                seq: m.sequence,
                headers: from_header_map(Some(&m.headers)),
                payload: m.payload,
                published: SystemTime::from(m.time),
            })),
            Err(e) if matches!(e.kind(), stream::RawMessageErrorKind::NoMessageFound) || js_code(&e) == Some(10037) => {
                Ok(None)
            }
            Err(e) => Err(api_error(
                &format!("get the next message of {subject} from {seq} in {stream}"),
                e,
                self.request_timeout,
            )),
        }
    }

    pub(super) async fn delete_message(&self, stream: String, seq: u64) -> BrokerResult<bool> {
        // `no_erase`: async-nats's delete_message would overwrite the bytes on disk.
        let subject = format!("$JS.API.STREAM.MSG.DELETE.{stream}");
        let body = serde_json::json!({ "seq": seq, "no_erase": true }).to_string();
        let op = format!("delete message {seq} of {stream}");
        let reply = self
            .client
            .request(subject, Bytes::from(body))
            .await
            .map_err(|e| api_error(&op, e, self.request_timeout))?;
        let v: serde_json::Value = serde_json::from_slice(&reply.payload).map_err(|e| BrokerError::other(&op, e))?;
        if v.get("success").and_then(serde_json::Value::as_bool) == Some(true) {
            return Ok(true);
        }
        match v.pointer("/error/err_code").and_then(serde_json::Value::as_u64) {
            Some(10057) | Some(10037) => Ok(false),
            Some(10059) => Err(BrokerError::StreamNotFound { stream }),
            _ => Err(BrokerError::other(&op, v)),
        }
    }
}
