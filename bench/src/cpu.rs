//! CPU time spent during a timed window, by this process and by the nats-server, so each
//! pair shows where its cost lands (client or server) and not only the rate.

use std::time::Duration;

/// CPU seconds of a process so far (user + system), from `/proc/<pid>/stat` (`self` for
/// this process), in the kernel's fixed USER_HZ ticks of 10 ms.
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// CPU time at the start of a timed window.
pub struct Cpu {
    client: Option<f64>,
    server_pid: Option<u32>,
    server: Option<f64>,
}

impl Cpu {
    pub fn start(server_pid: Option<u32>) -> Self {
        Self { client: cpu_seconds("self"), server_pid, server: server_pid.and_then(|p| cpu_seconds(&p.to_string())) }
    }
}

/// One timed round: the rate and the CPU each process spent per message.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Measured {
    pub rate: f64,
    /// This process's CPU per message (µs), all threads; `NaN` where unreadable.
    pub client_us: f64,
    /// nats-server's CPU per message (µs).
    pub server_us: f64,
}

impl Measured {
    pub fn new(n: u64, elapsed: Duration, cpu: &Cpu) -> Self {
        let per_msg = |before: Option<f64>, after: Option<f64>| match (before, after) {
            (Some(b), Some(a)) if n > 0 => (a - b) * 1e6 / n as f64,
            _ => f64::NAN,
        };
        Self {
            rate: n as f64 / elapsed.as_secs_f64().max(1e-9),
            client_us: per_msg(cpu.client, cpu_seconds("self")),
            server_us: per_msg(cpu.server, cpu.server_pid.and_then(|p| cpu_seconds(&p.to_string()))),
        }
    }
}
