//! Properties of the wire format: what arrives from outside the process (payload
//! bytes, header names and values, subjects, names) never panics the reader, is
//! refused with an error when it is not a valid encoding, never makes the decoder
//! allocate what a length prefix claims past the limit, and round-trips when valid.

use super::codec::{Codec, HARD_MAX_PAYLOAD};
use super::headers::{self, Headers, MessageKind};
use super::names::{JobName, MAX_NAME_LEN, StreamName, validate_name};
use super::partition::{fnv1a64, partition_for};
use super::subjects::Subjects;
use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Body {
    Empty,
    Text(String),
    Numbers(Vec<i64>),
    Nested { tags: BTreeMap<String, Vec<u8>>, maybe: Option<Box<Body>> },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Envelope {
    id: u64,
    key: String,
    ratio: f32,
    body: Body,
}

fn body() -> impl Strategy<Value = Body> {
    let leaf = prop_oneof![
        Just(Body::Empty),
        ".{0,40}".prop_map(Body::Text),
        proptest::collection::vec(any::<i64>(), 0..20).prop_map(Body::Numbers),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        (
            proptest::collection::btree_map(".{0,8}", proptest::collection::vec(any::<u8>(), 0..16), 0..4),
            proptest::option::of(inner.prop_map(Box::new)),
        )
            .prop_map(|(tags, maybe)| Body::Nested { tags, maybe })
    })
}

fn envelope() -> impl Strategy<Value = Envelope> {
    // NaN != NaN: finite ratios, so equality checks the round trip.
    (any::<u64>(), ".{0,24}", -1e6f32..1e6, body()).prop_map(|(id, key, ratio, body)| Envelope { id, key, ratio, body })
}

/// bincode's varint for a length of `n` (standard configuration).
fn varint(n: u64) -> Vec<u8> {
    match n {
        0..=250 => vec![n as u8],
        251..=0xffff => [&[251u8][..], &(n as u16).to_le_bytes()].concat(),
        0x1_0000..=0xffff_ffff => [&[252u8][..], &(n as u32).to_le_bytes()].concat(),
        _ => [&[253u8][..], &n.to_le_bytes()].concat(),
    }
}

/// Header names to probe with: the same names in other cases, and others.
fn header_name() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        headers::KEY,
        "flotilla-key",
        "FLOTILLA-KEY",
        headers::MSG_ID,
        "nats-msg-id",
        headers::TRACEPARENT,
        "Traceparent",
        "X-Custom",
    ])
}

#[derive(Debug, Clone)]
enum HeaderOp {
    Insert(&'static str, String),
    Append(&'static str, String),
    Remove(&'static str),
}

fn header_op() -> impl Strategy<Value = HeaderOp> {
    prop_oneof![
        (header_name(), "[a-z]{0,3}").prop_map(|(n, v)| HeaderOp::Insert(n, v)),
        (header_name(), "[a-z]{0,3}").prop_map(|(n, v)| HeaderOp::Append(n, v)),
        header_name().prop_map(HeaderOp::Remove),
    ]
}

fn follows_name_rule(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encoded_values_round_trip(value in envelope()) {
        let c = Codec::with_max_payload(HARD_MAX_PAYLOAD);
        let bytes = c.encode(&value).expect("encode");
        prop_assert_eq!(c.decode::<Envelope>(&bytes).expect("decode"), value);
    }

    #[test]
    fn the_payload_limit_holds_both_ways(value in envelope(), limit in 0usize..256) {
        let exact = Codec::with_max_payload(HARD_MAX_PAYLOAD).encode(&value).expect("encode");
        let c = Codec::with_max_payload(limit);
        let too_large = exact.len() > limit;
        prop_assert_eq!(c.encode(&value).is_err(), too_large, "encode of {} bytes under a limit of {}", exact.len(), limit);
        match c.decode::<Envelope>(&exact) {
            Ok(v) => prop_assert!(!too_large && v == value),
            Err(e) => prop_assert!(too_large && e.reason() == "too-large", "{}", e),
        }
    }

    #[test]
    fn a_truncated_or_extended_payload_is_an_error(value in envelope(), cut in any::<prop::sample::Index>(), extra in proptest::collection::vec(any::<u8>(), 1..8)) {
        let c = Codec::default();
        let bytes = c.encode(&value).expect("encode");
        // bincode is self-delimiting for a given type: no strict prefix decodes.
        let short = &bytes[..cut.index(bytes.len().max(1)).min(bytes.len().saturating_sub(1))];
        if short.len() < bytes.len() {
            let err = c.decode::<Envelope>(short).expect_err("a strict prefix decoded");
            prop_assert_eq!(err.reason(), "malformed");
        }
        let long = [&bytes[..], &extra[..]].concat();
        let err = c.decode::<Envelope>(&long).expect_err("trailing bytes accepted");
        prop_assert_eq!(err.reason(), "malformed");
    }

    #[test]
    fn a_length_claim_past_the_hard_limit_is_refused_not_allocated(
        claim in (HARD_MAX_PAYLOAD as u64 + 1)..=u64::MAX,
        rest in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let c = Codec::default();
        let bytes = [varint(claim), rest].concat();
        // Text takes its length as a claim against the limit before allocating: the
        // limit refuses it (an allocation of `claim` bytes would abort the test).
        let err = c.decode::<String>(&bytes).expect_err("a huge string decoded");
        prop_assert!(err.reason() == "malformed" && err.to_string().contains("LimitExceeded"), "{}", err);
        // Sequences and maps preallocate cautiously and fail on the missing elements.
        prop_assert_eq!(c.decode::<Vec<u8>>(&bytes).expect_err("bytes").reason(), "malformed");
        prop_assert_eq!(c.decode::<Vec<u64>>(&bytes).expect_err("numbers").reason(), "malformed");
        prop_assert_eq!(c.decode::<Vec<String>>(&bytes).expect_err("strings").reason(), "malformed");
        prop_assert_eq!(c.decode::<BTreeMap<String, u64>>(&bytes).expect_err("map").reason(), "malformed");
        prop_assert_eq!(c.decode::<Envelope>(&[&[7u8][..], &bytes[..]].concat()).expect_err("record").reason(), "malformed");
    }

    #[test]
    fn a_length_claim_past_the_bytes_present_is_an_error(claim in 17u64..(1 << 20), rest in proptest::collection::vec(any::<u8>(), 0..16)) {
        let c = Codec::default();
        let bytes = [varint(claim), rest].concat();
        prop_assert_eq!(c.decode::<String>(&bytes).expect_err("string").reason(), "malformed");
        prop_assert_eq!(c.decode::<Vec<u8>>(&bytes).expect_err("bytes").reason(), "malformed");
    }

    #[test]
    fn decoding_arbitrary_bytes_as_a_nested_type_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let c = Codec::default();
        // An error is malformed; a value re-encodes canonically (varints accept longer
        // forms than they write), no longer than what it came from, and stays put.
        match c.decode::<Envelope>(&bytes) {
            Ok(v) => {
                let canonical = c.encode(&v).expect("encode");
                prop_assert!(canonical.len() <= bytes.len());
                let again = c.decode::<Envelope>(&canonical).expect("decode the canonical form");
                prop_assert_eq!(c.encode(&again).expect("encode"), canonical);
            }
            Err(e) => prop_assert_eq!(e.reason(), "malformed"),
        }
    }

    #[test]
    fn header_lookups_find_the_first_entry_whatever_its_case(ops in proptest::collection::vec(header_op(), 0..24)) {
        let mut h = Headers::new();
        let mut model: Vec<(&str, String)> = Vec::new();
        for op in ops {
            let shared = h.clone();
            let was: Vec<(String, String)> = h.iter().map(|(n, v)| (n.to_owned(), v.to_owned())).collect();
            match op {
                HeaderOp::Insert(n, v) => {
                    h.insert(n, v.clone());
                    model.retain(|(m, _)| !m.eq_ignore_ascii_case(n));
                    model.push((n, v));
                }
                HeaderOp::Append(n, v) => {
                    h.append(n, v.clone());
                    model.push((n, v));
                }
                HeaderOp::Remove(n) => {
                    h.remove(n);
                    model.retain(|(m, _)| !m.eq_ignore_ascii_case(n));
                }
            }
            prop_assert_eq!(h.iter().collect::<Vec<_>>(), model.iter().map(|(n, v)| (*n, v.as_str())).collect::<Vec<_>>());
            let kept: Vec<(String, String)> = shared.iter().map(|(n, v)| (n.to_owned(), v.to_owned())).collect();
            prop_assert_eq!(kept, was, "a change to a map shows in a clone taken before");
            for probe in ["flotilla-key", headers::KEY, "NATS-MSG-ID", headers::MSG_ID, "traceparent", "x-custom", "absent"] {
                let first = model.iter().find(|(n, _)| n.eq_ignore_ascii_case(probe)).map(|(_, v)| v.as_str());
                prop_assert_eq!(h.get(probe), first, "get({})", probe);
            }
        }
    }

    #[test]
    fn header_entries_are_refused_exactly_when_nats_cannot_carry_them(name in "\\PC{0,6}|[!-~]{0,6}", value in "\\PC{0,6}|[ -~\r\n]{0,6}") {
        let name_ok = !name.is_empty() && name.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b':');
        let value_ok = !value.bytes().any(|b| b == b'\r' || b == b'\n');
        prop_assert_eq!(headers::name_problem(&name).is_none(), name_ok, "name {:?}", name);
        prop_assert_eq!(headers::value_problem(&value).is_none(), value_ok, "value {:?}", value);
        prop_assert_eq!(headers::entry_problem(&name, &value).is_none(), name_ok && value_ok);
        let h = Headers::new().with(name.clone(), value.clone());
        prop_assert_eq!(h.invalid_entry().is_none(), name_ok && value_ok);
    }

    #[test]
    fn message_kinds_parse_only_their_own_names(value in "\\PC{0,14}|data|drain|end-of-stream|Data") {
        let parsed = MessageKind::parse(&value);
        prop_assert_eq!(parsed.map(MessageKind::as_str), ["data", "drain", "end-of-stream"].into_iter().find(|k| *k == value));
        prop_assert_eq!(Headers::new().with(headers::KIND, value.clone()).kind(), parsed);
        prop_assert_eq!(headers::known(&value).is_some(), headers::KNOWN.contains(&value.as_str()));
    }

    #[test]
    fn names_are_accepted_exactly_when_they_follow_the_rule(name in "\\PC{0,8}|[a-z0-9_-]{0,70}") {
        let ok = follows_name_rule(&name);
        prop_assert_eq!(validate_name("stream", &name).is_ok(), ok, "{:?}", name);
        prop_assert_eq!(JobName::new(name.clone()).is_ok(), ok);
        prop_assert_eq!(StreamName::new(name.clone()).map(|s| s.as_str().to_owned()).ok(), ok.then_some(name));
    }

    #[test]
    fn a_timer_may_target_the_job_s_data_subjects_and_nothing_else(
        job in "[a-z][a-z0-9-]{0,10}",
        stream in "[a-z0-9][a-z0-9-]{0,10}",
        partition in any::<u32>(),
        other in "\\PC{0,30}|flotilla\\.[a-z._>*-]{0,20}",
    ) {
        let s = Subjects::new(JobName::new(job.clone()).expect("job"));
        let input = StreamName::new(stream).expect("stream");
        prop_assert_eq!(s.data_target_problem(&s.ordered_partition(&input, partition)), None);
        prop_assert_eq!(s.data_target_problem(&s.queue(&input)), None);
        for reserved in [s.dlq(&input), s.timer(input.as_str()), s.control("drain"), s.event("degraded"), s.ordered_all(&input)] {
            prop_assert!(s.data_target_problem(&reserved).is_some(), "{} accepted", reserved);
        }
        // Anything else: never a panic, and accepted only in one of the two forms.
        if s.data_target_problem(&other).is_none() {
            let rest = other.strip_prefix(&format!("flotilla.{job}.")).expect("the job's prefix");
            let (name, part) = rest.split_once('.').map_or((rest, None), |(n, p)| (n, Some(p)));
            prop_assert!(follows_name_rule(name) && !name.starts_with('_'), "{:?}", other);
            prop_assert!(part.is_none_or(|p| p.parse::<u32>().is_ok() && p.bytes().all(|b| b.is_ascii_digit())), "{:?}", other);
        }
    }

    #[test]
    fn a_key_lands_below_the_count_and_agrees_with_coarser_counts(key in "\\PC{0,24}", n in 1u32..1024, m in 1u32..64) {
        let p = partition_for(&key, n);
        prop_assert!(p < n);
        prop_assert_eq!(u64::from(p), fnv1a64(key.as_bytes()) % u64::from(n));
        // One hash, any count: a key's partition among n is its partition among n·m, mod n.
        prop_assert_eq!(partition_for(&key, n * m) % n, p);
        prop_assert_eq!(partition_for(&key, 0), 0);
    }
}
