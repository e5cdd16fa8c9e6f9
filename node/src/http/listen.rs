//! The endpoint's accept loop, made for clients that hold on (a browser's keep-alive,
//! or someone who opens connections and sends nothing).
//!
//! - At most [`MAX_CONNECTIONS`] connections at once. The loop takes a connection off
//!   the listen queue only when one of them is free, so the others wait in the kernel's
//!   queue and hold none of the process's file descriptors (which the NATS client
//!   needs), and are served in turn.
//! - A request's headers must arrive within [`HEADER_TIMEOUT`] of the connection's
//!   start or of the previous response, so a client that sends slowly, or nothing, or
//!   keeps an idle connection open, is cut off after it.
//! - A connection lives at most [`CONNECTION_LIFETIME`]: then it takes no more
//!   requests, and the one in flight has [`LAST_REQUEST`] to finish.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;

/// How long a request's headers may take, from the connection's start or the end of
/// the previous response on it (so also how long a connection may sit idle).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a connection may live.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// How long a request in flight at the end of its connection's life may still take.
pub const LAST_REQUEST: Duration = Duration::from_secs(30);

/// Serves `router` on `listener` until the listener fails for good.
pub async fn serve(listener: TcpListener, router: Router) {
    let free = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
    loop {
        let Ok(slot) = free.clone().acquire_owned().await else { return };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was taken: wait a
                // little rather than spin.
                warn!(error = %e, "the HTTP endpoint cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        tokio::spawn(async move {
            let _slot = slot;
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                () = tokio::time::sleep(CONNECTION_LIFETIME) => {
                    connection.as_mut().graceful_shutdown();
                    match tokio::time::timeout(LAST_REQUEST, connection).await {
                        Ok(ended) => ended,
                        Err(_) => {
                            debug!(%peer, "an HTTP connection's last request took too long; closed");
                            return;
                        }
                    }
                }
            };
            if let Err(e) = ended {
                debug!(%peer, error = %e, "an HTTP connection ended");
            }
        });
    }
}
