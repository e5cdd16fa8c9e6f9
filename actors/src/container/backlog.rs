//! The backlog check: each slot's waiting messages and oldest age, `degraded` and
//! `recovered` events.

use super::*;

impl Container {
    pub(super) fn check_backlog(&mut self, ctx: &mut Context<Self>) {
        if self.backlog_check_running {
            return;
        }
        self.backlog_check_running = true;
        let broker = self.broker.clone();
        self.utilization.sample();
        let targets: Vec<(usize, String, Option<u32>, BacklogSource)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.live())
            .map(|(i, s)| {
                let spec = &s.spec;
                // An ordered partition's messages share its stream with the others'.
                let subject = spec.partition.and_then(|p| {
                    let name = flotilla_transport::wire::StreamName::new(spec.stream.clone()).ok()?;
                    Some(self.subjects.ordered_partition(&name, p))
                });
                let source =
                    BacklogSource { js: spec.js_stream.to_string(), consumer: spec.consumer.to_string(), subject };
                (*i, spec.stream.clone(), spec.partition, source)
            })
            .collect();
        let dlq = self.subjects.dlq_stream_name();
        let fut = async move {
            // The dead letters, as part of the backlog an operator watches.
            if let Ok(state) = broker.stream_state(&dlq).await {
                crate::metrics::dlq_reading(&state, std::time::SystemTime::now());
            }
            let mut readings = Vec::new();
            for (i, stream, partition, BacklogSource { js, consumer, subject }) in targets {
                if let Ok(c) = broker.consumer_state(&js, &consumer).await {
                    let waiting = c.num_pending + c.num_ack_pending;
                    let age = if waiting == 0 {
                        Duration::ZERO
                    } else {
                        oldest_unacked(&broker, &js, c.ack_floor + 1, subject.as_deref()).await
                    };
                    readings.push((i, stream, partition, waiting, age));
                }
            }
            readings
        };
        ctx.spawn(fut.into_actor(self).map(|readings, act, _| {
            act.backlog_check_running = false;
            // Only slots still running here report (one that ended meanwhile was zeroed).
            for (i, _, _, waiting, age) in &readings {
                if let Some(s) = act.slots.get(i).filter(|s| s.live()) {
                    s.metrics.backlog.set(*waiting as f64);
                    s.metrics.oldest_age.set(age.as_secs_f64());
                }
            }
            let readings: Vec<(String, Option<u32>, u64, Duration)> = readings
                .into_iter()
                .map(|(_, stream, partition, waiting, age)| (stream, partition, waiting, age))
                .collect();
            let total: u64 = readings.iter().map(|r| r.2).sum();
            if total > act.config.backlog_threshold {
                act.strikes += 1;
                if act.strikes >= act.config.backlog_strikes && !act.degraded {
                    act.degraded = true;
                    if let Some((stream, partition, backlog, age)) = readings.into_iter().max_by_key(|r| r.2) {
                        emit(
                            &act.broker,
                            &act.subjects,
                            Event::Degraded {
                                stream,
                                partition,
                                backlog,
                                oldest_age_ms: age.as_millis() as u64,
                                total_backlog: total,
                            },
                        );
                    }
                }
            } else {
                act.strikes = 0;
                if act.degraded {
                    act.degraded = false;
                    emit(&act.broker, &act.subjects, Event::Recovered { total_backlog: total });
                }
            }
        }));
    }
}

/// Where the backlog check reads a slot's backlog: its JetStream stream and consumer,
/// and (ordered partitions) the partition's subject.
struct BacklogSource {
    js: String,
    consumer: String,
    subject: Option<String>,
}

/// How many messages of other partitions the backlog check reads past, looking for a
/// partition's oldest unacknowledged one.
const AGE_SCAN: u64 = 16;

/// The age of the oldest unacknowledged message from `first` on: the first message on
/// `subject` (an ordered partition's; any, for a queue input) within [`AGE_SCAN`]
/// sequences. Past that, the first message read stands in (older than the partition's
/// own, so the age is an upper bound).
async fn oldest_unacked(broker: &SharedBroker, js: &str, first: u64, subject: Option<&str>) -> Duration {
    let mut stand_in = None;
    for seq in first..first.saturating_add(AGE_SCAN) {
        match broker.get_message(js, seq).await {
            Ok(Some(m)) => {
                if subject.is_none_or(|s| m.subject == s) {
                    stand_in = Some(m.published);
                    break;
                }
                stand_in.get_or_insert(m.published);
            }
            Ok(None) => continue,
            Err(_) => break,
        }
    }
    stand_in.map_or(Duration::ZERO, |t| std::time::SystemTime::now().duration_since(t).unwrap_or_default())
}
