//! `drain` and `drain --cancel`, and the pending drain `status` shows.

use super::{ControlClient, ControlError, json};
use crate::cluster::read_end;
use flotilla_actors::cluster::now_ms;
use flotilla_proto::cluster::control::{
    self as cluster, DrainedRecord, LeaseRecord, RequestRecord, RunRecord, TopologyRecord, decode, keys,
};
use flotilla_transport::broker::{BrokerError, OutboundMessage};
use flotilla_transport::kv::KvError;
use flotilla_transport::wire::{MessageId, StreamName, Subjects, headers};
use futures::future::FutureExt;
use futures::stream::{BoxStream, StreamExt};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// A drain requested for the current run and not finished.
#[derive(Debug, Clone, Serialize)]
pub struct PendingDrain {
    /// The run.
    pub run_id: String,
    /// When it was requested (ms since the Unix epoch).
    pub issued_ms: u64,
    /// Partitions drained so far.
    pub drained: usize,
    /// Ordered partitions in all.
    pub partitions: usize,
}

impl ControlClient {
    /// The drain of `run` when one was requested and not every partition finished it.
    pub(super) async fn pending_drain(
        &self,
        run: &str,
        topology: &TopologyRecord,
    ) -> Result<Option<PendingDrain>, ControlError> {
        let Some(entry) = self.broker.kv_get(&self.buckets.control, keys::DRAIN).await? else { return Ok(None) };
        let Ok(record) = decode::<RequestRecord>(keys::DRAIN, &entry.value) else { return Ok(None) };
        if record.run_id != run {
            return Ok(None);
        }
        let parts = topology.partitions();
        let drained = self.done_parts(&parts, run).await?.len();
        Ok((drained < parts.len()).then(|| PendingDrain {
            run_id: run.to_owned(),
            issued_ms: record.issued_ms,
            drained,
            partitions: parts.len(),
        }))
    }

    /// Cancels the current run's pending drain: a new run begins (its id in the CONTROL
    /// bucket), so nodes that start from now on pass the old run's markers and take the
    /// drained partitions up again; nodes still running in the old run keep draining
    /// until they are restarted. Returns what happened, for people.
    ///
    /// # Errors
    /// Broker failures; [`ControlError::Incomplete`] when the run changed meanwhile.
    pub async fn cancel_drain(&self) -> Result<String, ControlError> {
        let Some(entry) = self.broker.kv_get(&self.buckets.control, keys::RUN).await? else {
            return Ok("no drain is pending: the job has no run yet".into());
        };
        let current = serde_json::from_slice::<RunRecord>(&entry.value)
            .map_err(|e| ControlError::Refused(format!("the job's run record does not parse: {e}")))?;
        let topology = self.topology().await?;
        if self.pending_drain(&current.run_id, &topology).await?.is_none() {
            return Ok(format!("no drain is pending for run {}: nothing was changed", current.run_id));
        }
        let fresh = RunRecord { run_id: MessageId::new_v7().to_string(), started_ms: now_ms() };
        match self.broker.kv_update(&self.buckets.control, keys::RUN, json(&fresh), entry.revision).await {
            Ok(_) => {}
            Err(BrokerError::KvWrongRevision { .. }) => {
                return Err(ControlError::Incomplete(
                    "the run changed while cancelling (a node began a new one): check `status` and try again".into(),
                ));
            }
            Err(e) => return Err(e.into()),
        }
        // The drain record stays: it names the old run, so nodes of the new run ignore it
        // and nodes still in the old run keep draining as they were asked.
        let live = self.members().await?.len();
        Ok(format!(
            "drain of run {} cancelled: run {} begins, and nodes started from now on pass the old markers{}",
            current.run_id,
            fresh.run_id,
            if live > 0 {
                format!(
                    "; the {live} node(s) still running keep draining run {}: restart them (`stop --node ID`, then start) to join the new run",
                    current.run_id
                )
            } else {
                String::new()
            }
        ))
    }

    /// Appends a drain marker to every ordered partition, then waits until each
    /// partition has processed everything before it (or the deadline passes).
    ///
    /// # Errors
    /// [`ControlError::Refused`] for a stale run, [`ControlError::Incomplete`] naming the
    /// partitions still short of their marker at the deadline.
    pub async fn drain(&self, run: Option<String>, deadline: Duration, progress: bool) -> Result<(), ControlError> {
        let current = self.run_id().await?.ok_or_else(|| ControlError::Refused("the job has no run yet".into()))?;
        if let Some(r) = &run
            && *r != current
        {
            return Err(ControlError::Refused(format!(
                "stale run id {r}: the current run is {current}; nothing was changed"
            )));
        }
        let topology = self.topology().await?;
        let parts = topology.partitions();
        if parts.is_empty() {
            return Err(ControlError::Refused(format!(
                "job {} has no ordered inputs: drain markers only apply to ordered partitions (use shutdown for queue inputs)",
                self.job
            )));
        }
        let mut request = self.request();
        request.run_id = Some(current.clone());
        let record =
            RequestRecord { request_id: request.request_id.clone(), run_id: current.clone(), issued_ms: now_ms() };
        self.broker.kv_put(&self.buckets.control, keys::DRAIN, json(&record)).await?;
        let mut markers = BTreeMap::new();
        for (stream, p) in &parts {
            let name = StreamName::new(stream.clone()).map_err(|e| ControlError::Refused(e.to_string()))?;
            let msg = OutboundMessage::new(self.subjects.ordered_partition(&name, *p), bytes::Bytes::new())
                .with_id(format!("drain-{current}-{stream}-{p}"))
                .with_header(headers::KIND, "drain")
                .with_header(headers::RUN, current.clone());
            let ack = self.broker.publish(msg).await?;
            markers.insert((stream.clone(), *p), ack.seq);
        }
        if progress {
            crate::outln!(
                "drain: markers of run {current} appended to {} partitions; waiting (deadline {deadline:?})",
                parts.len()
            );
        }
        let _ = self.broadcast("drain", &request).await;
        let started = Instant::now();
        let mut last_done = usize::MAX;
        // The partitions' drained and ended records arrive as changes of the CONTROL
        // bucket; every RECHECK all of them are read again, which covers a watch that
        // stalled or ended (a server restart) and is the whole story when none started.
        let mut changes = self.done_changes(&current).await;
        let mut seen: BTreeMap<String, bool> = BTreeMap::new();
        let mut read_at = None::<Instant>;
        let mut read_done = BTreeSet::new();
        loop {
            if read_at.is_none_or(|at| at.elapsed() >= RECHECK) {
                read_done = self.done_parts(&parts, &current).await?;
                read_at = Some(Instant::now());
            }
            let mut done = read_done.clone();
            for (stream, p) in &parts {
                if seen.get(&keys::drained(stream, *p)) == Some(&true)
                    || seen.get(&keys::ended(stream, *p)) == Some(&true)
                {
                    done.insert((stream.clone(), *p));
                }
            }
            if done.len() != last_done && progress {
                last_done = done.len();
                let waiting: Vec<String> =
                    parts.iter().filter(|p| !done.contains(*p)).map(|(s, p)| format!("{s}/{p}")).collect();
                crate::outln!(
                    "drain: {}/{} partitions drained ({:.1}s){}",
                    done.len(),
                    parts.len(),
                    started.elapsed().as_secs_f64(),
                    if waiting.is_empty() { String::new() } else { format!("; waiting for {}", waiting.join(" ")) }
                );
            }
            if done.len() == parts.len() {
                if progress {
                    crate::outln!("drain: done; every partition processed everything before its marker");
                }
                return Ok(());
            }
            if started.elapsed() >= deadline {
                let mut stuck = Vec::new();
                for (stream, p) in parts.iter().filter(|p| !done.contains(*p)) {
                    let name = StreamName::new(stream.clone()).map_err(|e| ControlError::Refused(e.to_string()))?;
                    let js = self.subjects.stream_name(&name);
                    let floor = self
                        .broker
                        .consumer_state(&js, &Subjects::partition_consumer(&name, *p))
                        .await
                        .map(|c| c.ack_floor)
                        .unwrap_or(0);
                    let owner = match self.broker.kv_get(&self.buckets.leases, &keys::lease(stream, *p)).await? {
                        Some(e) => decode::<LeaseRecord>("lease", &e.value).map(|l| l.node).unwrap_or_default(),
                        None => "nobody".into(),
                    };
                    let marker = markers.get(&(stream.clone(), *p)).copied().unwrap_or(0);
                    stuck.push(format!(
                        "{stream}/{p} (held by {owner}; committed up to stream seq {floor}, marker at {marker})"
                    ));
                }
                return Err(ControlError::Incomplete(format!(
                    "drain deadline {deadline:?} passed with {} of {} partitions not drained: {}",
                    stuck.len(),
                    parts.len(),
                    stuck.join(", ")
                )));
            }
            let wait = RECHECK.min(deadline.saturating_sub(started.elapsed())).max(Duration::from_millis(10));
            match &mut changes {
                Some(stream) => match tokio::time::timeout(wait, stream.next()).await {
                    Ok(Some(Ok((key, in_run)))) => {
                        seen.insert(key, in_run);
                        // Take every change already there before looking again.
                        while let Some(Some(item)) = stream.next().now_or_never() {
                            match item {
                                Ok((key, in_run)) => {
                                    seen.insert(key, in_run);
                                }
                                // A broker error: the next wait sees the stream end or
                                // fail again, and the reads take over.
                                Err(_) => break,
                            }
                        }
                    }
                    Ok(Some(Err(e))) => {
                        tracing::debug!(error = %e, "watching the drain records failed; reading them every {POLL:?}");
                        changes = None;
                    }
                    Ok(None) => changes = None,
                    Err(_) => {}
                },
                None => tokio::time::sleep(wait.min(POLL)).await,
            }
            if changes.is_none() {
                // No watch: read at the old pace.
                read_at = None;
            }
        }
    }

    /// The partitions of `parts` drained or ended in `run`, read one by one.
    async fn done_parts(&self, parts: &[(String, u32)], run: &str) -> Result<BTreeSet<(String, u32)>, ControlError> {
        let mut done = BTreeSet::new();
        for (stream, p) in parts {
            // Ended in this run counts too: no marker will be reached there.
            if read_end(&self.broker, &self.buckets.control, stream, *p, run).await?.done(true) {
                done.insert((stream.clone(), *p));
            }
        }
        Ok(done)
    }

    /// The drained and ended records as they change: `(key, whether it is done in run)`.
    /// `None` when the watches cannot start (the caller reads instead).
    async fn done_changes(&self, run: &str) -> Option<BoxStream<'static, Result<(String, bool), KvError>>> {
        let drained = self.control_key::<DrainedRecord>("drained.>").watch_keys().await.ok()?;
        let ended = self.control_key::<cluster::EndedRecord>("ended.>").watch_keys().await.ok()?;
        let (r1, r2) = (run.to_owned(), run.to_owned());
        // A record that does not decode is not done (as the reads judge it), and the
        // watch goes on.
        let drained = drained.filter_map(move |c| std::future::ready(done_in_run(c, |r| r.run_id == r1)));
        let ended = ended.filter_map(move |c| std::future::ready(done_in_run(c, |r| r.run_id == r2)));
        Some(futures::stream::select(drained, ended).boxed())
    }
}

/// A watched drained or ended record as `(key, done in the run)`; `None` skips an
/// undecodable record whose key the error does not carry (the reads judge it).
fn done_in_run<T>(
    change: Result<(String, Option<T>), KvError>,
    in_run: impl Fn(&T) -> bool,
) -> Option<Result<(String, bool), KvError>> {
    match change {
        Ok((key, record)) => Some(Ok((key, record.as_ref().is_some_and(in_run)))),
        Err(KvError::Undecodable { .. }) => None,
        Err(e) => Some(Err(e)),
    }
}

/// How often a waiting drain reads every partition's record again, watch or not.
const RECHECK: Duration = Duration::from_secs(5);

/// How often a drain with no watch reads them.
const POLL: Duration = Duration::from_millis(250);
