//! The embedded-broker pairs: a Flotilla no-op job on the in-memory broker against the
//! same broker driven by a plain claim/ack loop (the transport alone), and against raw
//! actix messaging (an actor receiving `do_send`s), all on this one thread.

use crate::report::{Pair, rate};
use crate::workload::{Blob, payload};
use actix::prelude::*;
use anyhow::Context as _;
use bytes::Bytes;
use flotilla::prelude::*;
use flotilla::transport::embedded::EmbeddedBroker;
use flotilla::transport::wire::headers;
use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

const IN: StreamDef<Blob> = StreamDef::queue("in");

struct Noop {
    seen: Rc<Cell<u64>>,
    target: u64,
    done: Rc<Cell<Option<oneshot::Sender<()>>>>,
}

impl Task for Noop {
    type Input = Blob;
    async fn process(&mut self, _blob: Blob, _ctx: &mut TaskContext) -> Result<(), TaskError> {
        let n = self.seen.get() + 1;
        self.seen.set(n);
        if n == self.target
            && let Some(tx) = self.done.take()
        {
            let _ = tx.send(());
        }
        Ok(())
    }
}

async fn fill(broker: &SharedBroker, job: &str, n: u64, body: &Bytes) -> anyhow::Result<()> {
    let subject = format!("flotilla.{job}.in");
    let mut batch = Vec::with_capacity(1024);
    for i in 0..n {
        batch.push(
            OutboundMessage::new(subject.clone(), body.clone())
                .with_id(format!("{job}-{i}"))
                .with_header(headers::KEY, i.to_string()),
        );
        if batch.len() == 1024 || i + 1 == n {
            for ack in broker.publish_batch(std::mem::take(&mut batch)).await {
                ack?;
            }
        }
    }
    Ok(())
}

fn job(name: &str, n: u64, concurrency: usize) -> (Job, oneshot::Receiver<()>) {
    let (tx, rx) = oneshot::channel();
    let seen = Rc::new(Cell::new(0));
    let done = Rc::new(Cell::new(Some(tx)));
    let job = Job::new(name)
        .task(IN, move |_| Noop { seen: seen.clone(), target: n, done: done.clone() })
        .max_concurrency(concurrency);
    (job, rx)
}

async fn flotilla_round(n: u64, concurrency: usize, body: &Bytes) -> anyhow::Result<f64> {
    let broker = EmbeddedBroker::new().shared();
    let (job, done) = job("emb", n, concurrency);
    job.provision(broker.clone()).await?;
    fill(&broker, "emb", n, body).await?;
    let running = job.start(broker.clone()).await?;
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(300), done).await.context("embedded round did not finish")??;
    // Done means acked: the WorkQueue stream is empty once every ack is in.
    while broker.stream_state("FLOTILLA_emb_in").await?.messages > 0 {
        tokio::task::yield_now().await;
    }
    let r = rate(n, started.elapsed());
    running.stop();
    running.wait().await?;
    Ok(r)
}

/// The transport alone: claim up to `concurrency`, decode, ack each.
async fn transport_round(n: u64, concurrency: usize, body: &Bytes) -> anyhow::Result<f64> {
    let broker = EmbeddedBroker::new().shared();
    let (job, _done) = job("emb", n, concurrency);
    job.provision(broker.clone()).await?;
    fill(&broker, "emb", n, body).await?;
    let codec = Codec::default();
    let started = Instant::now();
    let mut got = 0;
    while got < n {
        let batch = broker.claim("FLOTILLA_emb_in", "in-workers", concurrency, Duration::from_secs(1)).await?;
        for d in batch {
            let _blob: Blob = codec.decode(&d.payload)?;
            broker.ack(&d.token, AckKind::Ack).await?;
            got += 1;
        }
    }
    let r = rate(n, started.elapsed());
    Ok(r)
}

struct Sink {
    seen: u64,
}

impl Actor for Sink {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct Item(#[allow(dead_code)] Bytes);

#[derive(Message)]
#[rtype(result = "u64")]
struct Count;

impl Handler<Item> for Sink {
    type Result = ();
    fn handle(&mut self, _: Item, _: &mut Context<Self>) {
        self.seen += 1;
    }
}

impl Handler<Count> for Sink {
    type Result = u64;
    fn handle(&mut self, _: Count, _: &mut Context<Self>) -> u64 {
        self.seen
    }
}

/// Raw actix: `n` messages by `do_send` to one actor on this arbiter, in bursts of the
/// mailbox's size, then a `send` that returns once all were handled.
async fn actix_round(n: u64, body: &Bytes) -> anyhow::Result<f64> {
    let sink = Sink { seen: 0 }.start();
    let started = Instant::now();
    let mut sent = 0;
    while sent < n {
        // `do_send` does not wait for room: let the actor drain between bursts.
        for _ in 0..16.min(n - sent) {
            sink.do_send(Item(body.clone()));
            sent += 1;
        }
        tokio::task::yield_now().await;
    }
    let seen = sink.send(Count).await?;
    anyhow::ensure!(seen == n, "actor saw {seen} of {n}");
    Ok(rate(n, started.elapsed()))
}

pub async fn run(count: u64, size: usize, rounds: usize, concurrency: usize) -> anyhow::Result<Vec<Pair>> {
    let body = payload(size)?;
    let mut transport = Pair::new(
        &format!("embedded broker, no-op queue task ({count})"),
        &format!("the same broker, claim {concurrency} + decode + ack loop"),
        ">= 1,000,000 msgs/s",
    );
    let mut actix =
        Pair::new("embedded no-op task vs raw actix", "do_send to one actor on the same arbiter", "(context)");
    for round in 0..rounds {
        let t = transport_round(count, concurrency, &body).await?;
        // One pass of the runtime's timer and I/O driver between sides, so the actix
        // side does not pay for wake-ups the transport side left pending (measured
        // without it, in every round but the first: 1.2M instead of 12M do_sends a
        // second).
        tokio::time::sleep(Duration::ZERO).await;
        let a = actix_round(count, &body).await?;
        let f = flotilla_round(count, concurrency, &body).await?;
        transport.raw.push(t);
        transport.flotilla.push(f);
        actix.raw.push(a);
        actix.flotilla.push(f);
        crate::jetstream::progress_line(&transport, round);
    }
    Ok(vec![transport, actix])
}
