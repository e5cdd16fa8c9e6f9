//! What the nodes of a job share: the records they keep in the job's KV buckets and the
//! control requests and replies they exchange (DESIGN §3 mapping, §7). All of it is JSON,
//! so an operator (or a script in any language) can read and write it.
//!
//! | bucket | key | value |
//! |---|---|---|
//! | `FLOTILLA_<J>_NODES` (expiry: `node_ttl`) | node id | [`NodeRecord`], rewritten by compare-and-set every `node_ttl / 3` |
//! | `FLOTILLA_<J>_LEASES` (expiry: `lease_ttl`) | `<stream>.<partition>` | [`LeaseRecord`]; the revision at acquisition is the fencing epoch |
//! | `FLOTILLA_<J>_CONTROL` (no expiry) | `run`, `topology`, `paused`, `drain`, `drained.<stream>.<p>`, `shutdown`, `stop.<node>` | the desired state; also `clock`, which timer services write to read the server's clock (`flotilla_actors::timer_service::server_clock`) |
//!
//! Control requests go over core NATS: `flotilla.<J>._ctl.all.<verb>` reaches every node
//! (scatter-gather: each replies), `flotilla.<J>._ctl.node.<id>.<verb>` one node. Every
//! request carries a request id; a node remembers the last ids it handled and answers a
//! repeat without acting again. The KV holds the truth, requests only wake nodes up.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::time::Duration;

/// The membership bucket's name (within the job).
pub const NODES: &str = "NODES";
/// The lease bucket's name.
pub const LEASES: &str = "LEASES";
/// The desired-state bucket's name.
pub const CONTROL: &str = "CONTROL";

/// Control keys.
pub mod keys {
    /// The current run.
    pub const RUN: &str = "run";
    /// The job's inputs, so tools need no job code.
    pub const TOPOLOGY: &str = "topology";
    /// What is paused.
    pub const PAUSED: &str = "paused";
    /// A drain was requested.
    pub const DRAIN: &str = "drain";
    /// A shutdown was requested.
    pub const SHUTDOWN: &str = "shutdown";

    /// The lease key of a partition.
    pub fn lease(stream: &str, partition: u32) -> String {
        format!("{stream}.{partition}")
    }

    /// The key holding the parked keys of queue inputs.
    pub const PARKED: &str = "parked";

    /// The key recording that a partition reached its end of stream (or its task asked
    /// to shut down) in a run.
    pub fn ended(stream: &str, partition: u32) -> String {
        format!("ended.{stream}.{partition}")
    }

    /// The key recording that a partition is drained.
    pub fn drained(stream: &str, partition: u32) -> String {
        format!("drained.{stream}.{partition}")
    }

    /// The key asking one node to stop.
    pub fn stop(node: &str) -> String {
        format!("stop.{node}")
    }
}

/// Cluster timing.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// A lease expires this long after its last renewal (server-side). Renewed every
    /// third of it; a node stops a partition it could not renew after two thirds.
    pub lease_ttl: Duration,
    /// A node's membership expires this long after its last heartbeat.
    pub node_ttl: Duration,
    /// How often a node looks at leases, members and the desired state.
    pub scan_interval: Duration,
    /// Membership must be unchanged this long before partitions move between live nodes.
    pub settle: Duration,
    /// Partitions a node hands over per scan (rebalancing is rate-limited).
    pub max_moves: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(6),
            node_ttl: Duration::from_secs(6),
            scan_interval: Duration::from_secs(1),
            settle: Duration::from_secs(2),
            max_moves: 2,
        }
    }
}

/// A live node (NODES bucket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node id.
    pub node: String,
    /// Its process id.
    pub pid: u32,
    /// Its host name.
    pub host: String,
    /// When it started (ms since the Unix epoch).
    pub started_ms: u64,
    /// This process's incarnation of the node id (a fresh id per start): leases name it,
    /// so a restarted node tells its dead predecessor's leases from its own.
    #[serde(default)]
    pub incarnation: String,
}

impl NodeRecord {
    /// Whether this record, found under the id a process on `host` with `pid` wants,
    /// provably belongs to a process that is gone: one on the same host whose pid is
    /// ours (a restart that got the same pid, as in a container) or no longer alive.
    /// Anything else may be alive: the caller waits to see whether it is renewed.
    pub fn provably_gone(&self, host: &str, pid: u32, alive: impl Fn(u32) -> bool) -> bool {
        self.host == host && (self.pid == pid || !alive(self.pid))
    }
}

/// A partition's holder (LEASES bucket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The holding node.
    pub node: String,
    /// The epoch (the revision at which the holder acquired it; 0 in the first write).
    pub epoch: u64,
    /// The holder's incarnation ([`NodeRecord::incarnation`]); empty from older nodes.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub incarnation: String,
}

impl LeaseRecord {
    /// Whether the lease is held by this process: this node id, this incarnation.
    pub fn held_by(&self, node: &str, incarnation: &str) -> bool {
        self.node == node && self.incarnation == incarnation
    }

    /// Whether the lease was left by an earlier incarnation of `node` (a process that
    /// had this id before this one took it over).
    pub fn left_by_earlier(&self, node: &str, incarnation: &str) -> bool {
        self.node == node && self.incarnation != incarnation
    }
}

/// The current run (drain markers of other runs are dropped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run id.
    pub run_id: String,
    /// When it began (ms since the Unix epoch).
    pub started_ms: u64,
}

/// One input of the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRecord {
    /// The stream's name.
    pub stream: String,
    /// Partitions (ordered inputs); `None` for a queue input.
    pub partitions: Option<u32>,
}

/// The job's inputs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TopologyRecord {
    /// The inputs.
    pub inputs: Vec<InputRecord>,
}

impl TopologyRecord {
    /// Every ordered `(stream, partition)`.
    pub fn partitions(&self) -> Vec<(String, u32)> {
        self.inputs
            .iter()
            .filter_map(|i| i.partitions.map(|n| (i.stream.clone(), n)))
            .flat_map(|(s, n)| (0..n).map(move |p| (s.clone(), p)))
            .collect()
    }
}

/// What is paused: the whole job, some streams, some partitions (`stream/p`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PauseRecord {
    /// The whole job.
    pub job: bool,
    /// Whole streams.
    pub streams: BTreeSet<String>,
    /// Single partitions, as `stream/partition`.
    pub partitions: BTreeSet<String>,
}

impl PauseRecord {
    /// Whether a slot of `stream` (and `partition`) is paused.
    pub fn covers(&self, stream: &str, partition: Option<u32>) -> bool {
        self.job
            || self.streams.contains(stream)
            || partition.is_some_and(|p| self.partitions.contains(&format!("{stream}/{p}")))
    }
}

/// A requested drain or shutdown or stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The request id.
    pub request_id: String,
    /// The run it applies to.
    pub run_id: String,
    /// When it was issued (ms since the Unix epoch).
    pub issued_ms: u64,
}

/// A partition that processed an end-of-stream marker (or whose task asked to shut
/// down) in a run: when every ordered partition of the job is ended or drained, the run
/// is over and every node leaves. The same record as a drained partition's.
pub type EndedRecord = DrainedRecord;

/// The keys parked on queue inputs: stream → keys.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ParkedRecord {
    /// Parked keys per queue input.
    pub keys: std::collections::BTreeMap<String, BTreeSet<String>>,
}

/// A partition that processed its drain marker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainedRecord {
    /// The run it was drained in.
    pub run_id: String,
    /// The node that drained it.
    pub node: String,
}

/// The verbs nodes answer.
pub const VERBS: &[&str] = &["status", "pause", "resume", "step", "stop", "shutdown", "drain"];

/// A control request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlRequest {
    /// Unique per request; a repeat is answered without acting again.
    pub request_id: String,
    /// The run the sender believes is current (checked where it matters).
    #[serde(default)]
    pub run_id: Option<String>,
    /// The stream it targets (`pause`, `resume`, `step`).
    #[serde(default)]
    pub stream: Option<String>,
    /// The partition it targets.
    #[serde(default)]
    pub partition: Option<u32>,
    /// `status`: the first of the node's slots to report. A node answers with at most
    /// [`STATUS_PAGE`] slots and says where the next page starts
    /// ([`NodeStatus::more_from`]), so a node with 10,000 partitions stays under
    /// NATS's message size limit.
    #[serde(default)]
    pub offset: Option<u64>,
}

/// Whether a control request's reply subject is one a node answers on: a requester's
/// inbox (`_INBOX.…`, as every NATS client makes them), nothing else. A reply subject
/// is chosen by whoever sends the request, so answering anywhere would let anyone who
/// may publish a control request make a node publish to the JetStream API
/// (`$JS.API.STREAM.DELETE.…`), another job or its own control plane.
pub fn reply_subject_allowed(subject: &str) -> bool {
    subject.strip_prefix("_INBOX.").is_some_and(|rest| {
        !rest.is_empty()
            && rest.split('.').all(|t| !t.is_empty() && t != "*" && t != ">")
            && !rest.contains(char::is_whitespace)
    })
}

/// The most slots one `status` reply carries.
pub const STATUS_PAGE: usize = 500;

/// The page of `slots` that starts at `from`, and where the next one starts.
pub fn status_page(mut slots: Vec<SlotStatus>, from: usize) -> (Vec<SlotStatus>, Option<u64>) {
    let total = slots.len();
    let end = from.saturating_add(STATUS_PAGE).min(total);
    let page = if from < end { slots.drain(from..end).collect() } else { Vec::new() };
    (page, (end < total).then_some(end as u64))
}

/// A node's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlReply {
    /// The answering node.
    pub node: String,
    /// The request answered.
    pub request_id: String,
    /// Whether it was accepted.
    pub ok: bool,
    /// What happened, for a human.
    pub message: String,
    /// The request had been handled before; nothing was done again.
    #[serde(default)]
    pub duplicate: bool,
    /// This node acted on it (for example: it holds the partition it stepped).
    #[serde(default)]
    pub acted: bool,
    /// `status` only.
    #[serde(default)]
    pub status: Option<NodeStatus>,
}

/// One node's state (`status`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// The node id.
    pub node: String,
    /// Its process id.
    pub pid: u32,
    /// The run it runs.
    pub run_id: String,
    /// It is leaving.
    pub leaving: bool,
    /// Its host name.
    #[serde(default)]
    pub host: String,
    /// Flotilla's version on it.
    #[serde(default)]
    pub version: String,
    /// When it started (ms since the Unix epoch; 0 from nodes before 0.1 that did not say).
    #[serde(default)]
    pub started_ms: u64,
    /// What it consumes (one page of it: see [`ControlRequest::offset`]).
    pub slots: Vec<SlotStatus>,
    /// Where the next page of its slots starts, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub more_from: Option<u64>,
}

/// One input partition (or queue input) on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotStatus {
    /// The stream.
    pub stream: String,
    /// The partition (ordered).
    pub partition: Option<u32>,
    /// The lease epoch (0 for queue inputs).
    pub epoch: u64,
    /// Messages claimed and not finished.
    pub in_flight: u64,
    /// Messages delivered to this node for the slot.
    pub deliveries: u64,
    /// Of those, redeliveries (delivery count above 1).
    pub redeliveries: u64,
    /// Intake is paused.
    pub paused: bool,
    /// `running`, `stopping`, `finished`.
    pub state: String,
}

/// Why a node leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaveReason {
    /// A signal (SIGTERM / SIGINT) or the job asked.
    Requested,
    /// `flotilla stop --node <this node>`.
    StopRequested,
    /// `flotilla shutdown`.
    Shutdown,
    /// Every partition processed its drain marker: the run is over.
    Drained,
    /// Every partition processed an end-of-stream marker: the run is over.
    Ended,
}

/// A record or request (JSON) that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ControlDecodeError {
    /// The bytes are not the JSON of the expected record.
    #[error("cannot read {what}: {source}")]
    Malformed {
        /// What was read (a key, a request).
        what: String,
        /// Why serde refused it.
        #[source]
        source: serde_json::Error,
    },
}

impl ControlDecodeError {
    /// What the decoder said, without the name of what was read.
    pub fn reason(&self) -> String {
        match self {
            ControlDecodeError::Malformed { source, .. } => source.to_string(),
        }
    }
}

/// The one decode policy for the records and requests of this module: JSON, unknown
/// fields ignored, missing `#[serde(default)]` fields defaulted. What a caller does with
/// an error (skip the record, use the default, refuse a request) is its own choice.
///
/// # Errors
/// [`ControlDecodeError::Malformed`] when `bytes` are not the JSON of a `T`; `what`
/// names the record in the message.
pub fn decode<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, ControlDecodeError> {
    serde_json::from_slice(bytes).map_err(|source| ControlDecodeError::Malformed { what: what.to_owned(), source })
}

/// The JSON of a record, as nodes store it (empty should it not serialize, which the
/// records here cannot fail to).
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(record).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_covers_job_stream_and_partition() {
        let mut p = PauseRecord::default();
        assert!(!p.covers("in", Some(1)));
        p.partitions.insert("in/1".into());
        assert!(p.covers("in", Some(1)) && !p.covers("in", Some(2)) && !p.covers("in", None));
        p.streams.insert("jobs".into());
        assert!(p.covers("jobs", None));
        p.job = true;
        assert!(p.covers("other", Some(7)));
    }

    #[test]
    fn topology_lists_ordered_partitions_only() {
        let t = TopologyRecord {
            inputs: vec![
                InputRecord { stream: "a".into(), partitions: Some(2) },
                InputRecord { stream: "q".into(), partitions: None },
            ],
        };
        assert_eq!(t.partitions(), vec![("a".to_string(), 0), ("a".to_string(), 1)]);
    }

    #[test]
    fn a_previous_incarnation_is_gone_only_when_provable_on_this_host() {
        let rec = |host: &str, pid: u32| NodeRecord {
            node: "a".into(),
            pid,
            host: host.into(),
            started_ms: 0,
            incarnation: "old".into(),
        };
        let alive = |pid: u32| pid == 7;
        assert!(rec("vm", 9).provably_gone("vm", 100, alive), "same host, pid gone");
        assert!(!rec("vm", 7).provably_gone("vm", 100, alive), "same host, pid alive: maybe the live duplicate");
        assert!(rec("vm", 100).provably_gone("vm", 100, alive), "our own pid (a container restart): gone");
        assert!(!rec("other", 9).provably_gone("vm", 100, alive), "another host: not provable from here");
    }

    #[test]
    fn leases_tell_this_incarnation_from_an_earlier_one() {
        let lease = |node: &str, inc: &str| LeaseRecord { node: node.into(), epoch: 3, incarnation: inc.into() };
        assert!(lease("a", "i2").held_by("a", "i2"));
        assert!(!lease("a", "i1").held_by("a", "i2"));
        assert!(lease("a", "i1").left_by_earlier("a", "i2"));
        assert!(!lease("b", "i1").left_by_earlier("a", "i2"), "another node's lease");
        assert!(!lease("a", "i2").left_by_earlier("a", "i2"));
        // A record from a node without incarnations reads as an earlier one.
        let old: LeaseRecord = serde_json::from_str(r#"{"node":"a","epoch":3}"#).expect("old record");
        assert!(old.left_by_earlier("a", "i2"));
    }

    #[test]
    fn status_comes_in_pages_that_cover_every_slot_once() {
        let slot = |p: u32| SlotStatus {
            stream: "in".into(),
            partition: Some(p),
            epoch: 1,
            in_flight: 0,
            deliveries: 0,
            redeliveries: 0,
            paused: false,
            state: "running".into(),
        };
        let all: Vec<SlotStatus> = (0..1234).map(slot).collect();
        let mut seen = Vec::new();
        let mut from = Some(0u64);
        let mut pages = 0;
        while let Some(f) = from {
            let (page, next) = status_page(all.clone(), f as usize);
            assert!(page.len() <= STATUS_PAGE);
            seen.extend(page);
            from = next;
            pages += 1;
        }
        assert_eq!((pages, seen), (3, all.clone()));
        assert_eq!(status_page(all.clone(), 5000), (Vec::new(), None), "an offset past the end");
        assert_eq!(status_page(Vec::new(), 0), (Vec::new(), None));
        // A page is small enough for NATS's default 1 MiB payload, with room to spare.
        let (page, _) = status_page(all, 0);
        let bytes = serde_json::to_vec(&page).expect("json").len();
        assert!(bytes < 256 * 1024, "{bytes} bytes in one page");
    }

    #[test]
    fn nodes_answer_control_requests_only_on_inboxes() {
        for ok in ["_INBOX.abc", "_INBOX.N1x2.7", "_INBOX.a.b.c"] {
            assert!(reply_subject_allowed(ok), "{ok}");
        }
        for bad in [
            "$JS.API.STREAM.DELETE.FLOTILLA_relay_relay-in",
            "flotilla.relay._ctl.all.shutdown",
            "flotilla.relay.relay-out.1",
            "_INBOX.",
            "_INBOX",
            "_INBOX.>",
            "_INBOX.a.*",
            "_INBOX.a..b",
            "_INBOX.a b",
            "x_INBOX.a",
        ] {
            assert!(!reply_subject_allowed(bad), "{bad}");
        }
    }

    #[test]
    fn decode_reads_records_and_names_what_it_could_not_read() {
        let run = RunRecord { run_id: "r1".into(), started_ms: 5 };
        assert_eq!(decode::<RunRecord>("run", &encode(&run)).expect("round trip"), run);
        let lease = LeaseRecord { node: "a".into(), epoch: 9, incarnation: "i".into() };
        assert_eq!(decode::<LeaseRecord>("lease", &encode(&lease)).expect("round trip"), lease);
        let mut pause = PauseRecord::default();
        pause.streams.insert("in".into());
        pause.partitions.insert("in/2".into());
        assert_eq!(decode::<PauseRecord>("paused", &encode(&pause)).expect("round trip"), pause);
        let req = ControlRequest {
            request_id: "q".into(),
            run_id: Some("r".into()),
            stream: None,
            partition: Some(3),
            offset: None,
        };
        assert_eq!(decode::<ControlRequest>("request", &encode(&req)).expect("round trip"), req);
        // Defaults and unknown fields: older and newer nodes read each other.
        let req: ControlRequest = decode("request", br#"{"request_id":"x","new_field":1}"#).expect("defaults");
        assert_eq!((req.run_id, req.partition, req.offset), (None, None, None));
        let err = decode::<RunRecord>("key run", b"not json").expect_err("garbage");
        assert!(matches!(&err, ControlDecodeError::Malformed { what, .. } if what == "key run"));
        assert!(err.to_string().starts_with("cannot read key run: "), "{err}");
        assert!(decode::<DrainedRecord>("drained", br#"{"run_id":"r"}"#).is_err(), "a missing field");
    }

    #[test]
    fn replies_round_trip_with_a_status_page() {
        let reply = ControlReply {
            node: "a".into(),
            request_id: "q".into(),
            ok: true,
            message: "ok".into(),
            duplicate: false,
            acted: true,
            status: Some(NodeStatus {
                node: "a".into(),
                pid: 1,
                run_id: "r".into(),
                leaving: false,
                host: "h".into(),
                version: "0.1.0".into(),
                started_ms: 2,
                slots: Vec::new(),
                more_from: Some(500),
            }),
        };
        assert_eq!(decode::<ControlReply>("reply", &encode(&reply)).expect("round trip"), reply);
    }
}
