//! Medians, percentiles and the printed table.

use crate::cpu::Measured;
use std::time::Duration;

/// One measured pair: the raw baseline and Flotilla, round by round.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Pair {
    /// What is compared.
    pub name: String,
    /// What the raw side is.
    pub baseline: String,
    /// The target, as text.
    pub target: String,
    /// msgs/s of the raw side, one per round.
    pub raw: Vec<f64>,
    /// msgs/s of Flotilla, one per round.
    pub flotilla: Vec<f64>,
    /// Latency samples (µs) of the raw side, all rounds.
    #[serde(skip)]
    pub raw_latency_us: Vec<u64>,
    /// Latency samples (µs) of Flotilla, all rounds.
    #[serde(skip)]
    pub flotilla_latency_us: Vec<u64>,
    /// CPU per message of each side's rounds (throughput pairs).
    pub raw_cpu: Vec<Measured>,
    pub flotilla_cpu: Vec<Measured>,
    /// Per-round p99 latency (µs), raw.
    pub raw_p99_us: Vec<u64>,
    /// Per-round p99 latency (µs), Flotilla.
    pub flotilla_p99_us: Vec<u64>,
}

impl Pair {
    pub fn new(name: &str, baseline: &str, target: &str) -> Self {
        Self { name: name.into(), baseline: baseline.into(), target: target.into(), ..Self::default() }
    }

    /// Records one round of each side.
    pub fn push(&mut self, raw: Measured, flotilla: Measured) {
        self.raw.push(raw.rate);
        self.flotilla.push(flotilla.rate);
        self.raw_cpu.push(raw);
        self.flotilla_cpu.push(flotilla);
    }

    /// Median of the per-round ratios (Flotilla / raw): each round's two runs are
    /// neighbours in time, so the ratio cancels most of the machine's drift.
    pub fn ratio(&self) -> f64 {
        median(&self.raw.iter().zip(&self.flotilla).map(|(r, f)| f / r.max(1e-9)).collect::<Vec<_>>())
    }
}

pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
}

/// The `q`-quantile (0..=1) of samples, nearest rank.
pub fn percentile(samples: &mut [u64], q: f64) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    samples.sort_unstable();
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}

pub fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

fn human(rate: f64) -> String {
    if rate >= 1e6 {
        format!("{:.2}M/s", rate / 1e6)
    } else if rate >= 1e3 {
        format!("{:.1}k/s", rate / 1e3)
    } else {
        format!("{rate:.0}/s")
    }
}

fn ms(us: u64) -> String {
    format!("{:.2} ms", us as f64 / 1000.0)
}

/// Prints one pair as a block of the final report.
pub fn print_pair(p: &Pair) {
    let rounds: Vec<String> =
        p.raw.iter().zip(&p.flotilla).map(|(r, f)| format!("{}/{}", human(*r), human(*f))).collect();
    println!(
        "{:<34} raw {:>10}  flotilla {:>10}  ratio {:>5.2}x  (target {})",
        p.name,
        human(median(&p.raw)),
        human(median(&p.flotilla)),
        p.ratio(),
        p.target
    );
    println!("{:<34}   baseline: {}; rounds raw/flotilla: {}", "", p.baseline, rounds.join(" "));
    if !p.raw_cpu.is_empty() {
        let med = |v: &[Measured], f: fn(&Measured) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
        println!(
            "{:<34}   CPU per message (median µs): raw client {:.1} server {:.1} | flotilla client {:.1} server {:.1}",
            "",
            med(&p.raw_cpu, |m| m.client_us),
            med(&p.raw_cpu, |m| m.server_us),
            med(&p.flotilla_cpu, |m| m.client_us),
            med(&p.flotilla_cpu, |m| m.server_us),
        );
    }
    if !p.raw_latency_us.is_empty() {
        let (mut r, mut f) = (p.raw_latency_us.clone(), p.flotilla_latency_us.clone());
        println!(
            "{:<34}   latency raw p50 {} p99 {} p999 {} | flotilla p50 {} p99 {} p999 {} | median of round p99s: raw {} flotilla {} (+{})",
            "",
            ms(percentile(&mut r, 0.5)),
            ms(percentile(&mut r, 0.99)),
            ms(percentile(&mut r, 0.999)),
            ms(percentile(&mut f, 0.5)),
            ms(percentile(&mut f, 0.99)),
            ms(percentile(&mut f, 0.999)),
            ms(median_u64(&p.raw_p99_us)),
            ms(median_u64(&p.flotilla_p99_us)),
            ms(median_u64(&p.flotilla_p99_us).saturating_sub(median_u64(&p.raw_p99_us))),
        );
    }
}

pub fn median_u64(xs: &[u64]) -> u64 {
    median(&xs.iter().map(|&x| x as f64).collect::<Vec<_>>()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let mut s: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&mut s, 0.5), 500);
        assert_eq!(percentile(&mut s, 0.99), 990);
        assert_eq!(percentile(&mut s, 0.999), 999);
        let p = Pair { raw: vec![100.0, 200.0, 100.0], flotilla: vec![80.0, 100.0, 90.0], ..Pair::default() };
        assert!((p.ratio() - 0.8).abs() < 1e-9);
    }
}
