//! `stop` and `shutdown`: nodes leave gracefully, and the client waits until they have.

use super::{ControlClient, ControlError, json};
use flotilla_actors::cluster::now_ms;
use flotilla_proto::cluster::control::{NodeRecord, RequestRecord, keys};
use flotilla_transport::kv::{KvError, TypedKey};
use futures::future::FutureExt;
use futures::stream::StreamExt;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// How often a client waiting for nodes to leave lists them again, watch or not.
const RECHECK: Duration = Duration::from_secs(1);

/// How often it lists them with no watch.
const POLL: Duration = Duration::from_millis(200);

impl ControlClient {
    async fn wait_gone(&self, nodes: &BTreeSet<String>, timeout: Duration, progress: bool) -> Result<(), ControlError> {
        let started = Instant::now();
        let mut last = usize::MAX;
        // A node that leaves deletes its record: the watch wakes this up then. One that
        // dies only expires, which raises no event, so the members are listed again
        // every RECHECK as well (and at the old pace when no watch started).
        let mut changes =
            TypedKey::<NodeRecord>::new(self.broker.clone(), self.buckets.nodes.clone(), ">").watch_keys().await.ok();
        loop {
            let live = self.members().await?;
            let left: Vec<&String> = nodes.iter().filter(|n| live.contains(*n)).collect();
            if left.len() != last && progress {
                last = left.len();
                if left.is_empty() {
                    crate::outln!("all {} node(s) have left ({:.1}s)", nodes.len(), started.elapsed().as_secs_f64());
                } else {
                    let names: Vec<&str> = left.iter().map(|s| s.as_str()).collect();
                    crate::outln!(
                        "waiting for {} of {} node(s) to leave: {}",
                        left.len(),
                        nodes.len(),
                        names.join(", ")
                    );
                }
            }
            if left.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                let names: Vec<&str> = left.iter().map(|s| s.as_str()).collect();
                return Err(ControlError::Incomplete(format!(
                    "timeout {timeout:?}: still alive: {}",
                    names.join(", ")
                )));
            }
            let wait = RECHECK.min(timeout.saturating_sub(started.elapsed())).max(Duration::from_millis(10));
            let until = tokio::time::Instant::now() + wait;
            let mut lost = false;
            match &mut changes {
                Some(stream) => loop {
                    match tokio::time::timeout_at(until, stream.next()).await {
                        // A heartbeat: nobody left.
                        Ok(Some(Ok((_, Some(_))))) => continue,
                        // A record went (or one we cannot read changed): list the members
                        // again, after the rest of the burst.
                        Ok(Some(Ok((_, None)) | Err(KvError::Undecodable { .. }))) => {
                            loop {
                                match stream.next().now_or_never() {
                                    Some(Some(Ok(_) | Err(KvError::Undecodable { .. }))) => {}
                                    Some(Some(Err(_)) | None) => {
                                        lost = true;
                                        break;
                                    }
                                    None => break,
                                }
                            }
                            break;
                        }
                        Ok(Some(Err(_)) | None) => {
                            lost = true;
                            break;
                        }
                        Err(_) => break,
                    }
                },
                None => tokio::time::sleep(wait.min(POLL)).await,
            }
            if lost {
                changes = None;
            }
        }
    }

    /// Makes `node` leave gracefully and waits until it has.
    ///
    /// # Errors
    /// [`ControlError::Refused`] when `node` is not a live member.
    pub async fn stop(&self, node: &str, timeout: Duration, progress: bool) -> Result<(), ControlError> {
        let members = self.members().await?;
        if !members.contains(node) {
            let live: Vec<&str> = members.iter().map(String::as_str).collect();
            return Err(ControlError::Refused(format!(
                "node {node:?} is not a live member of job {}; live nodes: {}",
                self.job,
                if live.is_empty() { "none".to_owned() } else { live.join(", ") }
            )));
        }
        let request = self.request();
        let record = RequestRecord {
            request_id: request.request_id.clone(),
            run_id: self.run_id().await?.unwrap_or_default(),
            issued_ms: now_ms(),
        };
        self.broker.kv_put(&self.buckets.control, &keys::stop(node), json(&record)).await?;
        match self.ask(node, "stop", &request).await {
            Ok(r) if progress => crate::outln!("{}: {}", r.node, r.message),
            Ok(_) => {}
            // It reads the desired state on its next scan anyway.
            Err(e) if progress => crate::outln!("{e}; it will read the stop request from the control bucket"),
            Err(_) => {}
        }
        self.wait_gone(&BTreeSet::from([node.to_owned()]), timeout, progress).await
    }

    /// Makes every node leave and exit, and waits until each has.
    ///
    /// # Errors
    /// [`ControlError::Incomplete`] naming the nodes still alive at the timeout.
    pub async fn shutdown(&self, timeout: Duration, progress: bool) -> Result<(), ControlError> {
        let members = self.members().await?;
        let request = self.request();
        let record = RequestRecord {
            request_id: request.request_id.clone(),
            run_id: self.run_id().await?.unwrap_or_default(),
            issued_ms: now_ms(),
        };
        self.broker.kv_put(&self.buckets.control, keys::SHUTDOWN, json(&record)).await?;
        if progress {
            crate::outln!("shutdown requested; {} live node(s)", members.len());
        }
        let replies = self.broadcast("shutdown", &request).await?;
        if progress {
            for r in &replies {
                crate::outln!("{}: {}", r.node, r.message);
            }
        }
        self.wait_gone(&members, timeout, progress).await
    }
}
