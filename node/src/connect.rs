//! Choosing the broker: the embedded one by default, JetStream with `--nats URL`.

use flotilla_transport::broker::{BrokerError, SharedBroker};
use flotilla_transport::{EmbeddedBroker, JetStreamBroker, JetStreamOptions};

/// Which broker a process uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerChoice {
    /// The in-process embedded broker (no server needed; nothing survives the process).
    Embedded,
    /// NATS JetStream at these comma-separated URLs.
    Nats(String),
}

impl BrokerChoice {
    /// `Nats(url)` when a URL is given, else `Embedded`.
    pub fn from_url(url: Option<&str>) -> Self {
        match url.map(str::trim).filter(|u| !u.is_empty()) {
            Some(u) => BrokerChoice::Nats(u.to_owned()),
            None => BrokerChoice::Embedded,
        }
    }
}

/// Connects the chosen broker.
///
/// # Errors
/// For NATS: [`BrokerError::Unreachable`] (with what to do) or
/// [`BrokerError::JetStreamDisabled`].
pub async fn connect(choice: &BrokerChoice, client_name: &str) -> Result<SharedBroker, BrokerError> {
    match choice {
        BrokerChoice::Embedded => Ok(EmbeddedBroker::new().shared()),
        BrokerChoice::Nats(urls) => {
            let mut opts = JetStreamOptions::new(urls.clone());
            opts.urls = urls.split(',').map(|u| u.trim().to_owned()).filter(|u| !u.is_empty()).collect();
            opts.name = Some(client_name.to_owned());
            Ok(JetStreamBroker::connect(opts).await?.shared())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choice_follows_the_url() {
        assert_eq!(BrokerChoice::from_url(None), BrokerChoice::Embedded);
        assert_eq!(BrokerChoice::from_url(Some("  ")), BrokerChoice::Embedded);
        assert_eq!(BrokerChoice::from_url(Some("nats://h:4222")), BrokerChoice::Nats("nats://h:4222".into()));
    }

    #[tokio::test]
    async fn unreachable_server_says_what_to_do() {
        // Port 1 on loopback: nothing listens there.
        let err = connect(&BrokerChoice::Nats("nats://127.0.0.1:1".into()), "test").await.expect_err("unreachable");
        let text = err.to_string();
        assert!(matches!(err, BrokerError::Unreachable { .. }), "{text}");
        assert!(text.contains("apt-get install nats-server") && text.contains("127.0.0.1:1"), "{text}");
    }
}
