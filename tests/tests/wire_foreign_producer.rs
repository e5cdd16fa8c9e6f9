//! A producer that is not Flotilla: it follows `docs/wire-format.md` alone, writes the
//! NATS protocol bytes by hand over a TCP socket (no NATS client, no Flotilla codec),
//! and Flotilla must claim and decode what it published.

use flotilla_tests::{NatsServer, Record};
use flotilla_transport::topology;
use flotilla_transport::wire::{Codec, JobName, StreamName, Subjects, headers};
use flotilla_transport::{JetStreamBroker, JetStreamOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// FNV-1a 64 written from the document, not Flotilla's implementation.
fn doc_fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in data {
        h = (h ^ u64::from(*b)).wrapping_mul(0x100000001b3);
    }
    h
}

/// Unsigned varint from §5.1 of the document.
fn doc_varint(n: u64) -> Vec<u8> {
    if n < 251 {
        vec![n as u8]
    } else if n < 1 << 16 {
        [&[0xfb][..], &(n as u16).to_le_bytes()].concat()
    } else if n < 1 << 32 {
        [&[0xfc][..], &(n as u32).to_le_bytes()].concat()
    } else {
        [&[0xfd][..], &n.to_le_bytes()].concat()
    }
}

/// A JetStream publish over a raw socket: CONNECT, SUB to a reply inbox, HPUB, then read
/// the publish ack. Returns the ack's JSON.
fn raw_publish(port: u16, subject: &str, header_lines: &[(&str, &str)], payload: &[u8]) -> serde_json::Value {
    let mut sock = TcpStream::connect(("127.0.0.1", port)).expect("tcp connect");
    sock.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut reader = BufReader::new(sock.try_clone().expect("clone"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("INFO");
    assert!(line.starts_with("INFO "), "{line}");
    let mut hdr = b"NATS/1.0\r\n".to_vec();
    for (k, v) in header_lines {
        hdr.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    hdr.extend_from_slice(b"\r\n");
    let total = hdr.len() + payload.len();
    let mut frame = Vec::new();
    frame.extend_from_slice(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n");
    frame.extend_from_slice(b"SUB _INBOX.abc 1\r\n");
    frame.extend_from_slice(format!("HPUB {subject} _INBOX.abc {} {total}\r\n", hdr.len()).as_bytes());
    frame.extend_from_slice(&hdr);
    frame.extend_from_slice(payload);
    frame.extend_from_slice(b"\r\nPING\r\n");
    sock.write_all(&frame).expect("write");
    loop {
        line.clear();
        reader.read_line(&mut line).expect("read reply");
        if let Some(rest) = line.strip_prefix("MSG _INBOX.abc 1 ") {
            let n: usize = rest.trim().parse().expect("length");
            let mut body = vec![0; n + 2];
            reader.read_exact(&mut body).expect("body");
            return serde_json::from_slice(&body[..n]).expect("ack json");
        }
        assert!(!line.starts_with("-ERR"), "server refused: {line}");
    }
}

#[tokio::test]
async fn a_foreign_producer_following_the_document_is_decoded() {
    let server = NatsServer::start();
    let broker = JetStreamBroker::connect(JetStreamOptions::new(server.url())).await.expect("connect").shared();
    let subjects = Subjects::new(JobName::new("relay").expect("job"));
    let input = StreamName::new("relay-in").expect("stream");
    topology::provision_ordered(&broker, &subjects, &input, 8, Duration::from_secs(30), 64, 1)
        .await
        .expect("provision");

    // The document's worked example, byte for byte.
    let key = "42";
    let partition = doc_fnv1a64(key.as_bytes()) % 8;
    assert_eq!(partition, 3);
    let subject = format!("flotilla.relay.relay-in.{partition}");
    let headers =
        [("Nats-Msg-Id", "0190b6a4-7d2c-7c3e-9a51-3f0e8b1c2d4e"), ("Flotilla-Key", "42"), ("Flotilla-Type", "Record")];
    let payload = [0x2a, 0x02, b'h', b'i'];
    let hdr_len = b"NATS/1.0\r\n".len() + headers.iter().map(|(k, v)| k.len() + 2 + v.len() + 2).sum::<usize>() + 2;
    assert_eq!((hdr_len, hdr_len + payload.len()), (104, 108), "the lengths the document states");
    let ack = raw_publish(server.port(), &subject, &headers, &payload);
    assert_eq!(ack["stream"], "FLOTILLA_relay_relay-in");
    assert_eq!(ack["seq"], 1);
    let again = raw_publish(server.port(), &subject, &headers, &payload);
    assert_eq!(again["duplicate"], true, "same Nats-Msg-Id is deduplicated: {again}");

    // A second record with multi-byte varints and UTF-8, only the required header.
    let key2 = "300";
    let p2 = doc_fnv1a64(key2.as_bytes()) % 8;
    let body = "héllo".as_bytes();
    let payload2 = [doc_varint(300), doc_varint(body.len() as u64), body.to_vec()].concat();
    raw_publish(server.port(), &format!("flotilla.relay.relay-in.{p2}"), &[("Nats-Msg-Id", "order-300")], &payload2);

    let codec = Codec::default();
    let got = broker.claim("FLOTILLA_relay_relay-in", "relay-in-p3", 10, Duration::from_secs(5)).await.expect("claim");
    assert_eq!(got.len(), 1);
    let d = &got[0];
    assert_eq!(d.headers.get(headers::KEY), Some("42"));
    let rec: Record = codec.decode_message(&d.headers, "Record", &d.payload).expect("decode");
    assert_eq!(rec, Record { id: 42, body: "hi".into() });

    let consumer2 = format!("relay-in-p{p2}");
    let got = broker.claim("FLOTILLA_relay_relay-in", &consumer2, 10, Duration::from_secs(5)).await.expect("claim");
    let rec: Record = codec.decode_message(&got[0].headers, "Record", &got[0].payload).expect("decode");
    assert_eq!(rec, Record { id: 300, body: "héllo".into() });

    // What the document says is refused, is refused with the documented reason.
    let bad = codec.decode_message::<Record>(&d.headers, "Order", &d.payload).expect_err("type header mismatch");
    assert_eq!(bad.reason(), "type-mismatch");
    let bad = codec.decode::<Record>(&[0x2a, 0x02, b'h', b'i', 0x00]).expect_err("trailing byte");
    assert_eq!(bad.reason(), "malformed");
}
