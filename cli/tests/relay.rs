//! `lease-router relay` end to end: a fake vLLM engine (`fake_vllm_engine.py`: pyzmq and
//! msgpack, vLLM's frames byte for byte, its replay socket), the real relay, a real `serve`
//! over a real nats-server. After every step the router's view of the worker
//! (`GET /v1/deployments/{d}/prefix/{worker}`) must equal our hashes (the library's
//! `block_hashes` of the token ids) of what the relay can know of the engine's cache: all of
//! it, except after a loss that replay cannot fill, when the index holds less (cleared, then
//! what the engine stored since).
//!
//! The Python comes from `.tools/venv` (`scripts/tools`, PYTHON_PACKAGES: pyzmq, msgpack),
//! else `python3` on PATH. Every wait is bounded and polls; children are killed on drop.

mod support;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};
use support::{command, http, Proc};

use lease_router::block_hashes;
use lease_router_testkit::{pick_free_ports, NatsServer, NatsServerBuilder};
use serde_json::{json, Value};

const BOUND: Duration = Duration::from_secs(30);
const BLOCK: usize = 16;
const WORKER: u64 = 7;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ is in the workspace")
        .to_path_buf()
}

/// The Python with pyzmq and msgpack: `.tools/venv`'s, else `python3` on PATH.
fn python() -> PathBuf {
    let venv = workspace().join(".tools/venv/bin/python3");
    let python = if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    };
    let probe = Command::new(&python)
        .args(["-c", "import zmq, msgpack"])
        .output();
    match probe {
        Ok(out) if out.status.success() => python,
        other => panic!(
            "{} lacks pyzmq or msgpack: `scripts/test` installs them into .tools/venv \
             (scripts/tools, PYTHON_PACKAGES), or `pip install pyzmq msgpack` ({other:?})",
            python.display()
        ),
    }
}

async fn nats(jetstream: bool) -> NatsServer {
    NatsServerBuilder::new()
        .jetstream(jetstream)
        .spawn()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The value of one metric series of the relay (the whole series name must match).
fn metric(addr: SocketAddr, series: &str) -> f64 {
    let (status, body) = http(addr, "GET", "/metrics");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|line| {
            let value = line.strip_prefix(series)?.strip_prefix(' ')?;
            value.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("no series {series} in\n{body}"))
}

/// Polls `check` until it holds, at most the bound; `what` and the last state on failure.
fn eventually(what: &str, mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + BOUND;
    loop {
        match check() {
            Ok(()) => return,
            Err(state) if Instant::now() >= deadline => panic!("{what}: {state}"),
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The fake engine: JSON commands on its stdin, one answer line each.
struct Engine {
    proc: Proc,
    stdin: ChildStdin,
    answers: Receiver<String>,
    /// The last sequence number it used.
    seq: Option<u64>,
}

impl Engine {
    fn start(setup: &Setup, layout: &str, hashes: &str) -> Engine {
        let (pub_endpoint, replay_endpoint) = (&setup.pub_endpoint, &setup.replay_endpoint);
        let rank = setup.dp_rank.to_string();
        let script = workspace().join("cli/tests/fake_vllm_engine.py");
        let mut child = Command::new(python())
            .arg(script)
            .args(["--pub", pub_endpoint, "--replay", replay_endpoint])
            .args([
                "--layout",
                layout,
                "--hashes",
                hashes,
                "--topic",
                "kv-events",
            ])
            .args(["--dp-rank", &rank])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python starts");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, answers) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let proc = Proc::adopt(child);
        let mut engine = Engine {
            proc,
            stdin,
            answers,
            seq: None,
        };
        let ready = engine.answer();
        assert_eq!(ready["ready"], true, "{ready}");
        engine
    }

    fn answer(&mut self) -> Value {
        let line = self.answers.recv_timeout(BOUND).unwrap_or_else(|e| {
            panic!(
                "the fake engine did not answer ({e})\n{}",
                self.proc.stderr()
            )
        });
        let value: Value = serde_json::from_str(&line).expect("a JSON answer");
        assert!(value.get("error").is_none(), "the fake engine: {value}");
        value
    }

    fn send(&mut self, command: Value) -> Value {
        writeln!(self.stdin, "{command}").expect("the fake engine's stdin");
        self.stdin.flush().unwrap();
        let answer = self.answer();
        self.seq = answer["seq"].as_i64().and_then(|s| u64::try_from(s).ok());
        answer
    }
}

/// Our hashes of the full blocks of `tokens`.
fn ours(tokens: &[u32]) -> Vec<u64> {
    block_hashes(tokens, BLOCK)
}

fn tokens(from: u32, n: usize) -> Vec<u32> {
    (from..from + n as u32).collect()
}

fn store(tokens: &[u32], from: usize) -> Value {
    json!({"op": "store", "tokens": tokens, "from": from})
}

struct Setup {
    nats_url: String,
    deployment: String,
    pub_endpoint: String,
    replay_endpoint: String,
    durable: bool,
    dp_rank: u32,
}

impl Setup {
    fn relay(&self) -> (Proc, SocketAddr) {
        let mut args = vec![
            "relay",
            "--nats-url",
            &self.nats_url,
            "--deployment",
            &self.deployment,
            "--worker-id",
            "7",
            "--endpoint",
            &self.pub_endpoint,
            "--replay-endpoint",
            &self.replay_endpoint,
            "--topic",
            "kv-events",
            "--block-size",
            "16",
            "--http-addr",
            "127.0.0.1:0",
        ];
        let rank = self.dp_rank.to_string();
        args.extend(["--dp-rank", &rank]);
        if self.durable {
            args.push("--durable");
        }
        let mut proc = Proc::spawn(&mut command(&args));
        let addr = proc.wait_for_line("listening on http://", BOUND);
        (proc, addr.trim().parse().expect("an address"))
    }
}

/// Until the relay has taken the engine's last message: no-op batches make a lost last
/// message show as a gap (a real engine publishes all the time).
fn sync(engine: &mut Engine, relay: SocketAddr) {
    let deadline = Instant::now() + BOUND;
    let mut nudge = Instant::now() + Duration::from_millis(500);
    loop {
        let seen = metric(relay, "lease_router_relay_last_sequence");
        if engine.seq.is_some_and(|s| seen == s as f64) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the relay is at {seen}, the engine at {:?}",
            engine.seq
        );
        if Instant::now() >= nudge {
            engine.send(json!({"op": "noop"}));
            nudge = Instant::now() + Duration::from_millis(500);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The router's view of the worker's rank `rank` equals `want`.
fn view_is(router: SocketAddr, deployment: &str, rank: u32, want: &BTreeSet<u64>, step: &str) {
    let path = format!("/v1/deployments/{deployment}/prefix/{WORKER}");
    eventually(step, || {
        let (status, body) = http(router, "GET", &path);
        if status != 200 {
            return Err(format!("{status} {body}"));
        }
        let view: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        let found = view["ranks"]
            .as_array()
            .and_then(|ranks| ranks.iter().find(|r| r["dp_rank"] == rank));
        let held: BTreeSet<u64> = found
            .and_then(|r| r["hashes"].as_array())
            .map(|h| h.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        if found.is_some_and(|r| r["exact"] != true) {
            return Err(format!("rank {rank} is not exact: {body}"));
        }
        if &held == want {
            Ok(())
        } else {
            Err(format!(
                "the router holds {} blocks, the engine {}: {body}",
                held.len(),
                want.len()
            ))
        }
    });
}

fn at_least(relay: SocketAddr, series: &str, n: f64) {
    eventually(series, || {
        let value = metric(relay, series);
        (value >= n).then_some(()).ok_or(format!("{value} < {n}"))
    });
}

/// `relay_first`: the relay starts before the engine (a sidecar beside an engine still
/// loading its model): unhealthy until the engine's socket answers, then the same.
async fn scenario(layout: &str, hashes: &str, durable: bool, relay_first: bool, rank: u32) {
    let server = nats(durable).await;
    let deployment = format!("relay-{}", layout.replace('.', "-"));
    let url = server.url();
    let mut serve_args = vec![
        "serve",
        "--nats-url",
        &url,
        "--http-addr",
        "127.0.0.1:0",
        "--deployment",
        &deployment,
        "--block-size",
        "16",
    ];
    if durable {
        serve_args.push("--durable");
    }
    let mut serve = Proc::spawn(&mut command(&serve_args));
    let router: SocketAddr = serve
        .wait_for_line("listening on http://", BOUND)
        .trim()
        .parse()
        .unwrap();
    let ports = pick_free_ports(2).expect("free ports");
    let setup = Setup {
        nats_url: server.url(),
        deployment: deployment.clone(),
        pub_endpoint: format!("tcp://127.0.0.1:{}", ports[0]),
        replay_endpoint: format!("tcp://127.0.0.1:{}", ports[1]),
        durable,
        dp_rank: rank,
    };
    let (mut engine, (relay, addr)) = if relay_first {
        let (relay, addr) = setup.relay();
        let (status, body) = http(addr, "GET", "/healthz");
        assert_eq!(status, 503, "no engine yet: {body}");
        assert!(body.contains("\"engine_connected\":false"), "{body}");
        thread::sleep(Duration::from_millis(300));
        let engine = Engine::start(&setup, layout, hashes);
        (engine, (relay, addr))
    } else {
        let engine = Engine::start(&setup, layout, hashes);
        (engine, setup.relay())
    };
    eventually("/healthz turns 200", || {
        let (status, body) = http(addr, "GET", "/healthz");
        (status == 200).then_some(()).ok_or(body)
    });
    let d = deployment.as_str();
    let mut want = BTreeSet::new();

    // Stores: a prompt, its continuation (parent: its last block), another prompt.
    let a = tokens(1000, 88);
    engine.send(store(&a[..48], 0));
    engine.send(store(&a, 3));
    let b = tokens(5000, 40);
    engine.send(store(&b, 0));
    want.extend(ours(&a));
    want.extend(ours(&b));
    assert_eq!(want.len(), 7);
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after the stores");

    // Evictions, and a store and a removal in one batch.
    engine.send(json!({"op": "remove", "tokens": a, "blocks": [4, 3]}));
    let c = tokens(9000, 32);
    engine.send(json!({"op": "batch", "items": [
        {"op": "remove", "tokens": b, "blocks": [1]},
        {"op": "store", "tokens": c},
    ]}));
    for gone in [ours(&a)[4], ours(&a)[3], ours(&b)[1]] {
        want.remove(&gone);
    }
    want.extend(ours(&c));
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after the evictions");

    // The engine's cache cleared.
    engine.send(json!({"op": "clear"}));
    let e = tokens(12000, 48);
    engine.send(store(&e[..32], 0));
    want = ours(&e[..32]).into_iter().collect();
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after a clear");

    // A message the PUB socket lost, in the replay buffer: repaired.
    engine.send(json!({"op": "store", "tokens": e, "from": 2, "drop": "pub"}));
    want.extend(ours(&e));
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after a lost message");
    at_least(addr, "lease_router_relay_gaps_repaired_total", 1.0);

    // A loss replay cannot fill: cleared, then only what is stored afresh.
    let f = tokens(20000, 32);
    engine.send(json!({"op": "store", "tokens": f, "drop": "both"}));
    sync(&mut engine, addr);
    want.clear();
    view_is(router, d, rank, &want, "after a loss replay cannot fill");
    at_least(addr, "lease_router_relay_gaps_cleared_total", 1.0);
    let g = tokens(30000, 32);
    engine.send(store(&g, 0));
    // A continuation of a block from before the loss: its parent is unknown, skipped.
    let e2 = tokens(12000, 64);
    engine.send(store(&e2, 3));
    want.extend(ours(&g));
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "fresh stores after the loss");
    at_least(addr, "lease_router_relay_unknown_parents_total", 1.0);

    // The relay restarts: kv_cleared when it stops, the engine's history when it starts
    // (through the hole, as the running relay saw it).
    relay.terminate(BOUND);
    view_is(router, d, rank, &BTreeSet::new(), "the relay stopped");
    let (relay, addr) = setup.relay();
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after the relay restarted");

    // The engine restarts: its sequence starts over, its cache is empty.
    drop(engine);
    let mut engine = Engine::start(&setup, layout, hashes);
    let h = tokens(40000, 48);
    engine.send(store(&h, 0));
    want = ours(&h).into_iter().collect();
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after the engine restarted");
    at_least(addr, "lease_router_relay_engine_restarts_total", 1.0);

    // Malformed messages: counted and dropped; a payload that is not a batch clears.
    let before = metric(addr, "lease_router_relay_malformed_frames_total");
    engine.send(json!({"op": "malformed", "kind": "frames"}));
    engine.send(json!({"op": "malformed", "kind": "seq"}));
    let k = tokens(50000, 16);
    engine.send(store(&k, 0));
    want.extend(ours(&k));
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after malformed frames");
    at_least(
        addr,
        "lease_router_relay_malformed_frames_total",
        before + 2.0,
    );
    engine.send(json!({"op": "malformed", "kind": "payload"}));
    sync(&mut engine, addr);
    want.clear();
    view_is(
        router,
        d,
        rank,
        &want,
        "after a payload that is not a batch",
    );
    at_least(
        addr,
        "lease_router_relay_clears_total{reason=\"malformed\"}",
        1.0,
    );
    let m = tokens(60000, 32);
    engine.send(store(&m, 0));
    want.extend(ours(&m));
    sync(&mut engine, addr);
    view_is(router, d, rank, &want, "after the malformed payload");
    let (status, body) = http(addr, "GET", "/healthz");
    assert_eq!(status, 200, "{body}");
    let other_ranks = metric(addr, "lease_router_relay_dp_rank_mismatches_total");
    assert_eq!(
        other_ranks, 0.0,
        "the batches carry the engine's rank, --dp-rank"
    );

    let log = relay.terminate(BOUND);
    assert!(!log.contains("panicked"), "{log}");
    view_is(
        router,
        d,
        rank,
        &BTreeSet::new(),
        "the relay stopped at the end",
    );
    drop(serve);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_view_follows_a_vllm_engine_array_layout_int_hashes() {
    scenario("array", "int", false, false, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_view_follows_a_vllm_engine_map_layout_bytes_hashes_durable_rank_1() {
    scenario("map", "bytes", true, false, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_view_follows_a_vllm_0_9_engine_started_after_its_relay() {
    scenario("array-0.9", "int", false, true, 0).await;
}

/// The relay's throughput (BENCHMARKS.md, "KV event relay: ZeroMQ crate"): the fake engine
/// sends RELAY_BENCH_BATCHES batches (default 50,000) of one `BlockStored` of 4 blocks back to
/// back; the figure is batches per second from the first send to the relay's last sequence
/// number. Run it on a release build:
/// `cargo test --release -p lease-router-cli --test relay -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check: run with --ignored on a release build"]
async fn relay_throughput() {
    let batches: u64 = std::env::var("RELAY_BENCH_BATCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let server = nats(false).await;
    let ports = pick_free_ports(2).expect("free ports");
    let setup = Setup {
        nats_url: server.url(),
        deployment: "relay-bench".into(),
        pub_endpoint: format!("tcp://127.0.0.1:{}", ports[0]),
        replay_endpoint: format!("tcp://127.0.0.1:{}", ports[1]),
        durable: false,
        dp_rank: 0,
    };
    let mut engine = Engine::start(&setup, "array", "int");
    let (relay, addr) = setup.relay();
    engine.send(json!({"op": "noop"}));
    sync(&mut engine, addr);
    let start_seq = engine.seq.expect("a sequence number");
    // The engine encodes every batch first, then sends them back to back; the clock runs
    // from the relay's first step past `start_seq` to its last sequence number.
    writeln!(
        engine.stdin,
        "{}",
        json!({"op": "blast", "count": batches, "blocks": 4})
    )
    .unwrap();
    engine.stdin.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    let last = start_seq + batches;
    let (mut first, mut from) = (None, start_seq);
    loop {
        let seen = metric(addr, "lease_router_relay_last_sequence") as u64;
        if first.is_none() && seen > start_seq {
            (first, from) = (Some(Instant::now()), seen);
        }
        if seen >= last {
            break;
        }
        assert!(Instant::now() < deadline, "the relay did not catch up");
        thread::sleep(Duration::from_millis(1));
    }
    let seconds = first.expect("progress seen").elapsed().as_secs_f64();
    let answer = engine.answer();
    assert_eq!(answer["seq"].as_u64(), Some(last), "{answer}");
    let batches = last - from;
    let series = |name: &str| metric(addr, name);
    println!(
        "relay_batches_per_second={:.0} (batches {batches}, 4 blocks each, {:.2} s; the \
         engine's sends took {:.2} s; gaps repaired {}, gaps cleared {}, publish waits {}, \
         publish dropped {}, blocks stored {})",
        batches as f64 / seconds,
        seconds,
        answer["send_seconds"].as_f64().unwrap_or(f64::NAN),
        series("lease_router_relay_gaps_repaired_total"),
        series("lease_router_relay_gaps_cleared_total"),
        series("lease_router_relay_publish_waits_total"),
        series("lease_router_relay_publish_dropped_total"),
        series("lease_router_relay_blocks_stored_total"),
    );
    relay.terminate(BOUND);
}
