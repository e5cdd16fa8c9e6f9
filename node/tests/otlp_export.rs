//! Span export over OTLP/HTTP (feature `otlp`): a node exports its spans to a collector
//! (a fake one here, on loopback, that keeps what is posted to `/v1/traces`), and the
//! exported ids are the ones the messages carry: a record's trace id is exported, and
//! its output's `traceparent` names an exported span.
#![cfg(feature = "otlp")]

use flotilla_actors::{Job, Producer, StreamDef, Task, TaskContext, TaskError};
use flotilla_node::NodeArgs;
use flotilla_transport::broker::{AckPolicy, ConsumerSpec};
use flotilla_transport::wire::headers;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const IN: StreamDef<String> = StreamDef::ordered("in", 2);
const OUT: StreamDef<String> = StreamDef::ordered("out", 2);

struct Forward;

impl Task for Forward {
    type Input = String;
    async fn process(&mut self, s: String, ctx: &mut TaskContext) -> Result<(), TaskError> {
        ctx.send(&OUT, &s, &s).await
    }
}

/// What the collector was sent: (request line, body) per request.
type Posts = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A collector that answers 200 to every POST and keeps the bodies.
fn fake_collector() -> (String, Posts) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let posts = Arc::new(Mutex::new(Vec::new()));
    let kept = posts.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            kept.lock().expect("lock").push((request_line.trim().to_owned(), body));
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n");
        }
    });
    (url, posts)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn spans_are_exported_with_the_ids_messages_carry() {
    let (collector, posts) = fake_collector();
    let args = NodeArgs { otlp_endpoint: Some(collector), node_id: Some("otlp-a".into()), ..NodeArgs::default() };
    let job = Job::new("otjob").task(IN, |_| Forward).output(OUT);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let carried = Arc::new(Mutex::new(None::<String>));
    let seen = carried.clone();
    flotilla_node::run(job, args, move |node| async move {
        let producer = Producer::new(node.broker.clone(), "otjob").expect("producer");
        let msg = producer
            .message(&IN, "k", &"hello".to_owned())
            .expect("message")
            .with_header(headers::TRACEPARENT, format!("00-{trace}-00f067aa0ba902b7-01"));
        producer.send_messages(vec![msg], true).await.expect("sent");
        // Read the output's traceparent.
        let spec = ConsumerSpec { ack_policy: AckPolicy::Explicit, ..ConsumerSpec::new("check") };
        node.broker.ensure_consumer("FLOTILLA_otjob_out", spec).await.expect("consumer");
        for _ in 0..100 {
            let got = node.broker.claim("FLOTILLA_otjob_out", "check", 10, Duration::from_millis(200)).await;
            if let Some(d) = got.ok().and_then(|g| g.into_iter().next()) {
                *seen.lock().expect("lock") = d.headers.get(headers::TRACEPARENT).map(str::to_owned);
                break;
            }
        }
        node.stopper.stop();
    })
    .expect("the node ran");
    // The run is over: the exporter was flushed when the node ended.
    let carried = carried.lock().expect("lock").clone().expect("the output carries a traceparent");
    let parts: Vec<&str> = carried.split('-').collect();
    assert_eq!(parts[1], trace, "the output continues the record's trace");
    let posts = posts.lock().expect("lock");
    assert!(!posts.is_empty(), "spans were posted");
    assert!(
        posts.iter().all(|(line, _)| line.starts_with("POST /v1/traces")),
        "{:?}",
        posts.iter().map(|p| &p.0).collect::<Vec<_>>()
    );
    let bodies: Vec<u8> = posts.iter().flat_map(|(_, b)| b.clone()).collect();
    let hex = |s: &str| {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect::<Vec<u8>>()
    };
    assert!(contains(&bodies, &hex(trace)), "the record's trace id is exported");
    assert!(contains(&bodies, &hex(parts[2])), "the span the output names as its parent is exported");
    assert!(contains(&bodies, &hex("00f067aa0ba902b7")), "with the producer's span as its parent");
    assert!(
        contains(&bodies, b"process") && contains(&bodies, b"flotilla-otjob"),
        "the process span, of the job's service"
    );
}
