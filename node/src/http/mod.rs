//! A node's HTTP endpoint (`--http ADDR`): Prometheus metrics, the job's status as
//! JSON, its dead letters, and the live dashboard.
//!
//! | path | what |
//! |---|---|
//! | `GET /` | the dashboard (one page, its script and style built into the binary) |
//! | `GET /metrics` | this node's metrics, Prometheus text format (`docs/metrics.md`) |
//! | `GET /api/status` | the job's status: the same JSON as `flotilla status --json` |
//! | `GET /api/events` | recent events of the job (every node's), newest last |
//! | `GET /api/dlq?limit=N&after=ID` | a page of the dead letters, oldest first (as `dlq list --json`) |
//! | `POST /api/dlq/{id}/replay` | replays one dead letter (as `dlq replay ID`) |
//! | `GET /healthz` | `ok` while the process serves |
//!
//! Requests must name this endpoint as their `Host`, replays need the node's token, and
//! so does every read but the page and `/healthz` once a token is set ([`guard`]).
//! Connections are capped and slow ones cut off ([`listen`]).
//!
//! It runs on a thread of its own with its own runtime, so scrapes and page loads never
//! take time from the run loop's thread. The job's status is read at most once a second
//! whoever asks (each read asks every node), and shared; so is each page of the dead
//! letters, for two seconds.

pub mod guard;
pub mod listen;

use crate::client::{ControlClient, ControlError};
use crate::dlq::{DeadLetters, Page};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use flotilla_actors::metrics::{BUCKETS, describe, names};
use flotilla_transport::broker::{ConnectionEvent, SharedBroker};
use futures::StreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tracing::{info, warn};

/// The page, its script and its style.
const INDEX_HTML: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const STYLE_CSS: &str = include_str!("dashboard/style.css");

/// Events kept for `/api/events`.
const EVENTS_KEPT: usize = 200;

/// How long a status read is shared (counted from when it ended).
const STATUS_FRESH: Duration = Duration::from_secs(1);

/// How long a status read may take before the page is told the job cannot be read.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// Dead letters a page lists unless asked for fewer or more.
pub const DLQ_DEFAULT_LIMIT: usize = 50;

/// Dead letters a page lists at most.
pub const DLQ_MAX_LIMIT: usize = 100;

/// Dead letters one page reads at most (only a `reason` filter reads entries it does
/// not list); a page that stops there says where to go on.
pub const DLQ_MAX_READS: usize = 250;

/// How long a page of dead letters is shared (counted from when it was read).
const DLQ_FRESH: Duration = Duration::from_secs(2);

/// Pages of dead letters kept (different filters or positions).
const DLQ_PAGES_KEPT: usize = 32;

/// The header that says where the next page of dead letters starts (`?after=`).
pub const DLQ_NEXT_HEADER: &str = "x-flotilla-dlq-next";

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address cannot be listened on.
    #[error("cannot listen on --http {addr}: {reason} (give a free address, e.g. 127.0.0.1:9090, or port 0 for any)")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The metrics recorder could not be installed.
    #[error("cannot install the metrics recorder: {0}")]
    Recorder(String),
    /// A `--http-host` is not a host name.
    #[error(transparent)]
    Host(#[from] guard::BadHostName),
}

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process's Prometheus recorder (once; later calls return the same
/// handle) and describes every metric. Install it before the job starts: handles made
/// before are no-ops.
///
/// # Errors
/// [`HttpError::Recorder`] when another recorder is installed.
pub fn install_recorder() -> Result<PrometheusHandle, HttpError> {
    if let Some(h) = RECORDER.get() {
        return Ok(h.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map_err(|e| HttpError::Recorder(e.to_string()))?
        .install_recorder()
        .map_err(|e| HttpError::Recorder(e.to_string()))?;
    describe();
    Ok(RECORDER.get_or_init(|| handle).clone())
}

/// What the endpoint serves for: the node and its job.
#[derive(Debug, Clone)]
pub struct Served {
    /// The job.
    pub job: String,
    /// This node's id.
    pub node: String,
    /// The broker the node uses.
    pub broker: SharedBroker,
}

/// Who may ask the endpoint what (`docs/metrics.md`).
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// The token replays need, and every read but the page and `/healthz` once set.
    pub token: Option<String>,
    /// Names the endpoint answers to besides its bound address (`name` or `name:port`).
    pub hosts: Vec<String>,
}

/// The running endpoint.
#[derive(Debug)]
pub struct HttpEndpoint {
    /// The address it listens on (with the port chosen when 0 was given).
    pub addr: SocketAddr,
}

struct AppState {
    served: Served,
    metrics: PrometheusHandle,
    status: tokio::sync::Mutex<Option<(Instant, Result<serde_json::Value, String>)>>,
    events: Mutex<VecDeque<serde_json::Value>>,
    dlq: tokio::sync::Mutex<HashMap<DlqQuery, (Instant, DlqAnswer)>>,
    started: Instant,
}

/// A page of dead letters as served: the JSON and where the next page starts, or the
/// error.
type DlqAnswer = Result<(bytes::Bytes, Option<u64>), (StatusCode, String)>;

/// Listens on `addr` and serves on a thread of its own. The recorder must be
/// installed ([`install_recorder`]).
///
/// # Errors
/// [`HttpError`] when the address cannot be listened on or a host name is not one.
pub fn serve(
    addr: &str,
    served: Served,
    metrics: PrometheusHandle,
    settings: Settings,
) -> Result<HttpEndpoint, HttpError> {
    let bind_error = |reason: String| HttpError::Bind { addr: addr.to_owned(), reason };
    let listener = std::net::TcpListener::bind(addr).map_err(|e| bind_error(e.to_string()))?;
    listener.set_nonblocking(true).map_err(|e| bind_error(e.to_string()))?;
    let local = listener.local_addr().map_err(|e| bind_error(e.to_string()))?;
    let access =
        Arc::new(guard::Access { hosts: guard::AllowedHosts::new(local, &settings.hosts)?, token: settings.token });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| bind_error(format!("no runtime: {e}")))?;
    node_gauges(&served);
    let state = Arc::new(AppState {
        served,
        metrics,
        status: tokio::sync::Mutex::new(None),
        events: Mutex::new(VecDeque::new()),
        dlq: tokio::sync::Mutex::new(HashMap::new()),
        started: Instant::now(),
    });
    std::thread::Builder::new()
        .name("flotilla-http".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(error = %e, "the HTTP endpoint cannot listen");
                        return;
                    }
                };
                tokio::spawn(upkeep(state.clone()));
                tokio::spawn(collect_events(state.clone()));
                tokio::spawn(count_connection_events(state.served.broker.clone()));
                listen::serve(listener, router(state, access)).await;
                warn!("the HTTP endpoint stopped");
            })
        })
        .map_err(|e| bind_error(format!("no thread: {e}")))?;
    info!(addr = %local, "serving /metrics, /api/status and the dashboard");
    Ok(HttpEndpoint { addr: local })
}

fn node_gauges(served: &Served) {
    let started = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    metrics::gauge!(names::START_TIME).set(started);
    metrics::gauge!(
        names::NODE_INFO,
        "node" => served.node.clone(),
        "flotilla_job" => served.job.clone(),
        "version" => env!("CARGO_PKG_VERSION"),
    )
    .set(1.0);
}

fn router(state: Arc<AppState>, access: Arc<guard::Access>) -> Router {
    Router::new()
        .route("/", get(|| async { Html(INDEX_HTML) }))
        .route("/app.js", get(|| async { ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], APP_JS) }))
        .route("/style.css", get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE_CSS) }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics_text))
        .route("/api/status", get(status))
        .route("/api/node", get(node))
        .route("/api/events", get(events))
        .route("/api/dlq", get(dlq_list))
        .route("/api/dlq/{id}/replay", post(dlq_replay))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(access, guard::guard))
}

/// Histograms are drained into their buckets here too, so a node nobody scrapes
/// keeps no growing sample buffers.
async fn upkeep(state: Arc<AppState>) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        state.metrics.run_upkeep();
    }
}

/// Keeps the job's recent events (every node publishes them on core NATS).
async fn collect_events(state: Arc<AppState>) {
    let subject = format!("flotilla.{}._evt.>", state.served.job);
    loop {
        match state.served.broker.subscribe(&subject, None).await {
            Ok(mut events) => {
                while let Some(msg) = events.next().await {
                    let Ok(mut event) = serde_json::from_slice::<serde_json::Value>(&msg.payload) else { continue };
                    if let Some(obj) = event.as_object_mut() {
                        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
                        obj.entry("at_ms").or_insert(now.into());
                    }
                    let mut kept = state.events.lock().unwrap_or_else(PoisonError::into_inner);
                    if kept.len() == EVENTS_KEPT {
                        kept.pop_front();
                    }
                    kept.push_back(event);
                }
            }
            Err(e) => warn!(error = %e, "cannot subscribe to the job's events; trying again"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn count_connection_events(broker: SharedBroker) {
    let mut events = broker.events();
    let connected = metrics::gauge!(names::CONNECTED);
    connected.set(1.0);
    let (lost, back) = (metrics::counter!(names::DISCONNECTS), metrics::counter!(names::RECONNECTS));
    loop {
        match events.recv().await {
            Ok(ConnectionEvent::Disconnected) => {
                lost.increment(1);
                connected.set(0.0);
            }
            Ok(ConnectionEvent::Connected) => {
                back.increment(1);
                connected.set(1.0);
            }
            Ok(ConnectionEvent::Closed) => connected.set(0.0),
            Ok(_) => {}
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render())
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

fn control_status(e: &ControlError) -> (StatusCode, String) {
    let status = match e {
        ControlError::Refused(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, e.to_string())
}

fn control_error(e: ControlError) -> Response {
    let (status, message) = control_status(&e);
    error(status, message)
}

async fn status(State(state): State<Arc<AppState>>) -> Response {
    let mut cached = state.status.lock().await;
    let fresh = cached.as_ref().is_some_and(|(at, _)| at.elapsed() < STATUS_FRESH);
    if !fresh {
        let read = async {
            let client = ControlClient::new(state.served.broker.clone(), &state.served.job).await?;
            let status = client.status().await?;
            Ok::<_, ControlError>(serde_json::to_value(&status).unwrap_or_default())
        };
        let result = match tokio::time::timeout(STATUS_TIMEOUT, read).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("the job's status took over {STATUS_TIMEOUT:?} to read (is NATS reachable?)")),
        };
        // Fresh from when it was read: a slow read is still shared.
        *cached = Some((Instant::now(), result));
    }
    match cached.as_ref().map(|(_, r)| r) {
        Some(Ok(v)) => Json(v.clone()).into_response(),
        Some(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, e.clone()),
        None => error(StatusCode::SERVICE_UNAVAILABLE, "no status yet"),
    }
}

/// The node serving the page.
async fn node(State(state): State<Arc<AppState>>) -> Response {
    Json(serde_json::json!({
        "node": state.served.node,
        "job": state.served.job,
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_ms": state.started.elapsed().as_millis() as u64,
    }))
    .into_response()
}

async fn events(State(state): State<Arc<AppState>>) -> Response {
    let kept: Vec<serde_json::Value> =
        state.events.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect();
    Json(kept).into_response()
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
struct DlqQuery {
    limit: Option<usize>,
    after: Option<u64>,
    stream: Option<String>,
    reason: Option<String>,
}

/// A page of dead letters: at most [`DLQ_MAX_LIMIT`], read at most once in
/// [`DLQ_FRESH`] whoever asks; a page that stopped before the end says where the next
/// starts in [`DLQ_NEXT_HEADER`].
async fn dlq_list(State(state): State<Arc<AppState>>, Query(mut q): Query<DlqQuery>) -> Response {
    q.limit = Some(q.limit.unwrap_or(DLQ_DEFAULT_LIMIT).clamp(1, DLQ_MAX_LIMIT));
    let mut pages = state.dlq.lock().await;
    let fresh = pages.get(&q).filter(|(at, _)| at.elapsed() < DLQ_FRESH).map(|(_, answer)| answer.clone());
    let answer = match fresh {
        Some(answer) => answer,
        None => {
            let answer = read_dlq_page(&state.served, &q).await;
            if pages.len() >= DLQ_PAGES_KEPT {
                pages.retain(|_, (at, _)| at.elapsed() < DLQ_FRESH);
                if pages.len() >= DLQ_PAGES_KEPT {
                    pages.clear();
                }
            }
            // Fresh from when it was read: a slow read is still shared.
            pages.insert(q, (Instant::now(), answer.clone()));
            answer
        }
    };
    drop(pages);
    match answer {
        Ok((json, next)) => {
            let mut response = ([(header::CONTENT_TYPE, "application/json")], json).into_response();
            if let Some(next) = next {
                response.headers_mut().insert(DLQ_NEXT_HEADER, HeaderValue::from(next));
            }
            response
        }
        Err((status, message)) => error(status, message),
    }
}

async fn read_dlq_page(served: &Served, q: &DlqQuery) -> DlqAnswer {
    let read = async {
        let letters = DeadLetters::new(served.broker.clone(), &served.job)?;
        let limit = q.limit.unwrap_or(DLQ_DEFAULT_LIMIT);
        letters.page(q.stream.as_deref(), q.reason.as_deref(), q.after.unwrap_or(0), limit, DLQ_MAX_READS).await
    };
    match tokio::time::timeout(STATUS_TIMEOUT, read).await {
        Ok(Ok(Page { entries, next })) => Ok((serde_json::to_vec(&entries).unwrap_or_default().into(), next)),
        Ok(Err(e)) => Err(control_status(&e)),
        Err(_) => Err((
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the dead letters took over {STATUS_TIMEOUT:?} to read (is NATS reachable?)"),
        )),
    }
}

async fn dlq_replay(State(state): State<Arc<AppState>>, Path(id): Path<u64>) -> Response {
    let letters = match DeadLetters::new(state.served.broker.clone(), &state.served.job) {
        Ok(d) => d,
        Err(e) => return control_error(e),
    };
    let result = letters.replay_one(id).await;
    // The pages shared show it no more (nor what a failed replay may have changed).
    state.dlq.lock().await.clear();
    match result {
        Ok(()) => {
            info!(id, "dead letter replayed from the dashboard");
            Json(serde_json::json!({ "replayed": 1 })).into_response()
        }
        Err(e) => control_error(e),
    }
}
