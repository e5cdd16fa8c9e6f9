//! A TCP fault proxy: put it between a client and a server and cut every connection
//! through it on demand.
//!
//! [`FaultProxy::start`] listens on a free loopback port and relays bytes both ways
//! between each accepted connection and a fresh connection to the upstream address. It
//! runs on its own thread with its own tokio runtime, so sync and async tests (actix or
//! tokio) use it alike. [`FaultProxy::cut_all`] shuts both sockets of every live
//! connection down at once — mid-message, with no protocol goodbye — as a network fault
//! or a middlebox dropping state would; the proxy keeps accepting, so clients that
//! reconnect get through again. [`FaultProxy::blackhole`] models the other network
//! fault, the silent one: from then on no byte moves in either direction and new
//! connections get no answer, but nothing is closed — as when a firewall starts
//! dropping packets, TCP keeps retransmitting and the peers notice only through their
//! own timeouts. [`FaultProxy::heal`] lets the held bytes through, in order.
//! Dropping the proxy stops the thread and closes everything.
//!
//! ```no_run
//! # let server = flotilla_tests::NatsServer::start();
//! let proxy = flotilla_tests::fault_proxy::FaultProxy::start(([127, 0, 0, 1], server.port()).into());
//! // connect clients to proxy.url() …
//! let cut = proxy.cut_all();
//! ```

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener as StdListener, TcpStream as StdStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};

/// How long the proxy waits for the upstream to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The live connections: for each, a handle on both of its sockets (duplicated file
/// descriptors, so they can be shut down from outside the relay task).
#[derive(Debug, Default)]
struct Live {
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, [StdStream; 2]>>,
    /// Blackholed: bytes are held, not forwarded, until healed.
    held: AtomicBool,
    /// Wakes held relays when the proxy heals.
    healed: Notify,
}

impl Live {
    /// Returns once traffic may flow.
    async fn flowing(&self) {
        loop {
            let healed = self.healed.notified();
            if !self.held.load(Ordering::SeqCst) {
                return;
            }
            healed.await;
        }
    }

    fn conns(&self) -> MutexGuard<'_, HashMap<u64, [StdStream; 2]>> {
        // A panic while holding the lock leaves only a map of sockets behind: go on.
        self.conns.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A running TCP proxy to one upstream address; see the [module docs](self).
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    live: Arc<Live>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Starts a proxy to `upstream` on a free 127.0.0.1 port.
    ///
    /// # Panics
    /// When it cannot bind a loopback port or start its thread.
    pub fn start(upstream: SocketAddr) -> Self {
        let listener = StdListener::bind("127.0.0.1:0").expect("fault proxy: bind a loopback port");
        listener.set_nonblocking(true).expect("fault proxy: non-blocking listener");
        let addr = listener.local_addr().expect("fault proxy: local address");
        let live = Arc::new(Live::default());
        let (stop, stopped) = oneshot::channel();
        let l = live.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{}", addr.port()))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("fault proxy: tokio runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("fault proxy: tokio listener");
                    tokio::select! {
                        () = accept_loop(listener, upstream, l) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime drops every relay task and with it its sockets.
            })
            .expect("fault proxy: spawn its thread");
        Self { addr, live, stop: Some(stop), thread: Some(thread) }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `nats://127.0.0.1:<port>` of the proxy.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Closes every live proxied connection abruptly, both sockets in both directions;
    /// how many connections it cut. New connections are still accepted.
    pub fn cut_all(&self) -> usize {
        let cut: Vec<[StdStream; 2]> = self.live.conns().drain().map(|(_, s)| s).collect();
        for socket in cut.iter().flatten() {
            // Already closed by the peer is fine: the point is that it is closed now.
            let _ = socket.shutdown(Shutdown::Both);
        }
        cut.len()
    }

    /// Starts silently dropping traffic: no byte moves either way and new connections
    /// get no answer, but nothing is closed (see the [module docs](self)).
    pub fn blackhole(&self) {
        self.live.held.store(true, Ordering::SeqCst);
    }

    /// Ends a [`blackhole`](Self::blackhole): held bytes go through in order.
    pub fn heal(&self) {
        self.live.held.store(false, Ordering::SeqCst);
        self.live.healed.notify_waiters();
    }

    /// How many proxied connections are live now.
    pub fn connections(&self) -> usize {
        self.live.conns().len()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.cut_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, live: Arc<Live>) {
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(e) => {
                // Out of file descriptors and the like: wait, then go on accepting.
                tracing::warn!("fault proxy: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        tokio::spawn(relay(client, upstream, live.clone()));
    }
}

/// Connects to `upstream` and relays between it and `client` until either side closes
/// or the connection is cut.
async fn relay(client: TcpStream, upstream: SocketAddr, live: Arc<Live>) {
    // A blackholed network does not answer a new connection either.
    live.flowing().await;
    let server = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream)).await {
        Ok(Ok(server)) => server,
        Ok(Err(e)) => {
            tracing::debug!("fault proxy: upstream {upstream} refused: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!("fault proxy: upstream {upstream} did not answer within {CONNECT_TIMEOUT:?}");
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let handles = match (dup(&client), dup(&server)) {
        (Ok(c), Ok(s)) => [c, s],
        (Err(e), _) | (_, Err(e)) => {
            tracing::debug!("fault proxy: cannot duplicate a socket: {e}");
            return;
        }
    };
    let id = live.next_id.fetch_add(1, Ordering::Relaxed);
    live.conns().insert(id, handles);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Either direction ending (closed, cut or failed) ends the connection.
    tokio::select! {
        end = pump(&mut client_read, &mut server_write, &live) => tracing::debug!("fault proxy: connection {id} ended: {end:?}"),
        end = pump(&mut server_read, &mut client_write, &live) => tracing::debug!("fault proxy: connection {id} ended: {end:?}"),
    }
    live.conns().remove(&id);
}

/// Copies bytes from `from` to `to`, holding them while the proxy is blackholed.
async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    live: &Live,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        live.flowing().await;
        to.write_all(&buf[..n]).await?;
    }
}

/// A second descriptor for the socket behind `stream`.
fn dup(stream: &TcpStream) -> std::io::Result<StdStream> {
    let fd = std::os::fd::AsFd::as_fd(stream).try_clone_to_owned()?;
    Ok(StdStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A loopback echo server on its own thread (it ends with the test process).
    fn echo_server() -> SocketAddr {
        let listener = StdListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut conn = conn;
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = conn.read(&mut buf) {
                        if conn.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    fn echo_through(proxy: &FaultProxy, text: &[u8]) -> StdStream {
        let mut conn = StdStream::connect(proxy.addr()).expect("connect to the proxy");
        conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        conn.write_all(text).expect("write");
        let mut back = vec![0u8; text.len()];
        conn.read_exact(&mut back).expect("echo through the proxy");
        assert_eq!(back, text);
        conn
    }

    #[test]
    fn relays_bytes_and_cut_all_closes_live_connections_but_not_the_proxy() {
        let proxy = FaultProxy::start(echo_server());
        assert!(proxy.url().starts_with("nats://127.0.0.1:"));
        let mut first = echo_through(&proxy, b"hello");
        let mut second = echo_through(&proxy, b"world");
        assert_eq!(proxy.connections(), 2);

        assert_eq!(proxy.cut_all(), 2);
        assert_eq!(proxy.connections(), 0);
        for conn in [&mut first, &mut second] {
            let mut buf = [0u8; 16];
            // Closed: end of stream (or a reset), not a timeout.
            match conn.read(&mut buf) {
                Ok(0) => {}
                Ok(n) => panic!("read {n} bytes from a cut connection"),
                Err(e) => assert!(
                    !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                    "a cut connection stays open: {e}"
                ),
            }
        }
        assert_eq!(proxy.cut_all(), 0, "nothing left to cut");

        // New connections still get through.
        let _third = echo_through(&proxy, b"again");
        assert_eq!(proxy.connections(), 1);
        let addr = proxy.addr();
        drop(proxy);
        assert!(StdStream::connect(addr).is_err(), "the proxy still accepts after drop");
    }

    #[test]
    fn a_blackhole_holds_bytes_without_closing_and_heal_lets_them_through_in_order() {
        let proxy = FaultProxy::start(echo_server());
        let mut conn = echo_through(&proxy, b"before");
        proxy.blackhole();
        conn.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
        conn.write_all(b"held-1").expect("write");
        conn.write_all(b"held-2").expect("write");
        let mut buf = [0u8; 16];
        match conn.read(&mut buf) {
            Err(e) => assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}"),
            Ok(n) => panic!("{n} bytes came through a blackhole"),
        }
        assert_eq!(proxy.connections(), 1, "a blackhole closes nothing");
        proxy.heal();
        conn.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let mut back = [0u8; 12];
        conn.read_exact(&mut back).expect("held bytes arrive after heal");
        assert_eq!(&back, b"held-1held-2");
    }
}
