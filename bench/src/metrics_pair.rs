//! The metrics pair: the same Flotilla job with and without the Prometheus exporter.
//!
//! A process has one global recorder, so the bench installs a switch in front of the
//! Prometheus one: while it is off, every handle the run loop registers is a no-op
//! (what a node without `--http` gets); while it is on, handles record into the
//! exporter, and a thread renders `/metrics`' text every second (a scrape every
//! second, more often than Prometheus's usual 15 s). Each round makes its workers, and
//! so its handles, afresh: rounds alternate off, on, off, on.

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

static ON: AtomicBool = AtomicBool::new(false);
static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

struct Switch(PrometheusRecorder);

impl Recorder for Switch {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_counter(key, unit, description)
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_gauge(key, unit, description)
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_histogram(key, unit, description)
    }
    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if ON.load(Ordering::Relaxed) { self.0.register_counter(key, metadata) } else { Counter::noop() }
    }
    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if ON.load(Ordering::Relaxed) { self.0.register_gauge(key, metadata) } else { Gauge::noop() }
    }
    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        if ON.load(Ordering::Relaxed) { self.0.register_histogram(key, metadata) } else { Histogram::noop() }
    }
}

/// Installs the switch (off) in front of a Prometheus recorder set up as a node's is.
pub fn install() -> anyhow::Result<()> {
    if HANDLE.get().is_some() {
        return Ok(());
    }
    let recorder = PrometheusBuilder::new().set_buckets(flotilla::actors::metrics::BUCKETS)?.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(Switch(recorder)).map_err(|e| anyhow::anyhow!("recorder: {e}"))?;
    flotilla::actors::metrics::describe();
    let _ = HANDLE.set(handle);
    Ok(())
}

/// While alive, handles made record into the exporter and `/metrics` is rendered every
/// second; the last render's size is kept (so the work is not optimised away).
pub struct Exporting {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Exporting {
    pub fn start() -> Self {
        ON.store(true, Ordering::Relaxed);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let rendered = AtomicU64::new(0);
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(1));
                if let Some(h) = HANDLE.get() {
                    rendered.store(h.render().len() as u64, Ordering::Relaxed);
                }
            }
            rendered.load(Ordering::Relaxed)
        });
        Self { stop, thread: Some(thread) }
    }

    /// Stops exporting; returns the size of the last scrape.
    pub fn stop(mut self) -> u64 {
        self.end()
    }

    fn end(&mut self) -> u64 {
        ON.store(false, Ordering::Relaxed);
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or(0)
    }
}

impl Drop for Exporting {
    fn drop(&mut self) {
        self.end();
    }
}
