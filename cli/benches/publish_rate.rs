//! Events per second one publisher sustains, the Rust `LeasePublisher` next to the Python
//! package's, on the same nats-server and the same router, in one run
//! (`cargo bench -p lease-router-cli --bench publish_rate`).
//!
//! One nats-server (the testkit's) and one `lease-router serve --deployment bench` (this
//! package's binary). Rounds take turns: the Rust publisher one event a message, then batched
//! (`Batching::default()`), then `clients/python/bench/publish_rate.py --rounds 1` (both
//! modes) as a child process with `clients/python/src` on its path. Both publishers do the same
//! work: 8 worker subjects, lifecycles of admitted (512 prompt tokens), two progressed and
//! completed, as fast as the queue takes them (the producer yields while more than 4,096
//! events wait, so nothing is dropped), timed from the first `publish` to the end of `close`;
//! the router's `events_received_total` must grow by exactly the events published. The Rust
//! publisher runs on a current-thread runtime of its own, one thread as Python's event loop.
//!
//! Pinned lines (medians over the rounds): `rust_publish_events_per_s_single=`,
//! `rust_publish_events_per_s_batched=`, `python_publish_events_per_s_single=`,
//! `python_publish_events_per_s_batched=`, and the ratios
//! `python_vs_rust_publish_single=<python/rust>`, `python_vs_rust_publish_batched=`.
//!
//! Environment: `PUBLISH_RATE_EVENTS` (per round and mode, default 200000),
//! `PUBLISH_RATE_ROUNDS` (default 3), `PUBLISH_RATE_PYTHON` (default `.tools/venv/bin/python3`,
//! else `python3`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lease_router::wire::{Outcome, ProgressStage};
use lease_router::{Batching, LeasePublisher, PublisherConfig};
use lease_router::{DeploymentName, SubjectPrefix, Subjects};
use lease_router_testkit::NatsServer;

const BIN: &str = env!("CARGO_BIN_EXE_lease-router");
const DEPLOYMENT: &str = "bench";
const WORKERS: u64 = 8;
/// The producer waits while more than this many events are queued (the queue holds 8,192).
const ROOM: u64 = 4096;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ has a parent")
        .to_path_buf()
}

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("PUBLISH_RATE_PYTHON") {
        return p.into();
    }
    let venv = workspace().join(".tools/venv/bin/python3");
    if venv.exists() {
        venv
    } else {
        "python3".into()
    }
}

/// One GET over HTTP/1.0 (the server answers with a length and closes).
fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no end of headers")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {head:?}"))?;
    Ok((status, body.to_string()))
}

/// The router's `events_received_total` for the bench's deployment.
fn received(addr: SocketAddr) -> u64 {
    let (_, body) = http_get(addr, "/metrics").expect("GET /metrics");
    let want = format!("lease_router_events_received_total{{deployment=\"{DEPLOYMENT}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Waits until the router has received `want` events more than `before`; the count it has.
fn await_received(addr: SocketAddr, before: u64, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = received(addr) - before;
        if got >= want || Instant::now() >= deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `lease-router serve` for the bench's deployment; the process and its HTTP address.
fn serve(nats_url: &str) -> (Child, SocketAddr) {
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--nats-url",
            nats_url,
            "--http-addr",
            "127.0.0.1:0",
        ])
        .args(["--deployment", DEPLOYMENT])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{BIN}: {e}"));
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let addr = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(addr) = line.strip_prefix("listening on http://") {
                    break addr.trim().parse().expect("a socket address");
                }
            }
            _ => panic!("serve ended before it listened"),
        }
    };
    // Keep reading so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

/// One round of the Rust publisher: events per second, checked against the router.
fn rust_round(nats_url: &str, router: SocketAddr, events: u64, batched: bool) -> f64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let before = received(router);
    let (sent, elapsed) = runtime.block_on(async {
        let client = async_nats::connect(nats_url).await.expect("connect");
        let subjects = Subjects::new(
            SubjectPrefix::new("leases").expect("prefix"),
            DeploymentName::new(DEPLOYMENT).expect("deployment"),
        );
        let mut config = PublisherConfig::default();
        if batched {
            config = config.with_batching(Batching::default());
        }
        let publisher = LeasePublisher::start(client.clone(), subjects, config);
        let start = Instant::now();
        let mut sent = 0u64;
        let mut n = 0u64;
        while sent < events {
            let w = n % WORKERS;
            let rid = format!("b{n}");
            let results = [
                publisher.admitted(rid.clone(), w, 0, 512, Some(128)),
                publisher.progressed(rid.clone(), w, 0, ProgressStage::PrefillDone, 1),
                publisher.progressed(rid.clone(), w, 0, ProgressStage::Decoding, 64),
                publisher.completed(rid, w, 0, Outcome::Finished),
            ];
            if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
                panic!("dropped ({e}): the producer must wait for room");
            }
            sent += 4;
            n += 1;
            if n.is_multiple_of(256) {
                while publisher.stats().pending() > ROOM {
                    tokio::task::yield_now().await;
                }
            }
        }
        let figures = publisher.close().await.expect("close");
        let elapsed = start.elapsed();
        assert_eq!(figures.published, sent, "every event published");
        drop(client);
        (sent, elapsed)
    });
    let got = await_received(router, before, sent);
    assert_eq!(got, sent, "the router received every event");
    sent as f64 / elapsed.as_secs_f64()
}

/// One round of the Python bench (both modes): events per second, single and batched.
fn python_round(nats_url: &str, router: SocketAddr, events: u64) -> (f64, f64) {
    let root = workspace();
    let out = Command::new(python())
        .arg(root.join("clients/python/bench/publish_rate.py"))
        .args(["--nats-url", nats_url])
        .args(["--router-url", &format!("http://{router}")])
        .args(["--deployment", DEPLOYMENT, "--rounds", "1"])
        .args(["--events", &events.to_string()])
        .env("PYTHONPATH", root.join("clients/python/src"))
        .stderr(Stdio::inherit())
        .output()
        .expect("python runs (scripts/tools installs .tools/venv)");
    assert!(
        out.status.success(),
        "publish_rate.py failed: {}",
        out.status
    );
    let (mut single, mut batched) = (None, None);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(mode), Some(rate)) = (value["mode"].as_str(), value["events_per_s"].as_f64())
        else {
            continue;
        };
        assert_eq!(
            value["router_received"].as_f64(),
            value["events"].as_f64(),
            "the router received every Python event: {line}"
        );
        match mode {
            "single" => single = Some(rate),
            "batched" => batched = Some(rate),
            _ => {}
        }
    }
    (
        single.expect("a single-mode line"),
        batched.expect("a batched-mode line"),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` passes nothing: only run
    // when asked to bench.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let events = env_u64("PUBLISH_RATE_EVENTS", 200_000) / 4 * 4;
    let rounds = env_u64("PUBLISH_RATE_ROUNDS", 3).max(1);
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    let server = runtime
        .block_on(NatsServer::builder().spawn())
        .expect("nats-server (scripts/tools puts one in .tools/)");
    let nats_url = server.url();
    let (mut router, addr) = serve(&nats_url);
    println!("publish_rate: {events} events per round and mode, {rounds} rounds, router {addr}");
    let (mut rs, mut rb, mut ps, mut pb) = (vec![], vec![], vec![], vec![]);
    for round in 1..=rounds {
        rs.push(rust_round(&nats_url, addr, events, false));
        rb.push(rust_round(&nats_url, addr, events, true));
        let (s, b) = python_round(&nats_url, addr, events);
        ps.push(s);
        pb.push(b);
        println!(
            "round {round}: rust single {:.0}/s batched {:.0}/s; python single {s:.0}/s \
             batched {b:.0}/s",
            rs[rs.len() - 1],
            rb[rb.len() - 1]
        );
    }
    let (rs, rb, ps, pb) = (median(rs), median(rb), median(ps), median(pb));
    println!("rust_publish_events_per_s_single={rs:.0}");
    println!("rust_publish_events_per_s_batched={rb:.0}");
    println!("python_publish_events_per_s_single={ps:.0}");
    println!("python_publish_events_per_s_batched={pb:.0}");
    println!("python_vs_rust_publish_single={:.3}", ps / rs);
    println!("python_vs_rust_publish_batched={:.3}", pb / rb);
    let _ = router.kill();
    let _ = router.wait();
    drop(server);
}
