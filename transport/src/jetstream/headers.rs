//! Headers between Flotilla's [`Headers`] and async-nats' header maps.

use crate::broker::{BrokerError, BrokerResult};
use crate::wire::{HeaderText, Headers};
use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;

/// async-nats's form of Flotilla's own header names, in the order of `headers::KNOWN`,
/// built at compile time: an output's names are neither looked up nor checked again.
static NATS_NAMES: [async_nats::HeaderName; 25] = {
    use crate::wire::headers::*;
    use async_nats::HeaderName;
    [
        HeaderName::from_static(MSG_ID),
        HeaderName::from_static(KEY),
        HeaderName::from_static(KIND),
        HeaderName::from_static(RUN),
        HeaderName::from_static(TYPE),
        HeaderName::from_static(SENT),
        HeaderName::from_static(CAUSE),
        HeaderName::from_static(EPOCH),
        HeaderName::from_static(TRACEPARENT),
        HeaderName::from_static(WIRE),
        HeaderName::from_static(DELAY),
        HeaderName::from_static(TARGET),
        HeaderName::from_static(DLQ_REASON),
        HeaderName::from_static(DLQ_DETAIL),
        HeaderName::from_static(DLQ_STREAM),
        HeaderName::from_static(DLQ_SUBJECT),
        HeaderName::from_static(DLQ_SEQ),
        HeaderName::from_static(DLQ_DELIVERIES),
        HeaderName::from_static(DLQ_ATTEMPTS),
        HeaderName::from_static(TIMER),
        HeaderName::from_static(MISFIRE),
        HeaderName::from_static(STEP),
        HeaderName::from_static(PARKED_SEQ),
        HeaderName::from_static(ORIGIN_ID),
        HeaderName::from_static(ARMING),
    ]
};

/// The headers as async-nats carries them. Refuses (instead of letting async-nats
/// panic on) a name or value NATS cannot carry. This runs for every header of every
/// output: Flotilla's own names are taken ready-made, and each value is checked once,
/// by async-nats as it copies it.
pub(super) fn to_header_map(headers: &Headers) -> BrokerResult<async_nats::HeaderMap> {
    use crate::wire::headers::{known_index, name_problem, value_problem};
    let entries = headers.entries();
    let mut map = async_nats::HeaderMap::new();
    for (i, (name, value)) in entries.iter().enumerate() {
        let invalid = |reason| BrokerError::InvalidHeader { name: name.to_string(), reason };
        let header = match known_index(name) {
            Some(k) => NATS_NAMES[k].clone(),
            None => {
                if let Some(reason) = name_problem(name) {
                    return Err(invalid(reason));
                }
                async_nats::HeaderName::from_str(name).map_err(|_| invalid("not a header name"))?
            }
        };
        let value = value.as_str();
        let value = async_nats::HeaderValue::from_str(value)
            .map_err(|_| invalid(value_problem(value).unwrap_or("not a header value")))?;
        // A name seen before gets one more value; a new one is inserted (one hash
        // lookup instead of two).
        if entries[..i].iter().any(|(earlier, _)| earlier == name) {
            map.append(header, value);
        } else {
            map.insert(header, value);
        }
    }
    Ok(map)
}

pub(super) fn from_header_map(map: Option<&async_nats::HeaderMap>) -> Headers {
    let Some(map) = map else { return Headers::new() };
    let mut entries = Vec::with_capacity(map.len());
    for (name, values) in map.iter() {
        let name: &str = name.as_ref();
        // Flotilla's own names (most of what arrives) are not copied.
        let name = match crate::wire::headers::known(name) {
            Some(known) => Cow::Borrowed(known),
            None => Cow::Owned(name.to_owned()),
        };
        // Shared text: the task's message id shares it instead of copying it.
        entries.extend(values.iter().map(|v| (name.clone(), HeaderText::Shared(Arc::from(v.as_str())))));
    }
    Headers::from(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_maps_carry_every_entry_and_refuse_what_nats_cannot() {
        use crate::wire::headers::{self, KNOWN};
        for (i, name) in KNOWN.iter().enumerate() {
            let nats: &str = NATS_NAMES[i].as_ref();
            assert_eq!(nats, *name, "NATS_NAMES follows headers::KNOWN");
        }
        let h = Headers::new()
            .with(headers::MSG_ID, "id-1")
            .with(headers::KEY, "k")
            .with("X-Custom", "c")
            .with(String::from("Flotilla-Cause"), "cause");
        let mut h2 = h.clone();
        h2.append(headers::KEY, "k2");
        let map = to_header_map(&h2).expect("valid");
        assert_eq!(map.get(headers::MSG_ID).map(|v| v.as_str()), Some("id-1"));
        assert_eq!(map.get("X-Custom").map(|v| v.as_str()), Some("c"));
        assert_eq!(map.get(headers::CAUSE).map(|v| v.as_str()), Some("cause"));
        let keys: Vec<&str> = map.get_all(headers::KEY).map(|v| v.as_str()).collect();
        assert_eq!(keys, ["k", "k2"]);
        assert_eq!(from_header_map(Some(&map)).len(), 5);
        let refused = |h: Headers| match to_header_map(&h) {
            Err(BrokerError::InvalidHeader { name, reason }) => (name, reason),
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(refused(h.clone().with(headers::KEY, "a\nb")), (headers::KEY.into(), "the value has a line break"));
        assert_eq!(refused(h.clone().with("X-Other", "a\rb")).1, "the value has a line break");
        assert_eq!(refused(h.clone().with("Bad:Name", "v")).0, "Bad:Name");
        assert_eq!(refused(h.with("", "v")).1, "the name is empty");
    }
}
