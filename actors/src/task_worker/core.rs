//! The partition rules a [`TaskWorker`](super::TaskWorker) follows, as plain data:
//! events in, verdicts out, tested without actors or a broker.
//!
//! The first rule here is the one an ack-all depends on. An ordered partition commits
//! by acknowledging its last completed delivery, and the broker takes that as an
//! acknowledgement of every earlier message of the partition. That is only true if
//! this worker saw every delivery the consumer made: a delivery lost in transit (a
//! connection cut mid-pull, a pull answered after its client gave up, a stale puller)
//! would be acknowledged unprocessed. The consumer numbers its deliveries
//! (redeliveries included) one after another, so a worker that knows the number
//! before its first delivery can tell, per delivery, that nothing went missing.

/// Ordered inputs: the consumer's delivery numbering as this worker has seen it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeliverySequence {
    /// The consumer sequence of the last delivery seen, if known.
    last: Option<u64>,
}

/// How a delivery fits the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// It follows the previous delivery: nothing was missed.
    Next,
    /// Deliveries between the previous one and this one never arrived (or this one is
    /// from an earlier incarnation of the consumer). Acknowledging anything from here
    /// on could cover a message nobody processed.
    Gap {
        /// The consumer sequence that should have come.
        expected: u64,
        /// The one that came.
        got: u64,
    },
}

impl DeliverySequence {
    /// A sequence whose last delivery was `last` (`Some(0)` for a consumer that has
    /// delivered nothing yet, as after a reset). `None` when the caller does not know:
    /// the first delivery then sets it.
    pub(crate) fn after(last: Option<u64>) -> Self {
        Self { last }
    }

    /// A delivery with consumer sequence `consumer_seq` arrived. After a gap the
    /// sequence stays where it was: every later delivery is a gap too.
    pub(crate) fn arrive(&mut self, consumer_seq: u64) -> Arrival {
        match self.last {
            Some(last) if consumer_seq != last.saturating_add(1) => {
                Arrival::Gap { expected: last.saturating_add(1), got: consumer_seq }
            }
            _ => {
                self.last = Some(consumer_seq);
                Arrival::Next
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliveries_that_follow_each_other_are_in_sequence() {
        let mut seq = DeliverySequence::after(Some(0));
        assert_eq!((1..=5).map(|n| seq.arrive(n)).collect::<Vec<_>>(), vec![Arrival::Next; 5]);
        // Taking over a consumer that delivered 41 times: the next must be 42.
        let mut seq = DeliverySequence::after(Some(41));
        assert_eq!(seq.arrive(42), Arrival::Next);
    }

    #[test]
    fn a_missing_delivery_is_a_gap_and_the_sequence_stays_broken() {
        let mut seq = DeliverySequence::after(Some(10));
        assert_eq!(seq.arrive(11), Arrival::Next);
        assert_eq!(seq.arrive(14), Arrival::Gap { expected: 12, got: 14 });
        // The lost ones arriving late (redelivered) do not mend it: 15 is not 12.
        assert_eq!(seq.arrive(15), Arrival::Gap { expected: 12, got: 15 });
    }

    #[test]
    fn a_delivery_from_an_earlier_consumer_is_a_gap() {
        // Reset to a new consumer (0), then a stale pull of the old one answers with 77.
        let mut seq = DeliverySequence::after(Some(0));
        assert_eq!(seq.arrive(77), Arrival::Gap { expected: 1, got: 77 });
        // A repeated number (the same delivery twice) is not "next" either.
        let mut seq = DeliverySequence::after(Some(5));
        assert_eq!(seq.arrive(5), Arrival::Gap { expected: 6, got: 5 });
    }

    #[test]
    fn an_unknown_start_is_set_by_the_first_delivery() {
        let mut seq = DeliverySequence::after(None);
        assert_eq!(seq.arrive(300), Arrival::Next);
        assert_eq!(seq.arrive(301), Arrival::Next);
        assert_eq!(seq.arrive(303), Arrival::Gap { expected: 302, got: 303 });
    }
}
