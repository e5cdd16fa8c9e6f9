//! `wordcount`: a two-stage stream job. `lines` (ordered) are split into words, which
//! are repartitioned by word into `words` (ordered); the counting task keeps counts per
//! partition in a durable store (so they survive a move of the partition) and emits the
//! changed ones to `counts` every window. It feeds itself a text, runs until
//! every word is counted, prints the most frequent words and exits.
//!
//! ```text
//! cargo run --example wordcount
//! cargo run --example wordcount -- --nats nats://127.0.0.1:4222
//! ```

use clap::Parser;
use flotilla::prelude::*;
use flotilla::transport::broker::ConsumerSpec;
use flotilla::transport::wire::Codec;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Line {
    doc: u32,
    text: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Word {
    word: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct WordCount {
    word: String,
    count: u64,
}

const PARTITIONS: u32 = 4;
const LINES: StreamDef<Line> = StreamDef::ordered("lines", PARTITIONS);
const WORDS: StreamDef<Word> = StreamDef::ordered("words", PARTITIONS);
const COUNTS: StreamDef<WordCount> = StreamDef::ordered("counts", PARTITIONS);
/// Count per word.
const TOTALS: StoreDef<String, u64> = StoreDef::new("totals");
/// Words counted since the last window.
const CHANGED: StoreDef<String, ()> = StoreDef::new("changed");

const TEXT: &str = "the run loop of a stream processor keeps one task per partition and commits in order \
the work queue claims only what can start and keeps long work alive with heartbeats \
a reaper takes back work that a dead process abandoned and poison goes to the dead letter stream \
the task sees each message once per attempt and the broker keeps the order of each partition";

#[derive(Parser)]
#[command(about = "Count words through two ordered stages")]
struct Args {
    #[command(flatten)]
    node: NodeArgs,
    /// How many times the text is fed.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    repeat: u32,
    /// Window interval (counts are emitted every window), e.g. 500ms.
    #[arg(long, default_value = "500ms", value_parser = |s: &str| humantime::parse_duration(s).map_err(|e| format!("{e}: write e.g. 500ms or 2s")))]
    window: Duration,
}

/// Splits lines into words, keyed by word.
struct Split;

impl Task for Split {
    type Input = Line;
    async fn process(&mut self, line: Line, ctx: &mut TaskContext) -> Result<(), TaskError> {
        for word in line.text.split_whitespace() {
            ctx.send(&WORDS, word, Word { word: word.to_owned() }).await?;
        }
        Ok(())
    }
}

/// Counts words of one partition in its stores; emits the totals that changed every
/// window.
struct Count {
    seen: Rc<RefCell<u64>>,
}

impl Task for Count {
    type Input = Word;
    async fn process(&mut self, w: Word, ctx: &mut TaskContext) -> Result<(), TaskError> {
        ctx.store(&TOTALS)?.update(w.word.clone(), |n| Some(n.unwrap_or(0) + 1))?;
        ctx.store(&CHANGED)?.put(w.word, ())?;
        *self.seen.borrow_mut() += 1;
        Ok(())
    }

    async fn window(&mut self, ctx: &mut TaskContext) -> Result<(), TaskError> {
        for (word, ()) in ctx.store(&CHANGED)?.entries() {
            let count = ctx.store(&TOTALS)?.get(&word).unwrap_or(0);
            ctx.send(&COUNTS, &word.clone(), WordCount { word: word.clone(), count }).await?;
            ctx.store(&CHANGED)?.delete(&word);
        }
        Ok(())
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let expected_words = u64::from(args.repeat) * TEXT.split_whitespace().count() as u64;
    let seen = Rc::new(RefCell::new(0u64));
    let s = seen.clone();
    let job = Job::new("wordcount")
        .task(LINES, |_| Split)
        .task(WORDS, move |_| Count { seen: s.clone() })
        .store(TOTALS)
        .store(CHANGED)
        .window_every(args.window)
        .output(COUNTS);
    let started = Instant::now();
    let repeat = args.repeat;
    let summary: Rc<RefCell<Vec<(String, u64)>>> = Rc::default();
    let sum = summary.clone();
    let seen_driver = seen.clone();
    flotilla::node::run(job, args.node, move |node| async move {
        // Ids of the run: a second feed of the same run stores nothing new.
        let run = node.run_id.clone();
        let lines = (0..repeat)
            .map(|doc| (format!("wordcount-{run}-doc-{doc}"), doc.to_string(), Line { doc, text: TEXT.to_owned() }));
        let fed = match Producer::new(node.broker.clone(), "wordcount") {
            Ok(producer) => producer.send_batch_with_ids(&LINES, lines).await.map(drop),
            Err(e) => Err(e),
        };
        if let Err(e) = fed {
            eprintln!("wordcount: feeding the text failed: {e}");
            node.stopper.stop();
            return;
        }
        // Wait until every word was counted and a window has emitted the totals.
        let deadline = Instant::now() + Duration::from_secs(120);
        while *seen_driver.borrow() < expected_words {
            if Instant::now() > deadline {
                eprintln!("wordcount: only {} of {expected_words} words counted after 120 s", *seen_driver.borrow());
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(args.window * 2).await;
        // Read the latest count per word back from the output stream.
        let reader = ConsumerSpec {
            max_ack_pending: None,
            ..ConsumerSpec::new(format!("summary-{}", node.node_id.replace(['.', ' '], "-")))
        };
        let name = reader.name.clone();
        if node.broker.ensure_consumer("FLOTILLA_wordcount_counts", reader).await.is_ok() {
            let mut latest: BTreeMap<String, u64> = BTreeMap::new();
            while let Ok(got) =
                node.broker.claim("FLOTILLA_wordcount_counts", &name, 1000, Duration::from_millis(200)).await
            {
                if got.is_empty() {
                    break;
                }
                for d in got {
                    if let Ok(wc) = Codec::default().decode::<WordCount>(&d.payload) {
                        let e = latest.entry(wc.word).or_default();
                        *e = (*e).max(wc.count);
                    }
                }
            }
            let _ = node.broker.delete_consumer("FLOTILLA_wordcount_counts", &name).await;
            let mut top: Vec<(String, u64)> = latest.into_iter().collect();
            top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            *sum.borrow_mut() = top;
        }
        node.stopper.stop();
    })?;
    let top = summary.borrow();
    let total: u64 = top.iter().map(|(_, c)| c).sum();
    println!("wordcount: {} lines, {} words counted in {:.2?}", args.repeat, *seen.borrow(), started.elapsed());
    println!("distinct words {}, sum of latest counts {total} (expected {expected_words})", top.len());
    for (word, count) in top.iter().take(8) {
        println!("  {word:<12} {count}");
    }
    Ok(())
}
