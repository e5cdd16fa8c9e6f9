//! `publish`: records into a job's stream from the command line.
//!
//! The `flotilla` binary knows no types, so it sends payloads as given (`--data`,
//! `--file`, or one JSON line per record with `--jsonl`). A job binary knows its
//! streams' types ([`StreamType`]), so it also takes values as JSON (`--json`, or a
//! `value` in each JSON line) and encodes them as its tasks expect.
//!
//! Either way a record gets what a task's output gets: the partition from its key
//! (the same hash), a new `Nats-Msg-Id` unless one is given, `Flotilla-Key`,
//! `Flotilla-Type` and `Flotilla-Sent`. The stream's layout comes from the job's types
//! or, for `flotilla`, from the stream on the server; a partition the stream does not
//! have is refused before anything is sent.

use crate::client::ControlError;
use crate::cluster::Buckets;
use flotilla_actors::store::{hex, unhex};
use flotilla_actors::{StreamKind, StreamType};
use flotilla_proto::cluster::control::{TopologyRecord, decode, keys};
use flotilla_transport::broker::{BrokerError, OutboundMessage, SharedBroker};
use flotilla_transport::clock::unix_millis;
use flotilla_transport::topology;
use flotilla_transport::wire::{Codec, JobName, MessageId, StreamName, Subjects, headers, partition_for};
use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Instant, SystemTime};

/// The `publish` subcommand.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:
  flotilla --job shop publish --stream orders --key customer-7 --data 'raw bytes'
  flotilla --job shop publish --stream orders --jsonl records.jsonl
  my-job publish --stream orders --key customer-7 --json '{\"id\": 1, \"cents\": 1250}'

A --jsonl line is an object: {\"key\": \"k\", \"data\": \"text\"} or {\"key\": \"k\", \"hex\": \"0a1b\"},
or in a job binary {\"key\": \"k\", \"value\": {...}}; optional \"id\", \"partition\" and \"headers\".")]
pub struct PublishArgs {
    /// The stream to publish into.
    #[arg(long)]
    pub stream: String,
    /// The record's key; an ordered stream's partition follows from it.
    #[arg(long, default_value = "")]
    pub key: String,
    /// The payload, as text.
    #[arg(long, group = "payload")]
    pub data: Option<String>,
    /// The payload, from a file (`-` for standard input).
    #[arg(long, group = "payload")]
    pub file: Option<PathBuf>,
    /// The value as JSON, encoded as the stream's type (job binaries only).
    #[arg(long, group = "payload")]
    pub json: Option<String>,
    /// One record per line of JSON, from a file (`-` for standard input).
    #[arg(long, group = "payload")]
    pub jsonl: Option<PathBuf>,
    /// Send to this partition instead of the key's.
    #[arg(long)]
    pub partition: Option<u32>,
    /// The message id (the server drops a second record with the same id within 2 minutes).
    #[arg(long)]
    pub id: Option<String>,
    /// The type name in `Flotilla-Type` (default: the stream's type, if known).
    #[arg(long = "type")]
    pub type_name: Option<String>,
    /// An extra header, `NAME=VALUE` (repeatable).
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
}

/// One record to send, before it becomes a message.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    #[serde(default)]
    key: String,
    data: Option<String>,
    hex: Option<String>,
    value: Option<serde_json::Value>,
    id: Option<String>,
    partition: Option<u32>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
}

/// Where records of a stream go.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Layout {
    Ordered(u32),
    Queue,
}

/// Publishes what `args` describe into `job`'s stream, printing a summary. `types`
/// are the streams the calling binary knows (none for `flotilla`).
///
/// # Errors
/// [`ControlError`] for bad input (nothing sent) or a broker failure.
pub async fn publish(
    broker: &SharedBroker,
    job: &str,
    args: &PublishArgs,
    types: &[StreamType],
    replicas: usize,
) -> Result<u64, ControlError> {
    let subjects = Subjects::new(JobName::new(job).map_err(|e| ControlError::Refused(e.to_string()))?);
    let stream = StreamName::new(args.stream.clone()).map_err(|e| ControlError::Refused(e.to_string()))?;
    let known = types.iter().find(|t| t.stream == args.stream);
    let layout = match known {
        Some(t) => {
            // The job binary creates its stream as the job would, so records can be
            // sent before a node ran.
            let spec = match t.kind {
                StreamKind::Ordered { partitions } => topology::ordered_stream(&subjects, &stream, partitions, None),
                StreamKind::Queue => topology::queue_stream(&subjects, &stream),
            };
            broker.ensure_stream(spec.with_replicas(replicas)).await?;
            match t.kind {
                StreamKind::Ordered { partitions } => Layout::Ordered(partitions),
                StreamKind::Queue => Layout::Queue,
            }
        }
        None => layout_on_server(broker, &subjects, &stream).await?,
    };
    let lines = read_lines(args)?;
    let codec = Codec::default();
    let mut msgs = Vec::with_capacity(lines.len());
    for (n, line) in lines.into_iter().enumerate() {
        let at = |problem: String| {
            if args.jsonl.is_some() {
                ControlError::Refused(format!("line {}: {problem}", n + 1))
            } else {
                ControlError::Refused(problem)
            }
        };
        msgs.push(message(&subjects, &stream, &layout, known, &codec, args, line).map_err(at)?);
    }
    let started = Instant::now();
    let total = msgs.len() as u64;
    let producer = flotilla_actors::Producer::new(broker.clone(), job)
        .map_err(|e| ControlError::Refused(e.to_string()))?
        .with_replicas(replicas);
    let sent = producer.send_messages(msgs, matches!(layout, Layout::Ordered(_))).await.map_err(|e| match e {
        flotilla_actors::ProducerError::Broker { .. } => ControlError::Incomplete(format!(
            "{e}; records with ids of their own (--id, \"id\") can be published again as they are, the others would be stored twice"
        )),
        e => ControlError::Refused(e.to_string()),
    })?;
    let duplicates = sent.iter().filter(|s| s.duplicate).count() as u64;
    let stored = total - duplicates;
    let dups =
        if duplicates > 0 { format!(" ({duplicates} duplicate id(s), not stored again)") } else { String::new() };
    eprintln!(
        "published {stored} of {total} record(s) into {}{dups} in {:.1?}",
        subjects.stream_name(&stream),
        started.elapsed()
    );
    Ok(stored)
}

/// The layout of a stream `flotilla` has no type for, from the server.
async fn layout_on_server(
    broker: &SharedBroker,
    subjects: &Subjects,
    stream: &StreamName,
) -> Result<Layout, ControlError> {
    let name = subjects.stream_name(stream);
    let state = match broker.stream_state(&name).await {
        Ok(s) => s,
        Err(BrokerError::StreamNotFound { .. }) => {
            return Err(ControlError::Refused(format!(
                "stream {stream} of job {} does not exist on this server: start a node of the job (it creates its streams) or publish with the job's binary",
                subjects.job()
            )));
        }
        Err(e) => return Err(e.into()),
    };
    if state.subjects == [subjects.queue(stream)] {
        return Ok(Layout::Queue);
    }
    let listed = state.subjects.iter().filter(|s| s.starts_with(&format!("{}.", subjects.queue(stream)))).count();
    if state.subjects.iter().all(|s| *s != subjects.ordered_all(stream)) && listed == state.subjects.len() {
        return Ok(Layout::Ordered(listed as u32));
    }
    // A stream made before streams listed their partitions: the job's inputs say how many.
    let control = Buckets::new(subjects).control;
    if let Ok(Some(entry)) = broker.kv_get(&control, keys::TOPOLOGY).await
        && let Ok(topology) = decode::<TopologyRecord>(keys::TOPOLOGY, &entry.value)
        && let Some(partitions) =
            topology.inputs.iter().find(|i| i.stream == stream.as_str()).and_then(|i| i.partitions)
    {
        return Ok(Layout::Ordered(partitions));
    }
    Err(ControlError::Refused(format!(
        "stream {stream} takes {:?}, and the job does not say how many partitions it has: publish with the job's binary",
        state.subjects
    )))
}

fn read_lines(args: &PublishArgs) -> Result<Vec<Line>, ControlError> {
    let read = |path: &PathBuf| -> Result<Vec<u8>, ControlError> {
        if path.as_os_str() == "-" {
            let mut buf = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)
                .map_err(|e| ControlError::Refused(format!("cannot read standard input: {e}")))?;
            Ok(buf)
        } else {
            std::fs::read(path).map_err(|e| ControlError::Refused(format!("cannot read {}: {e}", path.display())))
        }
    };
    let one = |payload: Line| {
        Ok(vec![Line { key: args.key.clone(), id: args.id.clone(), partition: args.partition, ..payload }])
    };
    if let Some(data) = &args.data {
        return one(Line { data: Some(data.clone()), ..Line::default() });
    }
    if let Some(json) = &args.json {
        let value =
            serde_json::from_str(json).map_err(|e| ControlError::Refused(format!("--json is not JSON: {e}")))?;
        return one(Line { value: Some(value), ..Line::default() });
    }
    if let Some(path) = &args.file {
        let bytes = read(path)?;
        return one(Line { hex: Some(hex(&bytes)), ..Line::default() });
    }
    let Some(path) = &args.jsonl else {
        return Err(ControlError::Refused("nothing to publish: give --data, --file, --json or --jsonl".into()));
    };
    if !args.key.is_empty() || args.id.is_some() || args.partition.is_some() {
        return Err(ControlError::Refused(
            "--key, --id and --partition are for one record: with --jsonl, give \"key\", \"id\" and \"partition\" on each line".into(),
        ));
    }
    let bytes = read(path)?;
    let mut lines = Vec::new();
    for (n, text) in bytes.lines().enumerate() {
        let text = text.map_err(|e| ControlError::Refused(format!("line {}: {e}", n + 1)))?;
        if text.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(&text).map_err(|e| {
            ControlError::Refused(format!(
                "line {}: {e}; each line is an object with \"key\" and one of \"data\", \"hex\" or \"value\"",
                n + 1
            ))
        })?;
        lines.push(line);
    }
    Ok(lines)
}

/// The message for one record.
fn message(
    subjects: &Subjects,
    stream: &StreamName,
    layout: &Layout,
    known: Option<&StreamType>,
    codec: &Codec,
    args: &PublishArgs,
    line: Line,
) -> Result<OutboundMessage, String> {
    if let Some(problem) = headers::entry_problem(headers::KEY, &line.key) {
        return Err(format!("key {:?} cannot travel in the {} header: {problem}", line.key, headers::KEY));
    }
    let payload = match (line.data, line.hex, line.value) {
        (Some(text), None, None) => bytes::Bytes::from(text.into_bytes()),
        (None, Some(h), None) => {
            bytes::Bytes::from(unhex(&h.trim().to_ascii_lowercase()).ok_or_else(|| format!("{h:?} is not hex"))?)
        }
        (None, None, Some(value)) => match known {
            Some(t) => t.from_json(codec, value).map_err(|e| format!("the value is not a {}: {e}", t.type_name))?,
            None => {
                return Err(format!(
                    "this binary does not know the type of stream {stream}, so it cannot encode a JSON value: use the job's binary, or send bytes with --data, --file or \"data\"/\"hex\""
                ));
            }
        },
        _ => return Err("give exactly one of data, hex or value".into()),
    };
    let subject = match layout {
        Layout::Queue => {
            if line.partition.is_some() {
                return Err(format!("stream {stream} is a queue: it has no partitions"));
            }
            subjects.queue(stream)
        }
        Layout::Ordered(n) => {
            let p = line.partition.unwrap_or_else(|| partition_for(&line.key, *n));
            if p >= *n {
                return Err(format!(
                    "stream {stream} has {n} partition(s), 0 to {}: partition {p} does not exist",
                    n.saturating_sub(1)
                ));
            }
            subjects.ordered_partition(stream, p)
        }
    };
    let id = line.id.unwrap_or_else(|| MessageId::new_v7().as_str().to_owned());
    let type_name = args.type_name.clone().or_else(|| known.map(|t| t.type_name.to_owned()));
    let mut msg = OutboundMessage::new(subject, payload)
        .with_id(id)
        .with_header(headers::KEY, line.key)
        .with_header(headers::SENT, unix_millis(SystemTime::now()).to_string());
    if let Some(t) = type_name {
        msg = msg.with_header(headers::TYPE, t);
    }
    let extra = args.headers.iter().map(|h| {
        h.split_once('=')
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .ok_or_else(|| format!("--header {h:?} is not NAME=VALUE"))
    });
    for header in extra.chain(line.headers.into_iter().map(Ok)) {
        let (name, value) = header?;
        if name.starts_with("Flotilla-") || name.starts_with("Nats-") {
            return Err(format!("header {name} is Flotilla's or the server's: use --id, --type or --key instead"));
        }
        if let Some(problem) = headers::entry_problem(&name, &value) {
            return Err(format!("header {name}: {problem}"));
        }
        msg = msg.with_header(name, value);
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> PublishArgs {
        PublishArgs {
            stream: "orders".into(),
            key: "k".into(),
            data: None,
            file: None,
            json: None,
            jsonl: None,
            partition: None,
            id: None,
            type_name: None,
            headers: Vec::new(),
        }
    }

    fn subjects() -> (Subjects, StreamName) {
        (Subjects::new(JobName::new("shop").expect("job")), StreamName::new("orders").expect("stream"))
    }

    #[test]
    fn a_record_goes_to_its_key_s_partition_and_a_missing_partition_is_refused() {
        let (s, orders) = subjects();
        let line = Line { key: "customer-7".into(), data: Some("x".into()), ..Line::default() };
        let msg = message(&s, &orders, &Layout::Ordered(8), None, &Codec::default(), &args(), line.clone())
            .expect("a record");
        assert_eq!(msg.subject, format!("flotilla.shop.orders.{}", partition_for("customer-7", 8)));
        assert_eq!(msg.headers.get(headers::KEY), Some("customer-7"));
        assert!(msg.headers.msg_id().is_some());
        let far = Line { partition: Some(99), ..line.clone() };
        let err = message(&s, &orders, &Layout::Ordered(8), None, &Codec::default(), &args(), far).expect_err("p99");
        assert!(err.contains("8 partition(s), 0 to 7") && err.contains("99"), "{err}");
        let queued = Line { partition: Some(1), ..line };
        assert!(message(&s, &orders, &Layout::Queue, None, &Codec::default(), &args(), queued).is_err());
    }

    #[test]
    fn values_need_a_known_type_and_reserved_headers_are_refused() {
        let (s, orders) = subjects();
        let value = Line { value: Some(serde_json::json!({"id": 1})), ..Line::default() };
        let err = message(&s, &orders, &Layout::Queue, None, &Codec::default(), &args(), value).expect_err("untyped");
        assert!(err.contains("use the job's binary"), "{err}");
        let typed = StreamType::of(&flotilla_actors::StreamDef::<(u32, String)>::queue("orders"));
        let value = Line { value: Some(serde_json::json!([7, "seven"])), ..Line::default() };
        let msg = message(&s, &orders, &Layout::Queue, Some(&typed), &Codec::default(), &args(), value).expect("typed");
        let back: (u32, String) = Codec::default().decode(&msg.payload).expect("decodes");
        assert_eq!(back, (7, "seven".to_owned()));
        let wrong = Line { value: Some(serde_json::json!({"nope": true})), ..Line::default() };
        assert!(message(&s, &orders, &Layout::Queue, Some(&typed), &Codec::default(), &args(), wrong).is_err());
        let mut a = args();
        a.headers = vec!["Nats-Msg-Id=x".into()];
        let line = Line { data: Some("x".into()), ..Line::default() };
        assert!(message(&s, &orders, &Layout::Queue, None, &Codec::default(), &a, line).is_err());
    }
}
