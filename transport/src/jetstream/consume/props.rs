//! Properties of the delivery reply subjects a JetStream consumer sends: parsed once
//! per delivery, from text the server (or anyone on the connection) chose.

use super::{decimal, parse_ack_subject};
use proptest::prelude::*;

/// A stream or consumer token: non-empty, no '.'.
fn token() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_-][A-Za-z0-9_$-]{0,12}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn ack_subjects_round_trip(
        stream in token(),
        consumer in token(),
        n in any::<[u64; 5]>(),
    ) {
        let subject = format!("$JS.ACK.{stream}.{consumer}.{}.{}.{}.{}.{}", n[0], n[1], n[2], n[3], n[4]);
        let got = parse_ack_subject(&subject).expect("a plain ack subject parses");
        prop_assert_eq!((got.stream, got.consumer), (stream.as_str(), consumer.as_str()));
        prop_assert_eq!([got.delivered, got.stream_seq, got.consumer_seq, got.timestamp_ns, got.pending], n);
    }

    #[test]
    fn arbitrary_reply_subjects_never_panic_and_parse_only_the_plain_form(
        rest in "\\PC{0,40}|([0-9a-z]{0,3}\\.){0,10}[0-9]{0,21}",
    ) {
        let subject = format!("$JS.ACK.{rest}");
        let _ = parse_ack_subject(&rest);
        if let Some(got) = parse_ack_subject(&subject) {
            prop_assert_eq!(rest.matches('.').count(), 6, "{:?} has not seven tokens", subject);
            prop_assert!(!got.stream.is_empty() && !got.consumer.is_empty());
            let numbers: Vec<&str> = rest.split('.').skip(2).collect();
            prop_assert!(numbers.iter().all(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())), "{:?}", subject);
        }
    }

    #[test]
    fn decimal_tokens_agree_with_std_on_digits_and_refuse_the_rest(token in "[0-9]{0,22}|\\PC{0,6}") {
        let digits = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
        prop_assert_eq!(decimal(&token), if digits { token.parse::<u64>().ok() } else { None }, "{:?}", token);
    }
}
