//! Soak under faults (issue 29, item 5): three `lease-router serve` replicas on a three-node
//! JetStream cluster, simulated workers that crash, and random faults for `SOAK_MINUTES`
//! (30); then, at rest, every replica is compared with a reference fed directly.
//!
//! ```sh
//! cargo bench -p lease-router-cli --bench soak                   # 30 minutes of faults
//! SOAK_MINUTES=2 SOAK_SEED=7 cargo bench -p lease-router-cli --bench soak
//! ```
//!
//! Not run in CI, nor by a plain `cargo bench` (`bench = false`: only `--bench soak` runs
//! it). It prints the machine first, a line per fault as it happens, a table per rest and
//! pinned `soak_*=value` lines at the end; it exits 1 when a check fails (the logs of the
//! replicas and of the NATS nodes are then kept and their directory printed; `SOAK_LOG_DIR`
//! keeps them anyway).
//!
//! # What runs
//!
//! - **NATS**: three nodes, routed, JetStream clustered, started with the testkit's
//!   `NatsServerBuilder` and `--no_advertise` (the testkit's `NatsCluster` cannot pass it):
//!   without it every node tells its clients the other nodes' direct addresses, and a
//!   replica behind the fault proxies reconnects around its own partition.
//! - **Replicas**: the real binary (`CARGO_BIN_EXE_lease-router`), deployment `soak`:
//!   `durable-a` and `durable-b` (`--durable --stream-replicas 3 --snapshot-interval 20s
//!   --snapshot-keep 6`, so snapshots are written and loaded during the soak) and `core`
//!   (core NATS). Each reaches every node through a `TcpProxy` of its own (three per
//!   replica), `--nats-ping-interval 2s`.
//! - **Workers** (`SOAK_WORKERS`, 8, with `SOAK_DP_RANKS`, 2, ranks each), in process: each
//!   stamps and encodes its own envelopes (publisher id, sequence) and publishes them to the
//!   stream with `Nats-Msg-Id` = publisher id and sequence, one at a time: each is
//!   acknowledged (the same bytes re-sent until it is, at most 60 s; a give-up is counted as
//!   `unacked`) before the worker's next goes, so the stream holds each worker's events in
//!   the order the references applied them (a re-send that lands behind later events could
//!   outlast the routers' 10 s hold of progress before its admission, a difference of the
//!   publisher's making). Core subscribers get the same messages. Requests arrive at `SOAK_RATE`
//!   (50/s) over all workers: `admitted`, `progressed` at prefill and every
//!   `SOAK_PROGRESS_EVERY` (500 ms), `completed` after an exponential life (mean 2 s, at
//!   most 10 s); 3% crash (never completed), 2% send their `admitted` or `completed` twice,
//!   `SOAK_REORDER_SHARE` (2%) send their `admitted` 5 ms to `SOAK_LATE_ADMISSION` (300 ms)
//!   late (after their progress or even their completion). Every `SOAK_WORKER_CRASH_EVERY`
//!   (30 s, over the fleet) a random worker crashes: its live requests stop where they are,
//!   it is down 1-5 s, and it comes back as a new publisher whose first event, a
//!   `worker_reset`, is acknowledged before it goes on.
//! - **References**: two in-process `lease_router::Router`s fed every event the moment a
//!   worker hands it to the client, by `EventApplier::apply` on the same subject and bytes
//!   (duplicates included), never over the network: `reference-durable` with the durable
//!   replicas' lease settings and `reference-core` with the core replica's.
//! - **Faults**, one starting every `SOAK_FAULT_EVERY` (20 s) on average (exponential gaps),
//!   of a kind drawn uniformly; faults overlap, but a replica has one fault at a time and at
//!   most one NATS node is down at once (the R3 stream keeps its quorum):
//!   router SIGKILL (`durable-b` or `core`), down 1-8 s, restarted and awaited until
//!   `/readyz`; NATS node SIGKILL, down 2-15 s, restarted on its store and awaited until the
//!   cluster has formed again; silent partition of one replica (its three proxies pass
//!   nothing and close nothing) for 8-30 s, which it must see by its pings (`/healthz`
//!   503, polled every 0.5 s); frozen replica (SIGSTOP, SIGCONT) for 2-25 s. `durable-a` is
//!   partitioned and frozen but never killed: its one process lives through the soak.
//!   `SOAK_SEED` fixes every choice (kinds, targets, lengths, requests), not their timing.
//!
//! # At rest
//!
//! Before the faults (after `SOAK_WARMUP`, 30 s, of traffic with worker crashes) and after
//! them, the same procedure:
//!
//! 1. every fault has healed (each fault task has ended), every replica runs, every node is
//!    up and the cluster has formed; worker crashes stop;
//! 2. the workers drain: no new request, every live one runs to its end (a crashed one stays
//!    an orphan); every publish is acknowledged; every replica answers `/readyz` and
//!    `/healthz` with 200;
//! 3. a barrier: a lease admitted by worker 1 that every replica must list (re-sent under
//!    a new id until one is seen by all: live events reach every replica), then completed;
//! 4. quiet for 2.5 core scan intervals + 3 s: every orphan lease (crashed requests, and in
//!    core mode the leases whose completion the replica missed) has expired in the core
//!    replica and in `reference-core`;
//! 5. a cohort: on every rank of every worker, `SOAK_COHORT` (3) leases in several phases
//!    (admitted only; prefill done; decoding, with an out-of-order lower `otok`; one whose
//!    progress comes before its admission; duplicated admissions), all acknowledged;
//! 6. the comparison, within one core scan interval of the cohort, with no event in flight.
//!
//! **Identical at rest** then means, for every replica: the set of leases (request id,
//! worker, rank; not the clock state, not the age) and, for every member worker rank, its
//! six load figures (bookings, prompt, expected output, prefill waiting, KV held, output to
//! come; not `last_seen_ms`) equal its reference's, exactly. The two modes are held to what
//! each promises:
//!
//! - The durable replicas and `reference-durable` never expire a lease
//!   (`--lease-scan-interval 24h`): the state is a pure function of the events applied, so
//!   at rest it is the whole history: every orphan of every crashed request since its
//!   worker's last reset, plus the cohort. A durable replica killed, partitioned or frozen
//!   must end with exactly the leases and loads it would have had without the fault.
//! - The core replica and `reference-core` expire leases (`SOAK_CORE_SCAN`, 15 s): core mode
//!   is at-most-once by design, so only what it hears after the faults can be exact: at rest
//!   both hold exactly the cohort (checked against the cohort's own list too).
//!
//! **The accounting identity** (README, Metrics): on every replica's `/metrics`, and on both
//! references, `events_received_total = sum(events_applied_total) + sum(events_dropped_total)
//! + events_held`, exactly (nothing is in flight when it is read).
//!
//! **Consumers**: after the comparison, the lease stream's consumers (those the consumer list
//! describes, over the cluster) must come down to one per durable replica within 120 s (a
//! killed or reconnected replica's ordered consumer goes once idle for 30 s). The stream
//! state's `consumer_count` is printed beside it, and the consumer names when the check
//! fails: on nats-server 2.9.10 after node restarts, the count can stay above the list, and
//! the names can count one more than the list describes (seen: 3 names, 2 described, 2
//! counted, both described consumers the live replicas').
//!
//! **Flat**: each replica's RSS (`/proc/<pid>/status`), threads and `lease_router_live_tasks`
//! at the second rest against the first. The live tasks must be equal on every replica. RSS
//! is held to `SOAK_MAX_RSS_GROWTH` (1.5x) on `durable-a`, whose process is the same at both
//! rests; the others are printed (a restarted replica is a new process, and a core replica
//! keeps the memory of the backlog it buffered after a freeze: glibc holds the high-water
//! mark of each arena, about +10 MB per arena for a 25 s freeze at this rate, then flat).

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishAckFuture};
use async_nats::HeaderMap;
use bytes::Bytes;
use lease_router::wire::{
    self, Admitted, Completed, Envelope, LeaseEvent, Outcome, ProgressStage, Progressed,
    WorkerReset,
};
use lease_router::{
    connect, ApplyConfig, DeploymentName, EventApplier, IngressStats, NatsConnectConfig, NoIngress,
    Router, RouterConfig, Subjects,
};
use lease_router_testkit::{pick_free_ports, NatsServer, NatsServerBuilder, TcpProxy};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot, Mutex as AsyncMutex, OwnedMutexGuard};
use tokio::task::JoinSet;
use tokio::time::{sleep, sleep_until, timeout, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_lease-router");
const DEPLOYMENT: &str = "soak";
/// The durable replicas' (and their reference's) lease scan interval: no lease expires
/// during a soak.
const DURABLE_SCAN: &str = "24h";
const DURABLE_SCAN_SECS: u64 = 24 * 3600;
/// Every listing asks for all leases (the router's cap).
const LEASE_LIMIT: usize = 100_000;
/// How long an acknowledgement is awaited before the event is sent again.
const ACK_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one event is re-sent before it is given up (inside the stream's 120 s
/// duplicate window, so a late copy is still stored once).
const SETTLE_DEADLINE: Duration = Duration::from_secs(60);
/// Longest request life (the drain at rest waits for the longest).
const MAX_REQUEST_LIFE: Duration = Duration::from_secs(10);
const MEAN_REQUEST_LIFE: Duration = Duration::from_secs(2);
const CRASH_SHARE: f64 = 0.03;
const DUPLICATE_SHARE: f64 = 0.02;
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
const READY_TIMEOUT: Duration = Duration::from_secs(180);
const SAMPLE_EVERY: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Settings {
    minutes: f64,
    seed: u64,
    fault_every: Duration,
    warmup: Duration,
    rate: f64,
    workers: u64,
    dp_ranks: u32,
    worker_crash_every: Duration,
    progress_every: Duration,
    core_scan: Duration,
    cohort: usize,
    reorder_share: f64,
    late_admission: Duration,
    max_rss_growth: f64,
    log_dir: Option<PathBuf>,
}

fn env_str(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn env_f64(name: &str, default: f64) -> f64 {
    env_str(name).map_or(default, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| die(&format!("{name}={v}: expected a number")))
    })
}

fn env_u64(name: &str, default: u64) -> u64 {
    env_str(name).map_or(default, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| die(&format!("{name}={v}: expected a whole number")))
    })
}

/// `20s`, `500ms`, `2m`, or plain seconds.
fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = v.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (v, 1.0)
    };
    let secs: f64 = num.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs * scale))
}

fn env_duration(name: &str, default: Duration) -> Duration {
    env_str(name).map_or(default, |v| {
        parse_duration(&v)
            .unwrap_or_else(|| die(&format!("{name}={v}: expected a duration such as 20s")))
    })
}

fn die(message: &str) -> ! {
    eprintln!("soak: {message}");
    std::process::exit(2)
}

impl Settings {
    fn from_env() -> Self {
        let seed = env_str("SOAK_SEED").map_or_else(
            || {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_micros() as u64 % 1_000_000)
            },
            |v| {
                v.trim()
                    .parse()
                    .unwrap_or_else(|_| die(&format!("SOAK_SEED={v}: expected a whole number")))
            },
        );
        let s = Self {
            minutes: env_f64("SOAK_MINUTES", 30.0),
            seed,
            fault_every: env_duration("SOAK_FAULT_EVERY", Duration::from_secs(20)),
            warmup: env_duration("SOAK_WARMUP", Duration::from_secs(30)),
            rate: env_f64("SOAK_RATE", 50.0),
            workers: env_u64("SOAK_WORKERS", 8),
            dp_ranks: env_u64("SOAK_DP_RANKS", 2) as u32,
            worker_crash_every: env_duration("SOAK_WORKER_CRASH_EVERY", Duration::from_secs(30)),
            progress_every: env_duration("SOAK_PROGRESS_EVERY", Duration::from_millis(500)),
            core_scan: env_duration("SOAK_CORE_SCAN", Duration::from_secs(15)),
            cohort: env_u64("SOAK_COHORT", 3) as usize,
            reorder_share: env_f64("SOAK_REORDER_SHARE", 0.02),
            late_admission: env_duration("SOAK_LATE_ADMISSION", Duration::from_millis(300)),
            max_rss_growth: env_f64("SOAK_MAX_RSS_GROWTH", 1.5),
            log_dir: env_str("SOAK_LOG_DIR").map(PathBuf::from),
        };
        if !(s.minutes >= 0.0 && s.rate > 0.0 && s.workers > 0 && s.dp_ranks > 0) {
            die("SOAK_MINUTES >= 0, SOAK_RATE > 0, SOAK_WORKERS > 0 and SOAK_DP_RANKS > 0");
        }
        if s.fault_every.is_zero()
            || s.worker_crash_every.is_zero()
            || s.progress_every.is_zero()
            || s.core_scan < Duration::from_secs(2)
            || s.cohort == 0
            || !(0.0..=1.0).contains(&s.reorder_share)
            || s.late_admission < Duration::from_millis(6)
        {
            die("SOAK_FAULT_EVERY, SOAK_WORKER_CRASH_EVERY and SOAK_PROGRESS_EVERY > 0, SOAK_CORE_SCAN >= 2s, SOAK_COHORT > 0, SOAK_REORDER_SHARE in 0..=1, SOAK_LATE_ADMISSION >= 6ms");
        }
        s
    }

    fn fault_phase(&self) -> Duration {
        Duration::from_secs_f64(self.minutes * 60.0)
    }
}

/// Exponentially distributed with this mean.
fn exponential(rng: &mut StdRng, mean: Duration) -> Duration {
    let u: f64 = rng.random();
    mean.mul_f64(-(1.0 - u).ln())
}

fn uniform(rng: &mut StdRng, lo: Duration, hi: Duration) -> Duration {
    lo + (hi - lo).mul_f64(rng.random::<f64>())
}

// ---------------------------------------------------------------------------------------------
// The machine, the clock, the log
// ---------------------------------------------------------------------------------------------

fn machine() -> String {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let nats = lease_router_testkit::nats_server_binary()
        .map_or_else(|| "nats-server".into(), |p| p.into_os_string());
    let nats = std::process::Command::new(nats)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "not found".into());
    format!(
        "cpus={cores} cpu=\"{cpu}\" nats=\"{nats}\" loadavg=\"{}\"",
        loadavg()
    )
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Seconds since the bench started, for the timeline.
struct Clock(Instant);

impl Clock {
    fn line(&self, text: impl AsRef<str>) {
        println!(
            "[{:>7.1}s] {}",
            self.0.elapsed().as_secs_f64(),
            text.as_ref()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP (HTTP/1.0 GETs on loopback: the server answers with a length and closes)
// ---------------------------------------------------------------------------------------------

async fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
    let fut = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| e.to_string())?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .await
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| "no end of headers".to_string())?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {head:?}"))?;
        Ok((status, body.to_string()))
    };
    timeout(HTTP_TIMEOUT, fut)
        .await
        .map_err(|_| format!("GET {path} on port {port} timed out"))?
}

async fn http_json(port: u16, path: &str) -> Result<Value, String> {
    let (status, body) = http_get(port, path).await?;
    if status != 200 {
        return Err(format!("GET {path}: {status} {body}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("GET {path}: {e}"))
}

async fn http_ok(port: u16, path: &str) -> bool {
    matches!(http_get(port, path).await, Ok((200, _)))
}

/// The samples of one metric (`name` exactly, any labels) whose labels contain `filter`.
fn metric_values<'a>(
    text: &'a str,
    name: &'a str,
    filter: &'a str,
) -> impl Iterator<Item = f64> + 'a {
    text.lines().filter_map(move |line| {
        if line.starts_with('#') {
            return None;
        }
        let rest = line.strip_prefix(name)?;
        let (labels, value) = if let Some(rest) = rest.strip_prefix('{') {
            let (labels, value) = rest.split_once('}')?;
            (labels, value)
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            return None;
        };
        if !labels.contains(filter) {
            return None;
        }
        value.split_whitespace().next()?.parse().ok()
    })
}

fn metric_sum(text: &str, name: &str) -> u64 {
    metric_values(text, name, "deployment=\"soak\"")
        .sum::<f64>()
        .round() as u64
}

fn metric_plain(text: &str, name: &str) -> u64 {
    metric_values(text, name, "").sum::<f64>().round() as u64
}

/// The drop reasons that counted something, `reason=n` each.
fn nonzero_drops(text: &str) -> String {
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("lease_router_events_dropped_total{") {
            if !rest.contains("deployment=\"soak\"") {
                continue;
            }
            let reason = rest
                .split("reason=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("?");
            let n: f64 = rest
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            if n > 0.0 {
                out.push(format!("{reason}={n}"));
            }
        }
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(",")
    }
}

/// VmRSS (bytes) and Threads of a process.
fn proc_status(pid: u32) -> Option<(u64, u64)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")? * 1024, field("Threads:")?))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

// ---------------------------------------------------------------------------------------------
// The NATS cluster
// ---------------------------------------------------------------------------------------------

struct Node {
    index: usize,
    server: AsyncMutex<NatsServer>,
    client_port: u16,
    monitor_port: u16,
    up: AtomicBool,
}

struct Cluster {
    nodes: Vec<Arc<Node>>,
    /// Taken by a node fault: at most one node is down at a time.
    node_fault: Arc<AsyncMutex<()>>,
}

impl Cluster {
    async fn start() -> Result<Cluster, String> {
        let mut last = String::new();
        for attempt in 1..=3 {
            let ports = pick_free_ports(9).map_err(|e| e.to_string())?;
            let name = format!("soak-{}-{attempt}", std::process::id());
            let spawns = (0..3).map(|i| {
                let routes = (0..3)
                    .filter(|&j| j != i)
                    .map(|j| format!("nats://127.0.0.1:{}", ports[3 + j]))
                    .collect();
                NatsServerBuilder::new()
                    .jetstream(true)
                    .port(ports[i])
                    .cluster(&name, ports[3 + i], routes)
                    .monitor_port(ports[6 + i])
                    .server_name(format!("{name}-n{i}"))
                    .arg("--no_advertise")
                    .ready_timeout(Duration::from_secs(30))
                    .spawn()
            });
            match futures::future::try_join_all(spawns).await {
                Ok(servers) => {
                    let nodes = servers
                        .into_iter()
                        .enumerate()
                        .map(|(i, server)| {
                            Arc::new(Node {
                                index: i,
                                client_port: server.client_port(),
                                monitor_port: server.monitor_port().expect("monitor port"),
                                server: AsyncMutex::new(server),
                                up: AtomicBool::new(true),
                            })
                        })
                        .collect();
                    let cluster = Cluster {
                        nodes,
                        node_fault: Arc::new(AsyncMutex::new(())),
                    };
                    cluster.wait_formed(Duration::from_secs(60)).await?;
                    return Ok(cluster);
                }
                Err(e) => last = format!("{e:?}"),
            }
        }
        Err(format!("the NATS cluster did not start: {last}"))
    }

    fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.client_port))
            .collect()
    }

    /// Every running node routes to every other and they agree on a JetStream meta leader.
    async fn formed_once(&self) -> Result<(), String> {
        let running: Vec<&Arc<Node>> = self
            .nodes
            .iter()
            .filter(|n| n.up.load(Ordering::Acquire))
            .collect();
        let mut leaders = BTreeSet::new();
        for node in &running {
            let routez = http_json(node.monitor_port, "/routez").await?;
            let routes = routez["num_routes"].as_u64().unwrap_or(0);
            if routes + 1 < running.len() as u64 {
                return Err(format!("node {} has {routes} routes", node.index));
            }
            let jsz = http_json(node.monitor_port, "/jsz").await?;
            let leader = jsz["meta_cluster"]["leader"].as_str().unwrap_or_default();
            if leader.is_empty() {
                return Err(format!("node {} knows no meta leader", node.index));
            }
            leaders.insert(leader.to_string());
        }
        if leaders.len() > 1 {
            return Err(format!("nodes disagree on the meta leader: {leaders:?}"));
        }
        Ok(())
    }

    async fn wait_formed(&self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            match self.formed_once().await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("the cluster did not form within {limit:?}: {e}"))
                }
                Err(_) => sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The replicas
// ---------------------------------------------------------------------------------------------

struct Replica {
    name: &'static str,
    args: Vec<String>,
    log_path: PathBuf,
    proxies: Vec<TcpProxy>,
    child: Option<Child>,
    pid: Arc<AtomicU32>,
    starts: u32,
}

impl Replica {
    fn start(&mut self) -> Result<(), String> {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| e.to_string())?;
        self.starts += 1;
        let _ = writeln!(log, "=== soak: start {} of {}", self.starts, self.name);
        let child = Command::new(BIN)
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("{BIN}: {e}"))?;
        self.pid.store(child.id().unwrap_or(0), Ordering::Release);
        self.child = Some(child);
        Ok(())
    }

    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = timeout(Duration::from_secs(10), child.wait()).await;
        }
        self.pid.store(0, Ordering::Release);
    }

    /// `Some(status)` when the process ended without being told to.
    fn exited(&mut self) -> Option<String> {
        match self.child.as_mut()?.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.pid.load(Ordering::Acquire);
        if pid != 0 {
            // SAFETY: kill(2) on a child of ours.
            unsafe {
                libc::kill(pid as libc::pid_t, signal);
            }
        }
    }
}

#[derive(Clone)]
struct ReplicaHandle {
    name: &'static str,
    durable: bool,
    /// Router SIGKILLs spare one replica, whose one process lives through the whole soak:
    /// its memory and tasks at the end are the leak check.
    killable: bool,
    http_port: u16,
    pid: Arc<AtomicU32>,
    state: Arc<AsyncMutex<Replica>>,
}

impl ReplicaHandle {
    async fn wait_ready(&self, limit: Duration) -> Result<Duration, String> {
        let start = Instant::now();
        loop {
            if http_ok(self.http_port, "/readyz").await && http_ok(self.http_port, "/healthz").await
            {
                return Ok(start.elapsed());
            }
            if start.elapsed() >= limit {
                let why = http_get(self.http_port, "/readyz")
                    .await
                    .map_or_else(|e| e, |(s, b)| format!("{s} {b}"));
                return Err(format!("{} not ready within {limit:?}: {why}", self.name));
            }
            sleep(Duration::from_millis(200)).await;
        }
    }

    async fn metrics(&self) -> Result<String, String> {
        let (status, body) = http_get(self.http_port, "/metrics").await?;
        if status != 200 {
            return Err(format!("{}: /metrics {status}", self.name));
        }
        Ok(body)
    }
}

// ---------------------------------------------------------------------------------------------
// What the workers publish, and the references
// ---------------------------------------------------------------------------------------------

struct References {
    durable: EventApplier,
    core: EventApplier,
}

/// The publishing side shared by every worker.
struct Bus {
    js: jetstream::Context,
    subjects: Subjects,
    refs: parking_lot::Mutex<References>,
    pending: AtomicU64,
    /// Events stamped (one sequence number each).
    events: AtomicU64,
    /// First sends, duplicate copies included.
    messages: AtomicU64,
    retries: AtomicU64,
    unacked: AtomicU64,
}

/// One life of a worker process: its publisher id and sequence.
struct Incarnation {
    publisher_id: u64,
    sequence: u64,
    /// Its events whose acknowledgement is outstanding.
    pending: Arc<AtomicU64>,
}

impl Bus {
    /// Stamps, encodes, feeds the references and publishes one event (twice when `dup`:
    /// the same bytes, as a re-sending worker would).
    async fn send(self: &Arc<Self>, inc: &mut Incarnation, event: LeaseEvent, dup: bool) {
        inc.sequence += 1;
        let worker = event.worker_id();
        let envelope = Envelope::new(
            inc.publisher_id,
            inc.sequence,
            wire::unix_micros_now(),
            event,
        );
        let payload = Bytes::from(wire::encode(&envelope).expect("a valid event encodes"));
        let subject = self.subjects.worker_subject(worker);
        let msg_id = format!("{}-{}", inc.publisher_id, inc.sequence);
        self.events.fetch_add(1, Ordering::Relaxed);
        for _ in 0..if dup { 2 } else { 1 } {
            {
                let mut refs = self.refs.lock();
                let _ = refs.durable.apply(&subject, &payload);
                let _ = refs.core.apply(&subject, &payload);
            }
            self.publish(
                subject.clone(),
                payload.clone(),
                msg_id.clone(),
                &inc.pending,
            )
            .await;
        }
    }

    async fn publish(
        self: &Arc<Self>,
        subject: String,
        payload: Bytes,
        msg_id: String,
        inc_pending: &Arc<AtomicU64>,
    ) {
        self.messages.fetch_add(1, Ordering::Relaxed);
        self.pending.fetch_add(1, Ordering::AcqRel);
        inc_pending.fetch_add(1, Ordering::AcqRel);
        // One at a time: the next event of this worker goes once this one is stored, so a
        // re-send never lands behind a later event and the stream holds each worker's events
        // in the order the references applied them.
        let first = self.try_send(&subject, &payload, &msg_id).await;
        self.settle(subject, payload, msg_id, first).await;
        inc_pending.fetch_sub(1, Ordering::AcqRel);
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }

    async fn try_send(
        &self,
        subject: &str,
        payload: &Bytes,
        msg_id: &str,
    ) -> Option<PublishAckFuture> {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        let send = self
            .js
            .publish_with_headers(subject.to_string(), headers, payload.clone());
        match timeout(ACK_TIMEOUT, send).await {
            Ok(Ok(ack)) => Some(ack),
            _ => None,
        }
    }

    /// Waits for the acknowledgement; re-sends the same bytes and id until one comes.
    async fn settle(
        &self,
        subject: String,
        payload: Bytes,
        msg_id: String,
        mut ack: Option<PublishAckFuture>,
    ) {
        let deadline = Instant::now() + SETTLE_DEADLINE;
        let mut delay = Duration::from_millis(100);
        loop {
            if let Some(ack) = ack.take() {
                if let Ok(Ok(_)) = timeout(ACK_TIMEOUT, ack).await {
                    return;
                }
            }
            if Instant::now() >= deadline {
                self.unacked.fetch_add(1, Ordering::Relaxed);
                return;
            }
            sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
            self.retries.fetch_add(1, Ordering::Relaxed);
            ack = self.try_send(&subject, &payload, &msg_id).await;
        }
    }

    /// Waits until `pending` is zero, at most `limit`.
    async fn settled(pending: &AtomicU64, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while pending.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            sleep(Duration::from_millis(20)).await;
        }
        true
    }
}

// ---------------------------------------------------------------------------------------------
// The workers
// ---------------------------------------------------------------------------------------------

enum WorkerCommand {
    /// The process dies (its requests stop where they are), is down a while, and comes back
    /// as a new publisher that first publishes a `worker_reset`.
    Crash,
    /// No new request; answer once every live one has ended.
    Drain(oneshot::Sender<()>),
    /// New requests again.
    Resume,
    /// Publish these events now, in order; answer once handed to the client.
    Publish(Vec<(LeaseEvent, bool)>, oneshot::Sender<()>),
}

/// One scheduled event of a live request.
struct Due {
    at: Instant,
    order: u64,
    event: LeaseEvent,
    dup: bool,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == CmpOrdering::Equal
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    /// Reversed: the earliest is the heap's greatest.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (other.at, other.order).cmp(&(self.at, self.order))
    }
}

struct Worker {
    id: u64,
    bus: Arc<Bus>,
    rng: StdRng,
    settings: Arc<Settings>,
    inc: Incarnation,
    lives: u64,
    heap: BinaryHeap<Due>,
    order: u64,
    requests: u64,
    running: bool,
    next_arrival: Instant,
    drains: Vec<oneshot::Sender<()>>,
    crashes: Arc<AtomicU64>,
}

impl Worker {
    fn new_incarnation(rng: &mut StdRng) -> Incarnation {
        Incarnation {
            publisher_id: rng.random(),
            sequence: 0,
            pending: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A new process: its `worker_reset` first, acknowledged before anything else goes.
    async fn come_up(&mut self) {
        self.lives += 1;
        self.inc = Self::new_incarnation(&mut self.rng);
        let reset = WorkerReset {
            worker_id: self.id,
            dp_rank: None,
            leaving: false,
        };
        self.bus.send(&mut self.inc, reset.into(), false).await;
        Bus::settled(&self.inc.pending, SETTLE_DEADLINE + ACK_TIMEOUT * 2).await;
    }

    fn push(&mut self, at: Instant, event: impl Into<LeaseEvent>, dup: bool) {
        self.order += 1;
        self.heap.push(Due {
            at,
            order: self.order,
            event: event.into(),
            dup,
        });
    }

    fn start_request(&mut self, now: Instant) {
        self.requests += 1;
        let rng = &mut self.rng;
        let request_id = format!("w{}-l{}-r{}", self.id, self.lives, self.requests);
        let dp_rank = rng.random_range(0..self.settings.dp_ranks);
        let prompt = rng.random_range(32..=4096u32);
        let cached = rng
            .random_bool(0.5)
            .then(|| rng.random_range(0..=prompt / 2));
        let expected = rng.random_bool(0.7).then(|| rng.random_range(16..=1024u32));
        let life =
            exponential(rng, MEAN_REQUEST_LIFE).clamp(Duration::from_millis(50), MAX_REQUEST_LIFE);
        let crash = rng.random_bool(CRASH_SHARE);
        let dup_admitted = rng.random_bool(DUPLICATE_SHARE / 2.0);
        let dup_completed = rng.random_bool(DUPLICATE_SHARE / 2.0);
        let late_admission = rng
            .random_bool(self.settings.reorder_share)
            .then(|| uniform(rng, Duration::from_millis(5), self.settings.late_admission));
        let prefill = uniform(rng, Duration::from_millis(20), Duration::from_millis(300));
        let end = now + life;
        let crash_at = crash.then(|| now + life.mul_f64(rng.random::<f64>()));
        let mut progress = Vec::new();
        let mut t = now + prefill;
        let mut output = 1u32;
        let mut stage = ProgressStage::PrefillDone;
        while t < end {
            progress.push((t, stage, output));
            stage = ProgressStage::Decoding;
            output += rng.random_range(1..=64u32);
            t += self.settings.progress_every;
        }
        let outcome = match rng.random_range(0..20) {
            0 => Outcome::Cancelled,
            1 => Outcome::Failed,
            _ => Outcome::Finished,
        };
        let worker_id = self.id;
        self.push(
            now + late_admission.unwrap_or_default(),
            Admitted {
                request_id: request_id.clone(),
                worker_id,
                dp_rank,
                prompt_tokens: prompt,
                expected_output_tokens: expected,
                cached_tokens: cached,
            },
            dup_admitted,
        );
        for (at, stage, output_tokens) in progress {
            if crash_at.is_some_and(|c| at >= c) {
                break;
            }
            self.push(
                at,
                Progressed {
                    request_id: request_id.clone(),
                    worker_id,
                    dp_rank,
                    stage,
                    output_tokens,
                },
                false,
            );
        }
        if crash_at.is_none() {
            self.push(
                end,
                Completed {
                    request_id,
                    worker_id,
                    dp_rank,
                    outcome,
                },
                dup_completed,
            );
        }
    }

    fn arrival_gap(&mut self) -> Duration {
        let per_worker = self.settings.rate / self.settings.workers as f64;
        exponential(&mut self.rng, Duration::from_secs_f64(1.0 / per_worker))
    }

    async fn handle(&mut self, command: WorkerCommand) {
        match command {
            WorkerCommand::Crash => {
                self.crashes.fetch_add(1, Ordering::Relaxed);
                self.heap.clear();
                let down = uniform(
                    &mut self.rng,
                    Duration::from_secs(1),
                    Duration::from_secs(5),
                );
                sleep(down).await;
                // What the dead process had sent settles before the new one speaks, so the
                // reset is stored after every event of the previous life.
                Bus::settled(&self.inc.pending, SETTLE_DEADLINE + ACK_TIMEOUT * 2).await;
                self.come_up().await;
                self.next_arrival = Instant::now() + self.arrival_gap();
            }
            WorkerCommand::Drain(done) => {
                self.running = false;
                self.drains.push(done);
            }
            WorkerCommand::Resume => {
                self.running = true;
                self.next_arrival = Instant::now() + self.arrival_gap();
            }
            WorkerCommand::Publish(events, done) => {
                for (event, dup) in events {
                    self.bus.send(&mut self.inc, event, dup).await;
                }
                let _ = done.send(());
            }
        }
    }

    async fn run(mut self, mut commands: mpsc::Receiver<WorkerCommand>) {
        self.come_up().await;
        self.next_arrival = Instant::now() + self.arrival_gap();
        loop {
            if !self.running && self.heap.is_empty() {
                for done in self.drains.drain(..) {
                    let _ = done.send(());
                }
            }
            let far = Instant::now() + Duration::from_secs(3600);
            let next_event = self.heap.peek().map_or(far, |d| d.at);
            let next_arrival = if self.running { self.next_arrival } else { far };
            let wake = next_event.min(next_arrival);
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.handle(command).await,
                    None => return,
                },
                _ = sleep_until(wake) => {
                    let now = Instant::now();
                    while self.heap.peek().is_some_and(|d| d.at <= now) {
                        let due = self.heap.pop().expect("peeked");
                        self.bus.send(&mut self.inc, due.event, due.dup).await;
                    }
                    if self.running && self.next_arrival <= now {
                        self.start_request(now);
                        self.next_arrival = now + self.arrival_gap();
                    }
                }
            }
        }
    }
}

#[derive(Clone)]
struct Fleet {
    senders: Vec<mpsc::Sender<WorkerCommand>>,
}

impl Fleet {
    async fn drain(&self, limit: Duration) -> Result<(), String> {
        let mut waits = Vec::new();
        for tx in &self.senders {
            let (done, wait) = oneshot::channel();
            tx.send(WorkerCommand::Drain(done))
                .await
                .map_err(|_| "a worker is gone".to_string())?;
            waits.push(wait);
        }
        timeout(limit, futures::future::join_all(waits))
            .await
            .map_err(|_| format!("the workers did not drain within {limit:?}"))?;
        Ok(())
    }

    async fn resume(&self) {
        for tx in &self.senders {
            let _ = tx.send(WorkerCommand::Resume).await;
        }
    }

    /// Worker `w` (1-based) publishes `events` now.
    async fn publish(&self, w: u64, events: Vec<(LeaseEvent, bool)>) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.senders[(w - 1) as usize]
            .send(WorkerCommand::Publish(events, done))
            .await
            .map_err(|_| "a worker is gone".to_string())?;
        timeout(Duration::from_secs(120), wait)
            .await
            .map_err(|_| "a worker did not publish within 120 s".to_string())?
            .map_err(|_| "a worker is gone".to_string())
    }
}

// ---------------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum FaultKind {
    RouterKill,
    NodeKill,
    Partition,
    Freeze,
}

impl FaultKind {
    const ALL: [FaultKind; 4] = [
        FaultKind::RouterKill,
        FaultKind::NodeKill,
        FaultKind::Partition,
        FaultKind::Freeze,
    ];

    fn label(self) -> &'static str {
        match self {
            FaultKind::RouterKill => "router_kill",
            FaultKind::NodeKill => "node_kill",
            FaultKind::Partition => "partition",
            FaultKind::Freeze => "freeze",
        }
    }
}

#[derive(Default)]
struct FaultLog {
    injected: BTreeMap<FaultKind, u64>,
    seconds: BTreeMap<FaultKind, f64>,
    skipped: u64,
    errors: Vec<String>,
    recovery: Vec<f64>,
    /// Seconds from a partition's start to the replica's /healthz saying 503.
    partitions_seen: Vec<f64>,
}

struct Faults {
    clock: Arc<Clock>,
    replicas: Vec<ReplicaHandle>,
    cluster: Arc<Cluster>,
    log: Arc<parking_lot::Mutex<FaultLog>>,
}

impl Faults {
    /// Starts one fault of `kind` if a target is free; its task holds the target until it
    /// has healed.
    fn inject(&self, kind: FaultKind, rng: &mut StdRng, tasks: &mut JoinSet<()>, n: u64) {
        let clock = self.clock.clone();
        let log = self.log.clone();
        match kind {
            FaultKind::NodeKill => {
                let Ok(guard) = self.cluster.node_fault.clone().try_lock_owned() else {
                    clock.line(format!("fault {n}: node_kill skipped (a node is down)"));
                    log.lock().skipped += 1;
                    return;
                };
                let node =
                    self.cluster.nodes[rng.random_range(0..self.cluster.nodes.len())].clone();
                let down = uniform(rng, Duration::from_secs(2), Duration::from_secs(15));
                let cluster = self.cluster.clone();
                let replicas = self.replicas.clone();
                tasks.spawn(async move {
                    clock.line(format!(
                        "fault {n}: node_kill n{} for {:.1}s",
                        node.index,
                        down.as_secs_f64()
                    ));
                    node.server.lock().await.kill().await;
                    node.up.store(false, Ordering::Release);
                    sleep(down).await;
                    let restarted = node.server.lock().await.restart().await;
                    node.up.store(true, Ordering::Release);
                    let healed = Instant::now();
                    let mut log_now = Vec::new();
                    if let Err(e) = restarted {
                        log_now.push(format!(
                            "fault {n}: node n{} did not restart: {e:?}",
                            node.index
                        ));
                    } else if let Err(e) = cluster.wait_formed(Duration::from_secs(90)).await {
                        log_now.push(format!("fault {n}: after node n{}: {e}", node.index));
                    }
                    // Every replica back on its feet (its client may have been on that node).
                    for r in &replicas {
                        if let Ok(_g) = r.state.try_lock() {
                            if let Err(e) = r.wait_ready(READY_TIMEOUT).await {
                                log_now.push(format!("fault {n}: after node n{}: {e}", node.index));
                            }
                        }
                    }
                    let mut log = log.lock();
                    *log.injected.entry(kind).or_default() += 1;
                    *log.seconds.entry(kind).or_default() += down.as_secs_f64();
                    log.recovery.push(healed.elapsed().as_secs_f64());
                    log.errors.extend(log_now);
                    drop(guard);
                });
            }
            FaultKind::RouterKill | FaultKind::Partition | FaultKind::Freeze => {
                let free: Vec<(ReplicaHandle, OwnedMutexGuard<Replica>)> = self
                    .replicas
                    .iter()
                    .filter(|r| r.killable || kind != FaultKind::RouterKill)
                    .filter_map(|r| {
                        r.state
                            .clone()
                            .try_lock_owned()
                            .ok()
                            .map(|g| (r.clone(), g))
                    })
                    .collect();
                if free.is_empty() {
                    clock.line(format!(
                        "fault {n}: {} skipped (every replica has a fault)",
                        kind.label()
                    ));
                    log.lock().skipped += 1;
                    return;
                }
                let pick = rng.random_range(0..free.len());
                let (handle, mut guard) = free.into_iter().nth(pick).expect("in range");
                let length = match kind {
                    FaultKind::RouterKill => {
                        uniform(rng, Duration::from_secs(1), Duration::from_secs(8))
                    }
                    FaultKind::Partition => {
                        uniform(rng, Duration::from_secs(8), Duration::from_secs(30))
                    }
                    _ => uniform(rng, Duration::from_secs(2), Duration::from_secs(25)),
                };
                tasks.spawn(async move {
                    clock.line(format!(
                        "fault {n}: {} {} for {:.1}s",
                        kind.label(),
                        handle.name,
                        length.as_secs_f64()
                    ));
                    let mut error = None;
                    match kind {
                        FaultKind::RouterKill => {
                            guard.kill().await;
                            sleep(length).await;
                            if let Err(e) = guard.start() {
                                error = Some(format!("fault {n}: restarting {}: {e}", handle.name));
                            }
                        }
                        FaultKind::Partition => {
                            for p in &guard.proxies {
                                p.set_partitioned(true);
                            }
                            // The replica must see it by its own pings (three of 2 s) and
                            // say so on /healthz.
                            let start = Instant::now();
                            let end = start + length;
                            let mut seen = None;
                            while Instant::now() < end {
                                if seen.is_none()
                                    && matches!(
                                        http_get(handle.http_port, "/healthz").await,
                                        Ok((503, _))
                                    )
                                {
                                    seen = Some(start.elapsed().as_secs_f64());
                                }
                                let left = end.saturating_duration_since(Instant::now());
                                sleep(Duration::from_millis(500).min(left)).await;
                            }
                            for p in &guard.proxies {
                                p.set_partitioned(false);
                            }
                            match seen {
                                Some(after) => {
                                    clock.line(format!(
                                        "fault {n}: {} saw its partition after {after:.1}s",
                                        handle.name
                                    ));
                                    log.lock().partitions_seen.push(after);
                                }
                                None => {
                                    error = Some(format!(
                                        "fault {n}: {} never turned /healthz 503 in a {:.1}s silent partition",
                                        handle.name,
                                        length.as_secs_f64()
                                    ));
                                }
                            }
                        }
                        _ => {
                            guard.signal(libc::SIGSTOP);
                            sleep(length).await;
                            guard.signal(libc::SIGCONT);
                        }
                    }
                    let healed = Instant::now();
                    if error.is_none() {
                        if let Err(e) = handle.wait_ready(READY_TIMEOUT).await {
                            error = Some(format!("fault {n}: after {}: {e}", kind.label()));
                        }
                    }
                    if let Some(status) = guard.exited() {
                        error = Some(format!(
                            "fault {n}: {} exited on its own after {}: {status}",
                            handle.name,
                            kind.label()
                        ));
                    }
                    let mut log = log.lock();
                    *log.injected.entry(kind).or_default() += 1;
                    *log.seconds.entry(kind).or_default() += length.as_secs_f64();
                    log.recovery.push(healed.elapsed().as_secs_f64());
                    log.errors.extend(error);
                });
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// At rest
// ---------------------------------------------------------------------------------------------

type LeaseKey = (String, u64, u32);
type WorkerRows = BTreeMap<(u64, u32), [u64; 6]>;

fn rows_from_json(workers: &Value) -> WorkerRows {
    let mut rows = BTreeMap::new();
    for w in workers["workers"].as_array().into_iter().flatten() {
        let n = |k: &str| w[k].as_u64().unwrap_or(u64::MAX);
        rows.insert(
            (n("worker_id"), n("dp_rank") as u32),
            [
                n("active_bookings"),
                n("prompt_tokens"),
                n("expected_output_tokens"),
                n("prefill_tokens"),
                n("kv_tokens"),
                n("remaining_output_tokens"),
            ],
        );
    }
    rows
}

fn leases_from_json(leases: &Value) -> Result<BTreeSet<LeaseKey>, String> {
    if leases["truncated"].as_bool() != Some(false) {
        return Err("the lease listing is truncated".into());
    }
    Ok(leases["leases"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|l| {
            (
                l["request_id"].as_str().unwrap_or_default().to_string(),
                l["worker_id"].as_u64().unwrap_or(u64::MAX),
                l["dp_rank"].as_u64().unwrap_or(u64::MAX) as u32,
            )
        })
        .collect())
}

async fn reference_state(router: &Router) -> Result<(BTreeSet<LeaseKey>, WorkerRows), String> {
    let leases = router
        .manager()
        .leases(LEASE_LIMIT)
        .into_iter()
        .map(|r| {
            (
                r.booking.request_id.as_str().to_string(),
                r.booking.worker.worker_id.0,
                r.booking.worker.dp_rank.0,
            )
        })
        .collect();
    let workers = router
        .scheduler()
        .workers()
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|s| {
            let l = s.load;
            (
                (s.worker.worker_id.0, s.worker.dp_rank.0),
                [
                    l.active_bookings,
                    l.prompt_tokens,
                    l.expected_output_tokens,
                    l.prefill_tokens,
                    l.kv_tokens,
                    l.remaining_output_tokens,
                ],
            )
        })
        .collect();
    Ok((leases, workers))
}

async fn replica_state(r: &ReplicaHandle) -> Result<(BTreeSet<LeaseKey>, WorkerRows), String> {
    let leases = http_json(
        r.http_port,
        &format!("/v1/deployments/{DEPLOYMENT}/leases?limit={LEASE_LIMIT}"),
    )
    .await?;
    let workers = http_json(
        r.http_port,
        &format!("/v1/deployments/{DEPLOYMENT}/workers"),
    )
    .await?;
    Ok((leases_from_json(&leases)?, rows_from_json(&workers)))
}

/// What differs between a replica's state and its reference's, empty when identical.
fn differences(
    got: &(BTreeSet<LeaseKey>, WorkerRows),
    want: &(BTreeSet<LeaseKey>, WorkerRows),
) -> Vec<String> {
    let mut out = Vec::new();
    let missing: Vec<&LeaseKey> = want.0.difference(&got.0).collect();
    let extra: Vec<&LeaseKey> = got.0.difference(&want.0).collect();
    if !missing.is_empty() {
        out.push(format!(
            "{} leases missing, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        ));
    }
    if !extra.is_empty() {
        out.push(format!(
            "{} leases extra, e.g. {:?}",
            extra.len(),
            &extra[..extra.len().min(5)]
        ));
    }
    let keys: BTreeSet<&(u64, u32)> = got.1.keys().chain(want.1.keys()).collect();
    let mut rows = 0;
    for key in keys {
        let (g, w) = (got.1.get(key), want.1.get(key));
        if g != w {
            rows += 1;
            if rows <= 5 {
                out.push(format!(
                    "worker {}/{}: load {g:?}, reference {w:?} (bookings, prompt, expected, prefill, kv, remaining)",
                    key.0, key.1
                ));
            }
        }
    }
    if rows > 5 {
        out.push(format!("{rows} worker rows differ in all"));
    }
    out
}

#[derive(Clone, Debug, Default)]
struct ReplicaAtRest {
    name: &'static str,
    leases: usize,
    workers: usize,
    identical: bool,
    received: u64,
    accounted: u64,
    held: u64,
    rss: u64,
    threads: u64,
    live_tasks: u64,
    tasks_ended: u64,
    gaps: u64,
    drops: String,
    truncated: u64,
    fallbacks: u64,
    snapshots: u64,
    snapshot_failures: u64,
    reconnects: u64,
    catchup_s: f64,
    replayed: u64,
    starts: u32,
}

#[derive(Default)]
struct RestReport {
    label: &'static str,
    ok: bool,
    problems: Vec<String>,
    replicas: Vec<ReplicaAtRest>,
    reference_durable_leases: usize,
    reference_core_leases: usize,
    cohort: usize,
    identity_ok: bool,
    /// Every replica's state equal to its reference's, and the references what the at-rest
    /// definition says (reference-core: the cohort alone).
    identical: bool,
    consumers: Option<u64>,
    /// The stream state's `consumer_count`.
    consumer_count: Option<u64>,
    /// Seconds until the stream's consumers were one per durable replica.
    consumers_wait: f64,
}

struct Soak {
    settings: Arc<Settings>,
    clock: Arc<Clock>,
    cluster: Arc<Cluster>,
    replicas: Vec<ReplicaHandle>,
    fleet: Fleet,
    bus: Arc<Bus>,
    ref_durable: Router,
    ref_core: Router,
    ref_durable_stats: Arc<IngressStats>,
    ref_core_stats: Arc<IngressStats>,
    rests: u32,
}

impl Soak {
    /// Every step of the rest procedure (module docs); fills `report` as it goes.
    async fn rest(&mut self, label: &'static str) -> RestReport {
        self.rests += 1;
        let mut report = RestReport {
            label,
            ..RestReport::default()
        };
        if let Err(e) = self.rest_steps(&mut report).await {
            report.problems.push(e);
        }
        report.ok = report.problems.is_empty();
        report
    }

    async fn rest_steps(&mut self, report: &mut RestReport) -> Result<(), String> {
        let clock = self.clock.clone();
        clock.line(format!("rest {}: drain", report.label));
        // 1. Healed: every replica running, every node up.
        for r in &self.replicas {
            let mut state = r.state.lock().await;
            if let Some(status) = state.exited() {
                report
                    .problems
                    .push(format!("{} had exited on its own: {status}", r.name));
                state.kill().await;
                state.start()?;
            }
        }
        for node in &self.cluster.nodes {
            if !node.up.load(Ordering::Acquire) {
                return Err(format!("node n{} is down at rest", node.index));
            }
        }
        self.cluster.wait_formed(Duration::from_secs(60)).await?;
        // 2. Drain, settle, ready.
        self.fleet
            .drain(MAX_REQUEST_LIFE + Duration::from_secs(120))
            .await?;
        if !Bus::settled(&self.bus.pending, SETTLE_DEADLINE * 2).await {
            return Err("publishes still unacknowledged after 120 s".into());
        }
        for r in &self.replicas {
            r.wait_ready(READY_TIMEOUT).await?;
        }
        // 3. The barrier.
        let rest = self.rests;
        let mut barrier = Vec::new();
        let mut seen = false;
        for k in 0..30 {
            let request_id = format!("barrier{rest}-{k}");
            barrier.push(request_id.clone());
            let admitted = Admitted {
                request_id: request_id.clone(),
                worker_id: 1,
                dp_rank: 0,
                prompt_tokens: 1,
                expected_output_tokens: None,
                cached_tokens: None,
            };
            self.fleet
                .publish(1, vec![(admitted.into(), false)])
                .await?;
            Bus::settled(&self.bus.pending, SETTLE_DEADLINE).await;
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline && !seen {
                let mut all = true;
                for r in &self.replicas {
                    let has = replica_state(r)
                        .await
                        .is_ok_and(|(leases, _)| leases.contains(&(request_id.clone(), 1, 0)));
                    all &= has;
                }
                seen = all;
                if !seen {
                    sleep(Duration::from_millis(200)).await;
                }
            }
            if seen {
                clock.line(format!(
                    "rest {}: barrier seen by every replica after {} tries",
                    report.label,
                    k + 1
                ));
                break;
            }
        }
        if !seen {
            return Err("no barrier lease reached every replica in 30 tries".into());
        }
        let completions = barrier
            .iter()
            .map(|request_id| {
                let completed = Completed {
                    request_id: request_id.clone(),
                    worker_id: 1,
                    dp_rank: 0,
                    outcome: Outcome::Finished,
                };
                (completed.into(), false)
            })
            .collect();
        self.fleet.publish(1, completions).await?;
        // 4. Quiet: every orphan expires in core mode.
        let quiet = self.settings.core_scan.mul_f64(2.5) + Duration::from_secs(3);
        clock.line(format!(
            "rest {}: quiet {:.0}s (orphans expire in core mode)",
            report.label,
            quiet.as_secs_f64()
        ));
        sleep(quiet).await;
        if !Bus::settled(&self.bus.pending, SETTLE_DEADLINE).await {
            return Err("barrier publishes unacknowledged".into());
        }
        // 5. The cohort.
        let cohort = self.cohort(rest);
        report.cohort = cohort.len();
        let mut by_worker: BTreeMap<u64, Vec<(LeaseEvent, bool)>> = BTreeMap::new();
        let mut cohort_ids = BTreeSet::new();
        for (key, events) in cohort {
            cohort_ids.insert(key.clone());
            by_worker.entry(key.1).or_default().extend(events);
        }
        let cohort_at = Instant::now();
        for (w, events) in by_worker {
            self.fleet.publish(w, events).await?;
        }
        if !Bus::settled(&self.bus.pending, SETTLE_DEADLINE).await {
            return Err("cohort publishes unacknowledged".into());
        }
        // 6. Compare, within one core scan interval of the cohort.
        let compare_by = cohort_at + self.settings.core_scan.mul_f64(0.8);
        let want_durable = reference_state(&self.ref_durable).await?;
        let want_core = reference_state(&self.ref_core).await?;
        report.reference_durable_leases = want_durable.0.len();
        report.reference_core_leases = want_core.0.len();
        let mut definition_ok = true;
        if want_core.0 != cohort_ids {
            definition_ok = false;
            report.problems.push(format!(
                "reference-core holds {} leases, the cohort is {}: the quiet wait was too short",
                want_core.0.len(),
                cohort_ids.len()
            ));
        }
        if !cohort_ids.is_subset(&want_durable.0) {
            definition_ok = false;
            report
                .problems
                .push("reference-durable lacks part of the cohort".into());
        }
        let mut last: Vec<Result<(BTreeSet<LeaseKey>, WorkerRows), String>>;
        loop {
            last = Vec::new();
            for r in &self.replicas {
                last.push(replica_state(r).await);
            }
            let all_equal = self.replicas.iter().zip(&last).all(|(r, got)| {
                let want = if r.durable { &want_durable } else { &want_core };
                got.as_ref()
                    .is_ok_and(|got| differences(got, want).is_empty())
            });
            if all_equal || Instant::now() >= compare_by {
                break;
            }
            sleep(Duration::from_millis(250)).await;
        }
        // Nothing is in flight now: the identity is exact.
        let mut identity_ok = true;
        for (r, got) in self.replicas.iter().zip(last) {
            let want = if r.durable { &want_durable } else { &want_core };
            let mut row = ReplicaAtRest {
                name: r.name,
                ..ReplicaAtRest::default()
            };
            match got {
                Ok(got) => {
                    let diffs = differences(&got, want);
                    row.identical = diffs.is_empty();
                    row.leases = got.0.len();
                    row.workers = got.1.len();
                    for d in diffs {
                        report.problems.push(format!("{}: {d}", r.name));
                    }
                }
                Err(e) => report.problems.push(format!("{}: {e}", r.name)),
            }
            let metrics = r.metrics().await?;
            row.received = metric_sum(&metrics, "lease_router_events_received_total");
            row.held = metric_sum(&metrics, "lease_router_events_held");
            row.accounted = metric_sum(&metrics, "lease_router_events_applied_total")
                + metric_sum(&metrics, "lease_router_events_dropped_total")
                + row.held;
            if row.received != row.accounted {
                identity_ok = false;
                report.problems.push(format!(
                    "{}: received {} != applied + dropped + held {}",
                    r.name, row.received, row.accounted
                ));
            }
            row.live_tasks = metric_plain(&metrics, "lease_router_live_tasks");
            row.tasks_ended = metric_sum(&metrics, "lease_router_router_tasks_ended");
            if row.tasks_ended > 0 {
                report.problems.push(format!(
                    "{}: {} router tasks ended",
                    r.name, row.tasks_ended
                ));
            }
            row.gaps = metric_sum(&metrics, "lease_router_sequence_gaps_total");
            row.drops = nonzero_drops(&metrics);
            row.truncated = metric_sum(&metrics, "lease_router_stream_truncated_events_total");
            row.fallbacks = metric_sum(&metrics, "lease_router_catchup_snapshot_fallbacks_total");
            row.snapshots = metric_sum(&metrics, "lease_router_snapshots_written_total");
            row.snapshot_failures =
                metric_sum(&metrics, "lease_router_snapshot_write_failures_total");
            row.reconnects = metric_plain(&metrics, "lease_router_nats_reconnects_total");
            row.catchup_s = metric_values(
                &metrics,
                "lease_router_catchup_seconds",
                "deployment=\"soak\"",
            )
            .sum::<f64>()
                + 0.0;
            row.replayed = metric_sum(&metrics, "lease_router_catchup_replayed_events");
            if let Some((rss, threads)) = proc_status(r.pid.load(Ordering::Acquire)) {
                row.rss = rss;
                row.threads = threads;
            }
            row.starts = r.state.lock().await.starts;
            report.replicas.push(row);
        }
        for (name, stats) in [
            ("reference-durable", &self.ref_durable_stats),
            ("reference-core", &self.ref_core_stats),
        ] {
            let s = stats.snapshot();
            if s.accounted() != s.received {
                identity_ok = false;
                report.problems.push(format!(
                    "{name}: received {} != accounted {}",
                    s.received,
                    s.accounted()
                ));
            }
        }
        report.identity_ok = identity_ok;
        report.identical = definition_ok
            && report.replicas.len() == self.replicas.len()
            && report.replicas.iter().all(|r| r.identical);
        clock.line(format!(
            "rest {}: compared {:.1}s after the cohort",
            report.label,
            cohort_at.elapsed().as_secs_f64()
        ));
        // The stream's consumers come down to one per durable replica: those of killed or
        // reconnected replicas go once idle for the client's inactive threshold (30 s).
        let durables = self.replicas.iter().filter(|r| r.durable).count() as u64;
        let since = Instant::now();
        loop {
            (report.consumers, report.consumer_count) = self.consumers().await;
            if report.consumers == Some(durables) || since.elapsed() >= Duration::from_secs(120) {
                break;
            }
            sleep(Duration::from_secs(1)).await;
        }
        report.consumers_wait = since.elapsed().as_secs_f64();
        if report.consumers != Some(durables) {
            report.problems.push(format!(
                "the stream lists {:?} consumers 120 s on (its state counts {:?}), {durables} durable replicas: {}",
                report.consumers,
                report.consumer_count,
                self.consumer_details().await
            ));
        }
        // The cohort ends: traffic can resume on an empty slate of cohort leases.
        let mut ends: BTreeMap<u64, Vec<(LeaseEvent, bool)>> = BTreeMap::new();
        for (request_id, worker_id, dp_rank) in cohort_ids {
            let completed = Completed {
                request_id,
                worker_id,
                dp_rank,
                outcome: Outcome::Finished,
            };
            ends.entry(worker_id)
                .or_default()
                .push((completed.into(), false));
        }
        for (w, events) in ends {
            self.fleet.publish(w, events).await?;
        }
        Ok(())
    }

    /// The cohort of a rest: per worker rank, leases in several phases, with their events.
    fn cohort(&self, rest: u32) -> Vec<(LeaseKey, Vec<(LeaseEvent, bool)>)> {
        let mut rng =
            StdRng::seed_from_u64(self.settings.seed ^ (0xC0_u64 << 32) ^ u64::from(rest));
        let mut out = Vec::new();
        for w in 1..=self.settings.workers {
            for d in 0..self.settings.dp_ranks {
                for i in 0..self.settings.cohort {
                    let request_id = format!("rest{rest}-w{w}-d{d}-c{i}");
                    let prompt = rng.random_range(32..=4096u32);
                    let admitted = Admitted {
                        request_id: request_id.clone(),
                        worker_id: w,
                        dp_rank: d,
                        prompt_tokens: prompt,
                        expected_output_tokens: rng
                            .random_bool(0.7)
                            .then(|| rng.random_range(16..=1024u32)),
                        cached_tokens: rng
                            .random_bool(0.5)
                            .then(|| rng.random_range(0..=prompt / 2)),
                    };
                    let progressed = |stage, output_tokens| -> LeaseEvent {
                        Progressed {
                            request_id: request_id.clone(),
                            worker_id: w,
                            dp_rank: d,
                            stage,
                            output_tokens,
                        }
                        .into()
                    };
                    let dup = rng.random_bool(0.2);
                    let events = match i % 4 {
                        // Admitted only: its prefill is waiting.
                        0 => vec![(admitted.into(), dup)],
                        // Prefill done.
                        1 => vec![
                            (admitted.into(), dup),
                            (progressed(ProgressStage::PrefillDone, 1), false),
                        ],
                        // Decoding, with a late lower count that changes nothing.
                        2 => {
                            let high = rng.random_range(2..=500u32);
                            vec![
                                (admitted.into(), dup),
                                (progressed(ProgressStage::PrefillDone, 1), false),
                                (progressed(ProgressStage::Decoding, high), false),
                                (progressed(ProgressStage::Decoding, high / 2), false),
                            ]
                        }
                        // Progress before its admission: held, then applied.
                        _ => vec![
                            (
                                progressed(ProgressStage::Decoding, rng.random_range(2..=500u32)),
                                false,
                            ),
                            (admitted.into(), dup),
                        ],
                    };
                    out.push(((request_id, w, d), events));
                }
            }
        }
        out
    }

    /// Consumers of the deployment's stream as the consumer list names them (the durable
    /// replicas' ordered consumers; a killed replica's is deleted by the server once it has
    /// been idle), and as the stream's state counts them.
    async fn consumers(&self) -> (Option<u64>, Option<u64>) {
        use futures::StreamExt;
        let name = lease_router::stream_name(&self.bus.subjects);
        let Ok(Ok(mut stream)) = timeout(HTTP_TIMEOUT, self.bus.js.get_stream(name)).await else {
            return (None, None);
        };
        // The consumers the list describes (their info read): on 2.9.10 in a cluster the
        // names alone can keep a deleted consumer's for minutes after node restarts, and the
        // state's count can lag either way; consumer_details prints all three.
        let listed = timeout(HTTP_TIMEOUT, stream.consumers().collect::<Vec<_>>())
            .await
            .ok()
            .and_then(|infos| infos.into_iter().collect::<Result<Vec<_>, _>>().ok())
            .map(|infos| infos.len() as u64);
        let counted = match timeout(HTTP_TIMEOUT, stream.info()).await {
            Ok(Ok(info)) => Some(info.state.consumer_count as u64),
            _ => None,
        };
        (listed, counted)
    }

    /// Each consumer of the deployment's stream: name, node, creation, last delivery.
    async fn consumer_details(&self) -> String {
        use futures::StreamExt;
        let name = lease_router::stream_name(&self.bus.subjects);
        let Ok(Ok(stream)) = timeout(HTTP_TIMEOUT, self.bus.js.get_stream(name)).await else {
            return "stream info did not answer".into();
        };
        let names = timeout(HTTP_TIMEOUT, stream.consumer_names().collect::<Vec<_>>())
            .await
            .map_or_else(
                |_| "names did not answer".to_owned(),
                |names| {
                    let names: Vec<String> = names.into_iter().filter_map(Result::ok).collect();
                    format!("names {names:?}")
                },
            );
        let list = timeout(HTTP_TIMEOUT, stream.consumers().collect::<Vec<_>>()).await;
        let Ok(list) = list else {
            return format!("{names}; consumer list did not answer");
        };
        let described = list
            .into_iter()
            .map(|c| match c {
                Ok(c) => format!(
                    "{} on {:?}: created {}, delivered up to {}, last active {:?}, {} pending, {} pulls waiting",
                    c.name,
                    c.cluster.and_then(|k| k.leader),
                    c.created,
                    c.delivered.stream_sequence,
                    c.delivered.last_active.map(|t| t.to_string()),
                    c.num_pending,
                    c.num_waiting
                ),
                Err(e) => format!("(unreadable: {e})"),
            })
            .collect::<Vec<_>>()
            .join("; ");
        format!("{names}; {described}")
    }

    /// RSS, threads and live tasks now, for the timeline and the maxima; and whether the
    /// deployment has a newer snapshot.
    async fn sample(&self, samples: &mut Samples) -> String {
        let mut parts = Vec::new();
        let now = Instant::now();
        for r in &self.replicas {
            let pid = r.pid.load(Ordering::Acquire);
            let (rss, threads) = proc_status(pid).unwrap_or((0, 0));
            let max = samples.max_rss.entry(r.name).or_default();
            *max = (*max).max(rss);
            let tasks = match r.metrics().await {
                Ok(m) => {
                    let sequence = metric_sum(&m, "lease_router_snapshot_sequence");
                    if sequence > samples.snapshot_sequence {
                        samples.snapshot_sequence = sequence;
                        let gap = now - samples.snapshot_at;
                        samples.snapshot_gap_max = samples.snapshot_gap_max.max(gap);
                        samples.snapshot_at = now;
                    }
                    metric_plain(&m, "lease_router_live_tasks").to_string()
                }
                Err(_) => "?".into(),
            };
            parts.push(format!(
                "{} rss={:.1}MiB threads={threads} tasks={tasks}",
                r.name,
                mib(rss)
            ));
        }
        parts.join(" | ")
    }
}

/// What the samples during the faults keep.
struct Samples {
    max_rss: BTreeMap<&'static str, u64>,
    /// The newest snapshot's stream sequence any replica reported, and when it first did.
    snapshot_sequence: u64,
    snapshot_at: Instant,
    /// The longest the deployment went without a newer snapshot (to within a sample).
    snapshot_gap_max: Duration,
}

fn print_rest(report: &RestReport) {
    println!(
        "rest {}: {}{} (cohort {} leases; reference-durable {} leases, reference-core {}; stream consumers {} after {:.0}s, counted {})",
        report.label,
        if report.identical { "identical" } else { "DIFFERENT" },
        if report.ok { "" } else { ", with problems" },
        report.cohort,
        report.reference_durable_leases,
        report.reference_core_leases,
        report
            .consumers
            .map_or_else(|| "?".into(), |c| c.to_string()),
        report.consumers_wait,
        report
            .consumer_count
            .map_or_else(|| "?".into(), |c| c.to_string())
    );
    println!(
        "  {:<10} {:>6} {:>7} {:>9} {:>10} {:>10} {:>6} {:>8} {:>7} {:>6} {:>5} {:>6} {:>5} {:>6} {:>6} {:>5} {:>13}  drops",
        "replica", "starts", "leases", "identical", "received", "accounted", "held", "rss_MiB",
        "threads", "tasks", "gaps", "trunc", "fallb", "snaps", "snapfl", "recon", "catchup"
    );
    for r in &report.replicas {
        println!(
            "  {:<10} {:>6} {:>7} {:>9} {:>10} {:>10} {:>6} {:>8.1} {:>7} {:>6} {:>5} {:>6} {:>5} {:>6} {:>6} {:>5} {:>13}  {}",
            r.name,
            r.starts,
            r.leases,
            r.identical,
            r.received,
            r.accounted,
            r.held,
            mib(r.rss),
            r.threads,
            r.live_tasks,
            r.gaps,
            r.truncated,
            r.fallbacks,
            r.snapshots,
            r.snapshot_failures,
            r.reconnects,
            format!("{}/{:.2}s", r.replayed, r.catchup_s),
            r.drops
        );
    }
    for p in &report.problems {
        println!("  problem: {p}");
    }
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

fn main() {
    // `cargo bench` passes `--bench`; nothing else is read from the command line.
    let settings = Settings::from_env();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = runtime.block_on(run(settings));
    // Every child (replicas, nodes) is killed as its handle drops with the runtime's tasks.
    runtime.shutdown_timeout(Duration::from_secs(10));
    std::process::exit(code);
}

async fn run(settings: Settings) -> i32 {
    println!("soak: {}", machine());
    println!(
        "soak: SOAK_MINUTES={} SOAK_SEED={} SOAK_FAULT_EVERY={:?} SOAK_WARMUP={:?} SOAK_RATE={} \
         SOAK_WORKERS={} SOAK_DP_RANKS={} SOAK_WORKER_CRASH_EVERY={:?} SOAK_PROGRESS_EVERY={:?} \
         SOAK_CORE_SCAN={:?} SOAK_COHORT={} SOAK_MAX_RSS_GROWTH={}",
        settings.minutes,
        settings.seed,
        settings.fault_every,
        settings.warmup,
        settings.rate,
        settings.workers,
        settings.dp_ranks,
        settings.worker_crash_every,
        settings.progress_every,
        settings.core_scan,
        settings.cohort,
        settings.max_rss_growth
    );
    let (log_dir, temp) = match &settings.log_dir {
        Some(dir) => {
            if let Err(e) = fs::create_dir_all(dir) {
                die(&format!("SOAK_LOG_DIR {}: {e}", dir.display()));
            }
            (dir.clone(), None)
        }
        None => {
            let temp = tempfile::Builder::new()
                .prefix("lease-router-soak-")
                .tempdir()
                .expect("a temporary directory");
            (temp.path().to_path_buf(), Some(temp))
        }
    };
    let result = soak(settings, &log_dir).await;
    let pass = match result {
        Ok(pass) => pass,
        Err(e) => {
            println!("soak: FAILED: {e}");
            println!("soak_result=error");
            false
        }
    };
    if pass {
        drop(temp);
        0
    } else {
        if let Some(temp) = temp {
            let kept = temp.keep();
            println!("soak: logs kept in {}", kept.display());
        } else {
            println!("soak: logs in {}", log_dir.display());
        }
        1
    }
}

async fn soak(settings: Settings, log_dir: &Path) -> Result<bool, String> {
    let settings = Arc::new(settings);
    let clock = Arc::new(Clock(Instant::now()));
    let mut rng = StdRng::seed_from_u64(settings.seed);

    // The cluster; its node logs are copied beside the replicas' at the end, however it
    // ends (the guard drops before the cluster, which removes their directories).
    let cluster = Arc::new(Cluster::start().await?);
    let mut copies = Vec::new();
    for node in &cluster.nodes {
        let path = node.server.lock().await.log_path().to_path_buf();
        copies.push((path, log_dir.join(format!("nats-n{}.log", node.index))));
    }
    let _nats_logs = CopyOnDrop(copies);
    clock.line(format!("cluster formed: {}", cluster.urls().join(",")));

    // The replicas, each behind three proxies of its own.
    let http_ports = pick_free_ports(3).map_err(|e| e.to_string())?;
    let specs: [(&'static str, bool); 3] =
        [("durable-a", true), ("durable-b", true), ("core", false)];
    let mut replicas = Vec::new();
    for (i, (name, durable)) in specs.into_iter().enumerate() {
        let mut proxies = Vec::new();
        for node in &cluster.nodes {
            let upstream = SocketAddr::from(([127, 0, 0, 1], node.client_port));
            proxies.push(TcpProxy::start(upstream).await.map_err(|e| e.to_string())?);
        }
        let urls: Vec<String> = proxies.iter().map(TcpProxy::url).collect();
        let mut args: Vec<String> = [
            "serve",
            "--deployment",
            DEPLOYMENT,
            "--http-addr",
            &format!("127.0.0.1:{}", http_ports[i]),
            "--nats-url",
            &urls.join(","),
            "--nats-ping-interval",
            "2s",
            "--connect-deadline",
            "120s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if durable {
            args.extend(
                [
                    "--durable",
                    "--stream-replicas",
                    "3",
                    "--snapshot-interval",
                    "20s",
                    "--snapshot-keep",
                    "6",
                    "--lease-scan-interval",
                    DURABLE_SCAN,
                ]
                .map(String::from),
            );
        } else {
            args.extend([
                "--lease-scan-interval".to_string(),
                format!("{}ms", settings.core_scan.as_millis()),
            ]);
        }
        let pid = Arc::new(AtomicU32::new(0));
        let replica = Replica {
            name,
            args,
            log_path: log_dir.join(format!("{name}.log")),
            proxies,
            child: None,
            pid: pid.clone(),
            starts: 0,
        };
        replicas.push(ReplicaHandle {
            name,
            durable,
            killable: i != 0,
            http_port: http_ports[i],
            pid,
            state: Arc::new(AsyncMutex::new(replica)),
        });
    }
    // The first durable replica creates the stream; then the others.
    for (i, r) in replicas.iter().enumerate() {
        r.state.lock().await.start()?;
        if i == 0 {
            let took = r.wait_ready(READY_TIMEOUT).await?;
            clock.line(format!("{} ready in {:.1}s", r.name, took.as_secs_f64()));
        }
    }
    for r in &replicas[1..] {
        let took = r.wait_ready(READY_TIMEOUT).await?;
        clock.line(format!("{} ready in {:.1}s", r.name, took.as_secs_f64()));
    }

    // The references.
    let subjects =
        Subjects::with_default_prefix(DeploymentName::new(DEPLOYMENT).expect("a valid name"));
    let ref_durable = Router::start(
        RouterConfig::new(DEPLOYMENT).with_scan_interval(Duration::from_secs(DURABLE_SCAN_SECS)),
        NoIngress,
    )
    .await
    .map_err(|e| e.to_string())?;
    let ref_core = Router::start(
        RouterConfig::new(DEPLOYMENT).with_scan_interval(settings.core_scan),
        NoIngress,
    )
    .await
    .map_err(|e| e.to_string())?;
    let ref_durable_stats = Arc::new(IngressStats::new());
    let ref_core_stats = Arc::new(IngressStats::new());
    let references = References {
        durable: EventApplier::new(
            subjects.clone(),
            ref_durable.manager().downgrade(),
            ref_durable_stats.clone(),
            ApplyConfig {
                drop_behind_window: false,
                ..ApplyConfig::default()
            },
        ),
        core: EventApplier::new(
            subjects.clone(),
            ref_core.manager().downgrade(),
            ref_core_stats.clone(),
            ApplyConfig::default(),
        ),
    };

    // The workers, on a connection of their own straight to the three nodes.
    let connection = connect(
        &NatsConnectConfig::new(cluster.urls()).with_connect_deadline(Duration::from_secs(30)),
    )
    .await
    .map_err(|e| e.to_string())?;
    let bus = Arc::new(Bus {
        js: jetstream::new(connection.client().clone()),
        subjects,
        refs: parking_lot::Mutex::new(references),
        pending: AtomicU64::new(0),
        events: AtomicU64::new(0),
        messages: AtomicU64::new(0),
        retries: AtomicU64::new(0),
        unacked: AtomicU64::new(0),
    });
    let crashes = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    let mut worker_tasks = JoinSet::new();
    for id in 1..=settings.workers {
        let (tx, rx) = mpsc::channel(64);
        senders.push(tx);
        let mut worker_rng = StdRng::seed_from_u64(settings.seed.wrapping_mul(1_000_003) ^ id);
        let worker = Worker {
            id,
            bus: bus.clone(),
            inc: Worker::new_incarnation(&mut worker_rng),
            rng: worker_rng,
            settings: settings.clone(),
            lives: 0,
            heap: BinaryHeap::new(),
            order: 0,
            requests: 0,
            running: true,
            next_arrival: Instant::now(),
            drains: Vec::new(),
            crashes: crashes.clone(),
        };
        worker_tasks.spawn(worker.run(rx));
    }
    let fleet = Fleet { senders };
    let mut soak = Soak {
        settings: settings.clone(),
        clock: clock.clone(),
        cluster: cluster.clone(),
        replicas: replicas.clone(),
        fleet: fleet.clone(),
        bus: bus.clone(),
        ref_durable,
        ref_core,
        ref_durable_stats,
        ref_core_stats,
        rests: 0,
    };
    let mut samples = Samples {
        max_rss: BTreeMap::new(),
        snapshot_sequence: 0,
        snapshot_at: Instant::now(),
        snapshot_gap_max: Duration::ZERO,
    };

    // Warm-up: traffic and worker crashes, no faults.
    clock.line(format!(
        "warm-up {:.0}s: {} requests/s over {} workers",
        settings.warmup.as_secs_f64(),
        settings.rate,
        settings.workers
    ));
    let crash_stop = Arc::new(AtomicBool::new(false));
    let crash_task = tokio::spawn(crash_workers(
        fleet.clone(),
        settings.clone(),
        StdRng::seed_from_u64(settings.seed ^ 0xC4A5),
        crash_stop.clone(),
    ));
    sleep(settings.warmup).await;
    crash_stop.store(true, Ordering::Release);
    let _ = crash_task.await;
    let first = soak.rest("before").await;
    print_rest(&first);

    // The faults.
    fleet.resume().await;
    let crash_stop = Arc::new(AtomicBool::new(false));
    let crash_task = tokio::spawn(crash_workers(
        fleet.clone(),
        settings.clone(),
        StdRng::seed_from_u64(settings.seed ^ 0xC4A6),
        crash_stop.clone(),
    ));
    let faults = Faults {
        clock: clock.clone(),
        replicas: replicas.clone(),
        cluster: cluster.clone(),
        log: Arc::new(parking_lot::Mutex::new(FaultLog::default())),
    };
    let phase = settings.fault_phase();
    clock.line(format!(
        "faults for {:.1} min, one every {:.0}s on average",
        phase.as_secs_f64() / 60.0,
        settings.fault_every.as_secs_f64()
    ));
    let phase_end = Instant::now() + phase;
    samples.snapshot_at = Instant::now();
    let mut fault_tasks = JoinSet::new();
    let mut next_fault = Instant::now()
        + exponential(&mut rng, settings.fault_every)
            .clamp(Duration::from_secs(1), settings.fault_every * 4);
    let mut next_sample = Instant::now() + SAMPLE_EVERY;
    let mut next_line = Instant::now() + Duration::from_secs(60);
    let mut n = 0;
    while Instant::now() < phase_end {
        let wake = next_fault.min(next_sample).min(phase_end);
        sleep_until(wake).await;
        while fault_tasks.try_join_next().is_some() {}
        let now = Instant::now();
        if now >= next_fault && now < phase_end {
            n += 1;
            let kind = FaultKind::ALL[rng.random_range(0..FaultKind::ALL.len())];
            faults.inject(kind, &mut rng, &mut fault_tasks, n);
            next_fault = now
                + exponential(&mut rng, settings.fault_every)
                    .clamp(Duration::from_secs(1), settings.fault_every * 4);
        }
        if now >= next_sample {
            next_sample = now + SAMPLE_EVERY;
            let line = soak.sample(&mut samples).await;
            for r in &replicas {
                if let Ok(mut state) = r.state.try_lock() {
                    if let Some(status) = state.exited() {
                        faults
                            .log
                            .lock()
                            .errors
                            .push(format!("{} exited on its own: {status}; restarted", r.name));
                        state.kill().await;
                        state.start()?;
                    }
                }
            }
            if now >= next_line {
                next_line = now + Duration::from_secs(60);
                clock.line(format!(
                    "events {} pending acks {} retries {} unacked {} worker crashes {} load {} | {line}",
                    bus.events.load(Ordering::Relaxed),
                    bus.pending.load(Ordering::Relaxed),
                    bus.retries.load(Ordering::Relaxed),
                    bus.unacked.load(Ordering::Relaxed),
                    crashes.load(Ordering::Relaxed),
                    loadavg()
                ));
            }
        }
    }
    clock.line("faults end: waiting for the last ones to heal");
    crash_stop.store(true, Ordering::Release);
    let _ = crash_task.await;
    if timeout(Duration::from_secs(600), async {
        while fault_tasks.join_next().await.is_some() {}
    })
    .await
    .is_err()
    {
        return Err("the last faults did not heal within 600 s".into());
    }
    let second = soak.rest("after").await;
    print_rest(&second);

    // The figures.
    let log = std::mem::take(&mut *faults.log.lock());
    let mut pass = first.ok && second.ok && log.errors.is_empty();
    for e in &log.errors {
        println!("fault error: {e}");
    }
    let mut rss_growth_long_lived = f64::INFINITY;
    let mut tasks_flat = true;
    for ((a, b), r) in first.replicas.iter().zip(&second.replicas).zip(&replicas) {
        let growth = if a.rss > 0 {
            b.rss as f64 / a.rss as f64
        } else {
            f64::INFINITY
        };
        if !r.killable {
            rss_growth_long_lived = growth;
        }
        tasks_flat &= a.live_tasks == b.live_tasks;
        println!(
            "{}: rss {:.1} -> {:.1} MiB ({growth:.2}x, max sampled {:.1}), threads {} -> {}, live tasks {} -> {}, starts {}",
            a.name,
            mib(a.rss),
            mib(b.rss),
            mib(samples.max_rss.get(a.name).copied().unwrap_or(0)),
            a.threads,
            b.threads,
            a.live_tasks,
            b.live_tasks,
            b.starts
        );
    }
    pass &= tasks_flat && rss_growth_long_lived <= settings.max_rss_growth;
    let unacked = bus.unacked.load(Ordering::Relaxed);
    pass &= unacked == 0;
    let recovery_max = log.recovery.iter().copied().fold(0.0, f64::max);
    let seen_max = log.partitions_seen.iter().copied().fold(0.0, f64::max);
    println!("soak_minutes={}", settings.minutes);
    println!("soak_seed={}", settings.seed);
    for kind in FaultKind::ALL {
        println!(
            "soak_faults_{}={}",
            kind.label(),
            log.injected.get(&kind).copied().unwrap_or(0)
        );
    }
    for kind in FaultKind::ALL {
        println!(
            "soak_fault_seconds_{}={:.0}",
            kind.label(),
            log.seconds.get(&kind).copied().unwrap_or(0.0)
        );
    }
    println!("soak_faults_skipped={}", log.skipped);
    println!("soak_fault_errors={}", log.errors.len());
    println!("soak_recovery_max_s={recovery_max:.1}");
    println!(
        "soak_snapshot_gap_max_s={:.0}",
        samples.snapshot_gap_max.as_secs_f64()
    );
    println!(
        "soak_partitions_seen={} soak_partition_seen_max_s={seen_max:.1}",
        log.partitions_seen.len()
    );
    println!("soak_worker_crashes={}", crashes.load(Ordering::Relaxed));
    println!(
        "soak_events_published={}",
        bus.events.load(Ordering::Relaxed)
    );
    println!(
        "soak_messages_sent={}",
        bus.messages.load(Ordering::Relaxed)
    );
    println!(
        "soak_publish_retries={}",
        bus.retries.load(Ordering::Relaxed)
    );
    println!("soak_publish_unacked={unacked}");
    println!(
        "soak_rest_leases_durable={} soak_rest_leases_core={}",
        second.reference_durable_leases, second.reference_core_leases
    );
    println!("soak_at_rest_identical_before={}", first.identical);
    println!("soak_at_rest_identical_after={}", second.identical);
    println!(
        "soak_stream_consumers_after={} soak_stream_consumer_count_after={}",
        second.consumers.map_or(-1, |c| c as i64),
        second.consumer_count.map_or(-1, |c| c as i64)
    );
    println!(
        "soak_accounting_identity_exact={}",
        first.identity_ok && second.identity_ok
    );
    for (a, b) in first.replicas.iter().zip(&second.replicas) {
        println!(
            "soak_rss_mib_{}={:.1}->{:.1} soak_live_tasks_{}={}->{} soak_threads_{}={}->{}",
            a.name.replace('-', "_"),
            mib(a.rss),
            mib(b.rss),
            a.name.replace('-', "_"),
            a.live_tasks,
            b.live_tasks,
            a.name.replace('-', "_"),
            a.threads,
            b.threads
        );
    }
    println!("soak_rss_growth_durable_a={rss_growth_long_lived:.2}");
    println!("soak_live_tasks_flat={tasks_flat}");
    let mut verdict = String::new();
    let _ = write!(
        verdict,
        "soak_result={}",
        if pass { "pass" } else { "fail" }
    );
    println!("{verdict}");
    // Stop the workers before the references and the replicas go.
    drop(fleet);
    drop(soak.fleet);
    worker_tasks.shutdown().await;
    for r in &replicas {
        r.state.lock().await.kill().await;
    }
    Ok(pass)
}

/// Copies each file to its destination when dropped.
struct CopyOnDrop(Vec<(PathBuf, PathBuf)>);

impl Drop for CopyOnDrop {
    fn drop(&mut self) {
        for (from, to) in &self.0 {
            let _ = fs::copy(from, to);
        }
    }
}

/// Crashes a random worker every `worker_crash_every` on average until `stop`.
async fn crash_workers(
    fleet: Fleet,
    settings: Arc<Settings>,
    mut rng: StdRng,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Acquire) {
        let gap = exponential(&mut rng, settings.worker_crash_every)
            .clamp(Duration::from_millis(100), settings.worker_crash_every * 4);
        let until = Instant::now() + gap;
        while Instant::now() < until {
            if stop.load(Ordering::Acquire) {
                return;
            }
            sleep(Duration::from_millis(100).min(until - Instant::now())).await;
        }
        let w = rng.random_range(0..fleet.senders.len());
        let _ = fleet.senders[w].send(WorkerCommand::Crash).await;
    }
}
