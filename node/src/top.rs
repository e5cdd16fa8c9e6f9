//! `flotilla top`: the dashboard's live view in a terminal. It reads the job's status
//! every interval (as `status` does) and redraws: nodes with uptime and work in hand,
//! every partition with its owner, backlog, age and rate, the DLQ, drains and what
//! moved since the last screen.

use crate::client::{ClusterStatus, ControlClient, ControlError};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

fn human(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms}ms"),
        1..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

fn key(stream: &str, partition: Option<u32>) -> String {
    match partition {
        Some(p) => format!("{stream}/{p}"),
        None => format!("{stream} (queue)"),
    }
}

/// One screen: `status`, with rates and moves against `previous` (read `elapsed`
/// before), at `now_ms` (Unix ms). Pure, so it is tested without a terminal.
pub fn render(status: &ClusterStatus, previous: Option<(&ClusterStatus, Duration)>, now_ms: u64) -> String {
    let mut out = String::new();
    let owned = status.partitions.iter().filter(|p| p.owner.is_some()).count();
    let backlog: u64 = status.partitions.iter().map(|p| p.backlog).sum();
    let before: BTreeMap<String, &crate::client::PartitionStatus> = previous
        .map(|(s, _)| s.partitions.iter().map(|p| (key(&p.stream, p.partition), p)).collect())
        .unwrap_or_default();
    let secs = previous.map_or(0.0, |(_, d)| d.as_secs_f64());
    let rate = |p: &crate::client::PartitionStatus| -> Option<f64> {
        let old = before.get(&key(&p.stream, p.partition))?;
        (secs > 0.0 && old.owner == p.owner && p.deliveries >= old.deliveries)
            .then(|| (p.deliveries - old.deliveries) as f64 / secs)
    };
    let total_rate: f64 = status.partitions.iter().filter_map(rate).sum();
    let _ = writeln!(
        out,
        "flotilla top — job {}  run {}  nodes {}{}  partitions owned {owned}/{}  backlog {backlog}  rate {}  dead letters {}",
        status.job,
        status.run_id.as_deref().unwrap_or("-"),
        status.nodes.len(),
        if status.silent.is_empty() { String::new() } else { format!(" (+{} silent)", status.silent.len()) },
        status.partitions.len(),
        if previous.is_some() { format!("{total_rate:.1}/s") } else { "-".into() },
        status.dlq,
    );
    if let Some(d) = &status.pending_drain {
        let _ = writeln!(
            out,
            "DRAIN of run {} asked {} ago: {}/{} partitions drained",
            d.run_id,
            human(now_ms.saturating_sub(d.issued_ms)),
            d.drained,
            d.partitions
        );
    }
    for n in status.nodes.iter().filter(|n| n.leaving) {
        let running = n.slots.iter().filter(|s| s.state != "finished").count();
        let _ = writeln!(out, "STOPPING {}: {running} partitions still running", n.node);
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<24} {:<16} {:<8} {:>9} {:>9} {:>10}  STATE",
        "NODE", "HOST", "VERSION", "UPTIME", "IN-FLIGHT", "PARTITIONS"
    );
    for n in &status.nodes {
        let parts = status.partitions.iter().filter(|p| p.owner.as_deref() == Some(n.node.as_str())).count();
        let uptime = if n.started_ms == 0 { "-".into() } else { human(now_ms.saturating_sub(n.started_ms)) };
        let _ = writeln!(
            out,
            "{:<24} {:<16} {:<8} {:>9} {:>9} {:>10}  {}",
            n.node,
            n.host,
            n.version,
            uptime,
            n.slots.iter().map(|s| s.in_flight).sum::<u64>(),
            parts,
            if n.leaving { "leaving" } else { "running" }
        );
    }
    for m in &status.silent {
        let _ = writeln!(out, "{m:<24} (did not answer: dead or stuck; its leases run out)");
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<22} {:<24} {:>7} {:>9} {:>9} {:>9} {:>9}  STATE",
        "PARTITION", "OWNER", "EPOCH", "BACKLOG", "AGE", "RATE/S", "IN-FLIGHT"
    );
    let mut moves = Vec::new();
    for p in &status.partitions {
        let k = key(&p.stream, p.partition);
        if let Some(old) = before.get(&k)
            && old.owner != p.owner
        {
            moves.push(format!(
                "{k}: {} -> {}",
                old.owner.as_deref().unwrap_or("nobody"),
                p.owner.as_deref().unwrap_or("nobody")
            ));
        }
        let state = match (&p.owner, p.paused, p.drained) {
            (None, _, true) | (Some(_), false, true) => "drained",
            (None, _, false) if p.partition.is_some() => "UNOWNED",
            (_, true, _) => "paused",
            _ => "running",
        };
        let _ = writeln!(
            out,
            "{:<22} {:<24} {:>7} {:>9} {:>9} {:>9} {:>9}  {state}",
            k,
            p.owner.as_deref().unwrap_or(if p.partition.is_some() { "-" } else { "(every node)" }),
            p.epoch.map_or("-".into(), |e| e.to_string()),
            p.backlog,
            if p.backlog == 0 { "-".into() } else { human(p.oldest_ms) },
            rate(p).map_or("-".into(), |r| format!("{r:.1}")),
            p.in_flight,
        );
    }
    if !moves.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(out, "MOVED since the last screen: {}", moves.join(", "));
    }
    out
}

/// Redraws every `interval` until interrupted; `once` prints one screen (with rates
/// over `interval`) and returns.
///
/// # Errors
/// Broker failures reading the status.
pub async fn run(client: &ControlClient, interval: Duration, once: bool) -> Result<(), ControlError> {
    let tty = std::io::stdout().is_terminal();
    let mut previous: Option<(ClusterStatus, Instant)> = None;
    loop {
        let status = client.status().await?;
        let now = Instant::now();
        if once && previous.is_none() {
            previous = Some((status, now));
            tokio::time::sleep(interval).await;
            continue;
        }
        let screen = render(
            &status,
            previous.as_ref().map(|(s, at)| (s, now.duration_since(*at))),
            flotilla_actors::cluster::now_ms(),
        );
        if tty && !once {
            // Home and clear: one screen, redrawn in place.
            crate::outln!("\x1b[H\x1b[2J{}", screen.trim_end());
        } else {
            crate::outln!("{}", screen.trim_end());
        }
        if once {
            return Ok(());
        }
        previous = Some((status, now));
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::PartitionStatus;
    use flotilla_proto::cluster::control::{NodeStatus, PauseRecord};

    fn partition(p: u32, owner: Option<&str>, deliveries: u64, backlog: u64) -> PartitionStatus {
        PartitionStatus {
            stream: "in".into(),
            partition: Some(p),
            owner: owner.map(str::to_owned),
            epoch: owner.map(|_| 3),
            backlog,
            oldest_ms: if backlog > 0 { 90_000 } else { 0 },
            in_flight: 0,
            deliveries,
            redeliveries: 0,
            paused: false,
            drained: false,
        }
    }

    fn status(partitions: Vec<PartitionStatus>, nodes: &[&str]) -> ClusterStatus {
        ClusterStatus {
            job: "shop".into(),
            run_id: Some("r1".into()),
            members: nodes.iter().map(|n| (*n).to_owned()).collect(),
            nodes: nodes
                .iter()
                .map(|n| NodeStatus {
                    node: (*n).to_owned(),
                    pid: 1,
                    run_id: "r1".into(),
                    leaving: false,
                    host: "h".into(),
                    version: "0.1.0".into(),
                    started_ms: 1_000,
                    slots: Vec::new(),
                    more_from: None,
                })
                .collect(),
            silent: Vec::new(),
            partitions,
            dlq: 2,
            dlq_bytes: 0,
            dlq_oldest_age_ms: None,
            pending_drain: None,
            parked_keys: BTreeMap::new(),
            parked_messages: 0,
            unreachable: BTreeMap::new(),
            paused: PauseRecord::default(),
        }
    }

    #[test]
    fn a_screen_shows_rates_moves_and_unowned_partitions() {
        let before = status(vec![partition(0, Some("a"), 100, 0), partition(1, Some("b"), 50, 0)], &["a", "b"]);
        let after = status(vec![partition(0, Some("a"), 120, 0), partition(1, None, 50, 7)], &["a"]);
        let screen = render(&after, Some((&before, Duration::from_secs(2))), 61_000);
        assert!(screen.contains("job shop"), "{screen}");
        assert!(screen.contains("partitions owned 1/2"), "{screen}");
        assert!(screen.contains("rate 10.0/s"), "20 deliveries in 2 s: {screen}");
        assert!(screen.contains("dead letters 2"), "{screen}");
        assert!(screen.contains("UNOWNED"), "{screen}");
        assert!(screen.contains("1m30s"), "the age of partition 1's oldest message: {screen}");
        assert!(screen.contains("1m00s"), "node a's uptime: {screen}");
        assert!(screen.contains("MOVED since the last screen: in/1: b -> nobody"), "{screen}");
        // The first screen has no rates and no moves.
        let first = render(&before, None, 61_000);
        assert!(first.contains("rate -") && !first.contains("MOVED"), "{first}");
    }
}
