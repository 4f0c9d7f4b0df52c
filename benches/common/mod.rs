//! Shared by the benches: realistic ids and lifecycles, pre-encoded event streams, resident
//! memory, percentiles, and a few helpers for talking to a private nats-server.
#![allow(dead_code)]

/// The binary's allocator setting, so the benches measure what it runs (one copy, the CLI's).
#[path = "../../cli/src/allocator.rs"]
pub mod allocator;

use std::fs;
use std::future::Future;
use std::time::{Duration, Instant};

use async_nats::Subject;
use bytes::Bytes;
use lease_router::wire::{
    self, Admitted, BatchWriter, Completed, Envelope, LeaseEvent, Outcome, ProgressStage,
    Progressed,
};
use lease_router::Batching;
use lease_router::StepTime;
use lease_router::{connect, NatsConnectConfig, NatsConnection};
use lease_router::{DeploymentName, Subjects};
use lease_router_testkit::{NatsServer, NatsServerBuilder};

/// A small, fast, deterministic generator (splitmix64): the benches need repeatable streams,
/// not cryptographic randomness.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0); the modulo bias is irrelevant here.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A 36-character UUID-like request id (8-4-4-4-12 hex), unique per `(space, n)`.
pub fn uuid_like(space: u64, n: u64) -> String {
    let mut rng = Rng::new(space.wrapping_mul(0x1000_0000_01B3) ^ n);
    let a = rng.next_u64();
    let b = rng.next_u64();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        (a >> 32) as u32,
        (a >> 16) as u16,
        a as u16 & 0x0fff,
        (b >> 48) as u16 & 0x3fff | 0x8000,
        // The low bits carry n itself, so ids of one space never collide.
        (b & 0xffff_0000_0000) | (n & 0xffff_ffff),
    )
}

/// Bytes of every file under `dir` (a nats-server's store), 0 for what cannot be read.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

/// Resident set size of this process, from `/proc/self/status`.
pub fn rss_bytes() -> u64 {
    let status = fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("VmRSS in /proc/self/status")
}

/// Runs a bench's `main` as the `lease-router` binary runs: its allocator setting, and a
/// two-worker multi-thread tokio runtime (the 2-core machine BENCHMARKS.md figures come from).
pub fn run<F: Future>(main: F) -> F::Output {
    allocator::tune_for_latency();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(main)
}

/// The machine a figure was measured on, for the report.
pub fn machine() -> String {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    // The binary the benches' servers run (`NATS_SERVER_BIN`, else PATH, else `.tools/`).
    let nats = lease_router_testkit::nats_server_binary()
        .map_or_else(|| "nats-server".into(), |p| p.into_os_string());
    let nats = std::process::Command::new(nats)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "not found".into());
    let load = fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    format!("cpus={cores} cpu=\"{cpu}\" nats=\"{nats}\" loadavg=\"{load}\"")
}

/// The value at quantile `q` (0..=1) of sorted `values` (nearest rank).
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub fn subjects(deployment: &str) -> Subjects {
    Subjects::with_default_prefix(DeploymentName::new(deployment).expect("valid deployment"))
}

/// A connection whose subscriptions buffer up to `capacity` messages (`None`: the default).
pub async fn nats(url: &str, capacity: Option<usize>) -> NatsConnection {
    let mut config = NatsConnectConfig::new([url]).with_connect_deadline(Duration::from_secs(10));
    if let Some(capacity) = capacity {
        config = config.with_subscription_capacity(capacity);
    }
    connect(&config)
        .await
        .expect("connects to the bench nats-server")
}

/// A private nats-server for one bench, and its configuration file.
pub struct BenchServer {
    pub server: NatsServer,
    _config: tempfile::NamedTempFile,
}

/// Starts a private nats-server on a free port. A consumer may fall far behind a flood of
/// publishers in the throughput benches: the server is allowed to buffer 1 GiB for it (the
/// default is 64 MiB, past which core NATS drops messages for a slow consumer).
pub async fn bench_server() -> BenchServer {
    let mut config = tempfile::NamedTempFile::new().expect("temporary file");
    std::io::Write::write_all(
        &mut config,
        b"max_pending: 1073741824\nwrite_deadline: \"60s\"\n",
    )
    .expect("writes the nats-server configuration");
    let server = NatsServerBuilder::new()
        .config_file(config.path())
        .monitor_port(0)
        .spawn()
        .await
        .expect("nats-server starts (is it on PATH?)");
    BenchServer {
        server,
        _config: config,
    }
}

/// One event of a pre-built stream: where it goes and its encoded bytes.
#[derive(Clone)]
pub struct Encoded {
    pub subject: Subject,
    pub payload: Bytes,
}

/// Shape of the request lifecycles a publisher emits.
#[derive(Clone, Copy, Debug)]
pub struct LifecycleShape {
    /// Requests in flight at once per publisher (their events interleave).
    pub concurrency: usize,
    /// `progressed` events per request: uniformly `min..=max` (the first is `prefill_done`).
    pub min_progress: u64,
    pub max_progress: u64,
    /// Percent of requests that never send `completed` (their leases stay live).
    pub never_completed_pct: u64,
    /// Block hashes each `admitted` carries at most (wire 1.3 `blk`): one per 16 prompt
    /// tokens, up to this many; the first 32 from one of 8 shared system prompts, the rest
    /// the request's own. 0: none.
    pub block_hashes: usize,
}

impl Default for LifecycleShape {
    fn default() -> Self {
        Self {
            concurrency: 256,
            min_progress: 2,
            max_progress: 4,
            never_completed_pct: 10,
            block_hashes: 0,
        }
    }
}

/// A request on its way through its lifecycle.
struct InFlight {
    id: String,
    worker: u64,
    progress_left: u64,
    progressed: u64,
    completes: bool,
}

/// Generates the events of one publisher: `requests` interleaved lifecycles (admitted,
/// several progressed, completed for all but ~`never_completed_pct`%) over `workers`.
pub struct LifecycleGen {
    rng: Rng,
    shape: LifecycleShape,
    workers: Vec<u64>,
    space: u64,
    started: u64,
    requests: u64,
    active: Vec<InFlight>,
}

impl LifecycleGen {
    pub fn new(space: u64, workers: Vec<u64>, requests: u64, shape: LifecycleShape) -> Self {
        Self {
            rng: Rng::new(space ^ 0x5EED),
            shape,
            workers,
            space,
            started: 0,
            requests,
            active: Vec::with_capacity(shape.concurrency),
        }
    }

    /// The next event, or `None` when every request has run its course.
    pub fn next_event(&mut self) -> Option<LeaseEvent> {
        if self.active.len() < self.shape.concurrency && self.started < self.requests {
            let n = self.started;
            self.started += 1;
            let id = uuid_like(self.space, n);
            let worker = self.workers[self.rng.below(self.workers.len() as u64) as usize];
            let spread = self.shape.max_progress - self.shape.min_progress + 1;
            let progress_left = self.shape.min_progress + self.rng.below(spread);
            let completes = self.rng.below(100) >= self.shape.never_completed_pct;
            let prompt_tokens = 256 + self.rng.below(4096) as u32;
            let blocks = (prompt_tokens as usize / 16).min(self.shape.block_hashes);
            // Drawn only when asked for, so that the streams without hashes stay as they were.
            let system = if blocks > 0 { self.rng.below(8) } else { 0 };
            let block_hashes = (0..blocks)
                .map(|b| {
                    if b < 32 {
                        system << 32 | b as u64
                    } else {
                        self.rng.next_u64()
                    }
                })
                .collect();
            let event = Admitted {
                block_hashes,
                block_capacity: None,
                class: None,
                request_id: id.clone(),
                worker_id: worker,
                dp_rank: 0,
                prompt_tokens,
                expected_output_tokens: Some(64 + self.rng.below(512) as u32),
                cached_tokens: None,
            };
            self.active.push(InFlight {
                id,
                worker,
                progress_left,
                progressed: 0,
                completes,
            });
            return Some(event.into());
        }
        while !self.active.is_empty() {
            let i = self.rng.below(self.active.len() as u64) as usize;
            let r = &mut self.active[i];
            if r.progress_left > 0 {
                r.progress_left -= 1;
                r.progressed += 1;
                let stage = if r.progressed == 1 {
                    ProgressStage::PrefillDone
                } else {
                    ProgressStage::Decoding
                };
                return Some(
                    Progressed {
                        request_id: r.id.clone(),
                        worker_id: r.worker,
                        dp_rank: 0,
                        stage,
                        output_tokens: (r.progressed * 16) as u32,
                    }
                    .into(),
                );
            }
            let r = self.active.swap_remove(i);
            if r.completes {
                return Some(
                    Completed {
                        request_id: r.id,
                        worker_id: r.worker,
                        dp_rank: 0,
                        outcome: Outcome::Finished,
                    }
                    .into(),
                );
            }
            // Never completed: it just goes silent, and a new request takes its slot.
            if self.started < self.requests {
                return self.next_event();
            }
        }
        None
    }
}

/// The whole pre-encoded stream of one publisher, stamped `published_at_us = ts`.
pub fn encoded_stream(
    subjects: &Subjects,
    publisher_id: u64,
    space: u64,
    workers: Vec<u64>,
    requests: u64,
    shape: LifecycleShape,
) -> Vec<Encoded> {
    let worker_subjects: std::collections::HashMap<u64, Subject> = workers
        .iter()
        .map(|&w| (w, Subject::from(subjects.worker_subject(w))))
        .collect();
    let mut gen = LifecycleGen::new(space, workers, requests, shape);
    let ts = wire::unix_micros_now();
    let mut out = Vec::new();
    let mut seq = 0;
    let mut buf = Vec::with_capacity(128);
    while let Some(event) = gen.next_event() {
        seq += 1;
        let subject = worker_subjects[&event.worker_id()].clone();
        buf.clear();
        wire::encode_into(&Envelope::new(publisher_id, seq, ts, event), &mut buf).expect("encodes");
        out.push(Encoded {
            subject,
            payload: Bytes::copy_from_slice(&buf),
        });
    }
    out
}

/// One message of a batched stream: the events of one worker subject that a batching
/// publisher sends together, and the `Nats-Msg-Id` the durable publisher gives it.
#[derive(Clone)]
pub struct BatchMessage {
    pub message: Encoded,
    pub events: usize,
    pub msg_id: String,
}

/// Events held in open batches, over all subjects, before a publisher sends them all (the
/// publisher's own limit, private to it: half a router's sequence window).
const MAX_OPEN_BATCH_EVENTS: usize = 2048;

/// One publisher's pre-encoded `stream`, batched as `LeasePublisher` batches it when its queue
/// never runs dry: per worker subject, a batch goes out when it holds `batching.max_events`
/// or one more event would make it larger than `batching.max_bytes`, and every open batch
/// (oldest first) once 2,048 events are open in all. No linger: a stream prepared in advance
/// has no time in it, so these are the largest batches the rules allow. Same events, same
/// sequence numbers; one event alone goes as a plain message, as the publisher sends it.
pub fn batch_stream(stream: &[Encoded], batching: Batching) -> Vec<BatchMessage> {
    struct Open {
        subject: Subject,
        writer: BatchWriter,
        publisher: u64,
        first: u64,
        last: u64,
    }
    fn send(mut open: Open, out: &mut Vec<BatchMessage>) {
        let events = open.writer.events();
        let msg_id = if events == 1 {
            format!("{}-{}", open.publisher, open.first)
        } else {
            format!("{}-{}-{}", open.publisher, open.first, open.last)
        };
        if let Some(payload) = open.writer.finish() {
            out.push(BatchMessage {
                message: Encoded {
                    subject: open.subject,
                    payload,
                },
                events,
                msg_id,
            });
        }
    }
    fn send_all(open: &mut std::collections::HashMap<String, Open>, out: &mut Vec<BatchMessage>) {
        let mut all: Vec<Open> = open.drain().map(|(_, o)| o).collect();
        all.sort_unstable_by_key(|o| o.first);
        for o in all {
            send(o, out);
        }
    }
    let mut open: std::collections::HashMap<String, Open> = std::collections::HashMap::new();
    let mut open_events = 0usize;
    let mut out = Vec::new();
    for e in stream {
        let envelope =
            wire::decode(&e.payload, wire::DEFAULT_MAX_EVENT_BYTES).expect("own stream decodes");
        let len = e.payload.len();
        if open
            .get(e.subject.as_str())
            .is_some_and(|o| o.writer.message_len(len) > batching.max_bytes)
        {
            let o = open.remove(e.subject.as_str()).expect("just seen");
            open_events -= o.writer.events();
            send(o, &mut out);
        }
        let o = open.entry(e.subject.to_string()).or_insert_with(|| Open {
            subject: e.subject.clone(),
            writer: BatchWriter::with_capacity((len * batching.max_events).min(batching.max_bytes)),
            publisher: envelope.publisher_id,
            first: envelope.sequence,
            last: envelope.sequence,
        });
        o.writer.push(&envelope).expect("encodes");
        o.last = envelope.sequence;
        let full = o.writer.events() >= batching.max_events;
        open_events += 1;
        if open_events >= MAX_OPEN_BATCH_EVENTS {
            send_all(&mut open, &mut out);
            open_events = 0;
        } else if full {
            let o = open.remove(e.subject.as_str()).expect("just filled");
            open_events -= o.writer.events();
            send(o, &mut out);
        }
    }
    send_all(&mut open, &mut out);
    out
}

/// Scan step lengths in µs, each sorted: wall time and the scanning thread's CPU time.
pub struct StepStats {
    pub wall: Vec<u64>,
    pub cpu: Vec<u64>,
}

impl StepStats {
    pub fn new(steps: &[StepTime]) -> Self {
        let sorted = |f: fn(&StepTime) -> Duration| {
            let mut v: Vec<u64> = steps.iter().map(|s| f(s).as_micros() as u64).collect();
            v.sort_unstable();
            v
        };
        Self {
            wall: sorted(|s| s.wall),
            cpu: sorted(|s| s.cpu),
        }
    }

    pub fn max_cpu(&self) -> u64 {
        self.cpu.last().copied().unwrap_or(0)
    }

    pub fn max_wall(&self) -> u64 {
        self.wall.last().copied().unwrap_or(0)
    }

    /// "wall p50 .. us, p99 .. us, max .. us; CPU p50 .., p99 .., max .. us; over 1 ms: .."
    pub fn describe(&self) -> String {
        let over_1ms = |v: &[u64]| v.iter().filter(|&&us| us > 1000).count();
        format!(
            "wall p50 {} us, p99 {} us, max {} us; CPU p50 {} us, p99 {} us, max {} us; steps \
             over 1 ms: {} (wall), {} (CPU) of {}",
            percentile(&self.wall, 0.5),
            percentile(&self.wall, 0.99),
            self.max_wall(),
            percentile(&self.cpu, 0.5),
            percentile(&self.cpu, 0.99),
            self.max_cpu(),
            over_1ms(&self.wall),
            over_1ms(&self.cpu),
            self.wall.len()
        )
    }
}

/// Waits until `done()` or `bound` passes, checking every millisecond; returns when it was
/// seen done (or `None` on timeout).
pub async fn wait_until(bound: Duration, mut done: impl FnMut() -> bool) -> Option<Instant> {
    let deadline = Instant::now() + bound;
    loop {
        if done() {
            return Some(Instant::now());
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// CPU time (user + system) a process has used so far, from `/proc/<pid>/stat` (one clock
/// tick's resolution, 10 ms at the usual 100 ticks per second); `None` for this process.
pub fn cpu_time(pid: Option<u32>) -> Duration {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let Ok(stat) = fs::read_to_string(path) else {
        return Duration::ZERO;
    };
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let ticks: u64 = fields
        .get(11..13)
        .map_or(0, |f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum());
    // SAFETY: sysconf only reads a configuration value.
    let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&t| t > 0)
        .unwrap_or(100);
    Duration::from_nanos(ticks * 1_000_000_000 / per_second)
}

/// Waits until `count()` reaches `total`, or stops growing for `stall`; returns when the last
/// count was first seen and that count. Checks every millisecond.
pub async fn wait_for_count(
    total: u64,
    stall: Duration,
    mut count: impl FnMut() -> u64,
) -> (Instant, u64) {
    let mut last = (Instant::now(), count());
    loop {
        let now = Instant::now();
        let n = count();
        if n != last.1 {
            last = (now, n);
        }
        if n >= total || now - last.0 >= stall {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
