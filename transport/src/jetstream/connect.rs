//! Connecting: the options, the reconnect backoff, and the connection's events.

use super::{Inner, JetStreamBroker, publisher};
use crate::broker::{BrokerError, BrokerKind, BrokerResult, ConnectionEvent, ServerInfo, Version};
use async_nats::jetstream;
use dashmap::DashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;
use tracing::{debug, warn};

/// How to connect to NATS.
#[derive(Debug, Clone)]
pub struct JetStreamOptions {
    /// Server URLs (`nats://host:4222`); several for a cluster.
    pub urls: Vec<String>,
    /// The client connection name (shows in the server's monitoring).
    pub name: Option<String>,
    /// How often to ping the server; a dead connection is noticed after about two.
    pub ping_interval: Duration,
    /// How long one connection attempt may take.
    pub connect_timeout: Duration,
    /// How long a JetStream API request (stream info, KV write, …) may take.
    pub request_timeout: Duration,
    /// Publish acks outstanding at once before publishing waits.
    pub max_ack_inflight: usize,
    /// User and password.
    pub user_password: Option<(String, String)>,
    /// An auth token.
    pub token: Option<String>,
    /// A `.creds` file (JWT and nkey seed).
    pub credentials_file: Option<PathBuf>,
    /// An nkey seed (`SU…`).
    pub nkey_seed: Option<String>,
    /// A CA certificate (PEM) to trust for TLS.
    pub tls_ca: Option<PathBuf>,
    /// A client certificate and its key (PEM) for mutual TLS.
    pub tls_client_cert: Option<(PathBuf, PathBuf)>,
}

impl JetStreamOptions {
    /// Options for one server URL with Flotilla's defaults.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            name: None,
            ping_interval: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            max_ack_inflight: 4096,
            user_password: None,
            token: None,
            credentials_file: None,
            nkey_seed: None,
            tls_ca: None,
            tls_client_cert: None,
        }
    }
}

/// The reconnect delay after `attempts` failed attempts: exponential from 100 ms, capped
/// at 5 s, times a random factor in [0.5, 1.5).
pub fn reconnect_delay(attempts: usize) -> Duration {
    let n = u32::try_from(attempts).unwrap_or(u32::MAX).saturating_add(1);
    flotilla_proto::backoff::RECONNECT.wait(n, rand::random())
}

fn map_event(ev: async_nats::Event) -> ConnectionEvent {
    use async_nats::Event;
    match ev {
        Event::Connected => ConnectionEvent::Connected,
        Event::Disconnected => ConnectionEvent::Disconnected,
        Event::LameDuckMode => ConnectionEvent::LameDuck,
        Event::SlowConsumer(_) => ConnectionEvent::SlowConsumer,
        Event::ServerError(e) => ConnectionEvent::ServerError(e.to_string()),
        Event::ClientError(e) => ConnectionEvent::ClientError(e.to_string()),
        Event::Closed => ConnectionEvent::Closed,
        other => ConnectionEvent::ClientError(other.to_string()),
    }
}

impl JetStreamBroker {
    /// Connects, reads the server version and checks that JetStream is enabled.
    ///
    /// # Errors
    /// [`BrokerError::Unreachable`] when no server answers (with what to do about it),
    /// [`BrokerError::JetStreamDisabled`] when the server runs without `-js`.
    pub async fn connect(opts: JetStreamOptions) -> BrokerResult<Self> {
        let url = opts.urls.join(",");
        let (events, _) = broadcast::channel(256);
        let tx = events.clone();
        let mut co = async_nats::ConnectOptions::new()
            .ping_interval(opts.ping_interval)
            .connection_timeout(opts.connect_timeout)
            .request_timeout(Some(opts.request_timeout))
            .max_reconnects(None)
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(move |ev| {
                let tx = tx.clone();
                async move {
                    let ev = map_event(ev);
                    match &ev {
                        ConnectionEvent::Connected | ConnectionEvent::Closed => debug!(event = ?ev, "nats connection"),
                        _ => warn!(event = ?ev, "nats connection"),
                    }
                    let _ = tx.send(ev);
                }
            });
        if let Some(name) = &opts.name {
            co = co.name(name);
        }
        if let Some((user, pass)) = &opts.user_password {
            co = co.user_and_password(user.clone(), pass.clone());
        }
        if let Some(token) = &opts.token {
            co = co.token(token.clone());
        }
        if let Some(seed) = &opts.nkey_seed {
            co = co.nkey(seed.clone());
        }
        if let Some(path) = &opts.credentials_file {
            co = co.credentials_file(path).await.map_err(|e| BrokerError::Unreachable {
                url: url.clone(),
                reason: format!("cannot read credentials file {}: {e}", path.display()),
            })?;
        }
        if let Some(ca) = &opts.tls_ca {
            co = co.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = &opts.tls_client_cert {
            co = co.add_client_certificate(cert.clone(), key.clone()).require_tls(true);
        }
        let mut addrs = Vec::with_capacity(opts.urls.len());
        for u in &opts.urls {
            let addr = u.parse::<async_nats::ServerAddr>().map_err(|e| BrokerError::Unreachable {
                url: u.clone(),
                reason: format!("invalid NATS URL ({e}); use the form nats://host:port"),
            })?;
            addrs.push(addr);
        }
        if addrs.is_empty() {
            return Err(BrokerError::Unreachable { url, reason: "no NATS URL given".into() });
        }
        let client = co
            .connect(addrs)
            .await
            .map_err(|e| BrokerError::Unreachable { url: url.clone(), reason: e.to_string() })?;
        let si = client.server_info();
        if !si.jetstream {
            return Err(BrokerError::JetStreamDisabled { url });
        }
        let version = Version::parse(&si.version).ok_or_else(|| {
            BrokerError::other("connect", format!("server at {url} reports an unreadable version {:?}", si.version))
        })?;
        let info = ServerInfo {
            kind: BrokerKind::JetStream,
            version,
            name: if si.server_name.is_empty() { si.server_id.clone() } else { si.server_name.clone() },
            max_payload: si.max_payload,
            extra: vec![],
        };
        let js = jetstream::context::ContextBuilder::new().timeout(opts.request_timeout).build(client.clone());
        let publisher =
            publisher::Publisher::start(client.clone(), info.max_payload, opts.max_ack_inflight, opts.request_timeout)
                .await?;
        debug!(server.version = %info.version, server.name = %info.name, "connected to nats");
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                js,
                info,
                events,
                streams: DashMap::new(),
                consumers: DashMap::new(),
                kv: DashMap::new(),
                request_timeout: opts.request_timeout,
                publisher,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delay_is_capped_and_jittered() {
        for attempt in 0..20 {
            let d = reconnect_delay(attempt);
            assert!(d <= Duration::from_millis(7500), "{attempt}: {d:?}");
            assert!(d >= Duration::from_millis(50), "{attempt}: {d:?}");
        }
        let samples: std::collections::HashSet<_> = (0..20).map(|_| reconnect_delay(10)).collect();
        assert!(samples.len() > 1, "no jitter");
    }
}
