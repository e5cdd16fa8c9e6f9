//! Reading async-nats' errors: JetStream API codes, "not found", timeouts.

use crate::broker::BrokerError;
use std::time::Duration;

pub(super) fn js_code<E: std::fmt::Display>(err: &E) -> Option<u64> {
    // async-nats formats JetStream API errors as "... (code 404, error code 10059)".
    let text = err.to_string();
    let at = text.find("error code ")?;
    text[at + 11..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// Whether `err` says the consumer (10014) does not exist; async-nats reports this as a
/// JetStream error code on some calls and as a typed "consumer not found" on others.
pub(super) fn consumer_missing<E: std::fmt::Display>(err: &E) -> bool {
    js_code(err) == Some(10014) || err.to_string().contains("consumer not found")
}

/// Whether `err` says the stream (10059) does not exist.
pub(super) fn stream_missing<E: std::fmt::Display>(err: &E) -> bool {
    js_code(err) == Some(10059) || err.to_string().contains("stream not found")
}

fn is_timeout<E: std::fmt::Display>(err: &E) -> bool {
    let t = err.to_string().to_lowercase();
    t.contains("timed out") || t.contains("timeout")
}

pub(super) fn api_error<E: std::fmt::Display>(operation: &str, err: E, timeout: Duration) -> BrokerError {
    let text = err.to_string();
    if is_timeout(&err) {
        BrokerError::TimedOut { operation: operation.to_owned(), after: timeout }
    } else if let Some(full) = js_code(&err).and_then(|code| BrokerError::from_js_api(operation, 0, code, &text)) {
        full
    } else if text.contains("no space left on device") || text.contains("insufficient resources") {
        BrokerError::StorageFull { operation: operation.to_owned(), reason: text }
    } else if err.to_string().to_lowercase().contains("no responders") {
        BrokerError::Disconnected {
            operation: operation.to_owned(),
            reason: "JetStream did not respond (no responders)".into(),
        }
    } else {
        BrokerError::other(operation, err)
    }
}
