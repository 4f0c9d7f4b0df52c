//! Durable catch-up at scale: how long a late replica takes to be ready with LIVE live leases
//! after 1x, 4x and 16x a history of finished requests, next to a raw replay of the same
//! stream (an ordered consumer that only decodes) in the same run.
//!
//! Per history size, one deployment on a private JetStream server: LIVE admissions that
//! never end, then finished lifecycles (admitted, progressed, completed) until the stream
//! holds the history. A first replica replays it all and writes a snapshot; then a late
//! replica starts, loads the snapshot and replays what follows it.
//!
//! `CATCHUP_LIVE` (default 100000) and `CATCHUP_HISTORY` (events of the 1x history, default
//! 500000) scale it down on a slow machine; `DURABLE_COMPRESSION=0` makes the stream
//! uncompressed (the default compresses where the server can, 2.10 and later).
//!
//! Pinned lines: `catchup_ready_s=` (the late replica at 16x, median of five starts) and
//! `catchup_growth=` (ready at 16x / ready at 1x).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use common::*;
use futures::StreamExt;
use lease_router::wire::{self, Admitted, Envelope, LeaseEvent};
use lease_router::{
    ensure_stream, ApplyConfig, CatchUpState, IngressStats, JetStreamIngress, LeaseStreamConfig,
    NatsConnection, Router, RouterConfig,
};
use lease_router_testkit::NatsServerBuilder;
use tokio_util::task::TaskTracker;

const SNAPSHOT_INTERVAL: Duration = Duration::from_secs(1);
/// The stream keeps every event of the run: the raw replay reads them all.
const KEEP: u32 = 36_000;
const NO_EXPIRY: Duration = Duration::from_secs(36_000);
/// Late replicas started per history size; the median is reported.
const LATE_STARTS: usize = 5;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn config() -> LeaseStreamConfig {
    LeaseStreamConfig::new()
        .with_snapshots(SNAPSHOT_INTERVAL, KEEP)
        .with_max_bytes(-1)
        .with_compression(std::env::var("DURABLE_COMPRESSION").map_or(true, |v| v != "0"))
}

struct Replica {
    router: Router,
    catch_up: Arc<CatchUpState>,
    ready: Duration,
}

async fn start_replica(conn: &NatsConnection, deployment: &str) -> Replica {
    let catch_up = Arc::new(CatchUpState::new());
    let ingress = JetStreamIngress::new(
        conn.client().clone(),
        subjects(deployment),
        config(),
        ApplyConfig::default(),
        Arc::new(IngressStats::new()),
        catch_up.clone(),
    );
    let started = Instant::now();
    let router = Router::start_tracked(
        RouterConfig::new(deployment).with_scan_interval(NO_EXPIRY),
        ingress,
        TaskTracker::new(),
    )
    .await
    .expect("durable router starts");
    tokio::time::timeout(Duration::from_secs(1800), catch_up.wait())
        .await
        .expect("catches up");
    Replica {
        router,
        catch_up,
        ready: started.elapsed(),
    }
}

/// Publishes `events` of one publisher with up to 4,096 acknowledgements outstanding.
async fn publish(
    conn: &NatsConnection,
    deployment: &str,
    events: impl Iterator<Item = LeaseEvent>,
) -> u64 {
    let js = jetstream::new(conn.client().clone());
    let subjects = subjects(deployment);
    let mut acks = std::collections::VecDeque::new();
    let mut seq = 0u64;
    for event in events {
        seq += 1;
        let env = Envelope::new(1, seq, wire::unix_micros_now(), event);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("1-{seq}").as_str());
        let ack = js
            .publish_with_headers(
                subjects.worker_subject(env.event.worker_id()),
                headers,
                Bytes::from(wire::encode(&env).expect("encodes")),
            )
            .await
            .expect("publishes");
        acks.push_back(ack);
        if acks.len() >= 4096 {
            acks.pop_front().unwrap().await.expect("stored");
        }
    }
    for ack in acks {
        ack.await.expect("stored");
    }
    seq
}

/// An ordered consumer reading the whole stream, decoding each event: the replay ceiling.
async fn raw_replay(conn: &NatsConnection, deployment: &str, events: u64) -> Duration {
    let js = jetstream::new(conn.client().clone());
    let stream = js
        .get_stream(lease_router::stream_name(&subjects(deployment)))
        .await
        .expect("stream");
    let started = Instant::now();
    let mut messages = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .expect("consumer")
        .messages()
        .await
        .expect("messages");
    for _ in 0..events {
        let m = messages.next().await.expect("more").expect("message");
        wire::decode(&m.payload, wire::DEFAULT_MAX_EVENT_BYTES).expect("decodes");
    }
    started.elapsed()
}

struct Run {
    history: u64,
    events: u64,
    publish: Duration,
    full_replay: Duration,
    raw: Duration,
    late: Duration,
    late_replayed: u64,
    snapshot_bytes: u64,
}

async fn run_one(conn: &NatsConnection, multiple: u64, live: u64, history: u64) -> Run {
    let deployment = format!("h{multiple}");
    ensure_stream(
        &jetstream::new(conn.client().clone()),
        &config(),
        &subjects(&deployment),
    )
    .await
    .expect("stream");
    let workers: Vec<u64> = (0..64).collect();
    let live_events = (0..live).map(|n| {
        LeaseEvent::from(Admitted {
            block_hashes: Vec::new(),
            block_capacity: None,
            class: None,
            request_id: uuid_like(1_000 + multiple, n),
            worker_id: n % 64,
            dp_rank: 0,
            prompt_tokens: 512,
            expected_output_tokens: Some(256),
            cached_tokens: None,
        })
    });
    let shape = LifecycleShape {
        never_completed_pct: 0,
        ..LifecycleShape::default()
    };
    let history_target = history * multiple;
    // Five events per finished request on average (admitted, two to four progressed,
    // completed); every one of them ends.
    let mut lifecycles = LifecycleGen::new(multiple, workers, history_target / 5, shape);
    let history_events = std::iter::from_fn(move || lifecycles.next_event());
    let started = Instant::now();
    let events = publish(conn, &deployment, live_events.chain(history_events)).await;
    let publish_took = started.elapsed();

    let first = start_replica(conn, &deployment).await;
    assert_eq!(first.router.manager().active_leases() as u64, live);
    // Wait for a snapshot of the whole stream.
    let deadline = Instant::now() + Duration::from_secs(600);
    while first.catch_up.snapshot_figures().last_sequence < events {
        assert!(Instant::now() < deadline, "no snapshot of the whole stream");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let snapshot_bytes = first.catch_up.snapshot_figures().last_bytes;
    let raw = raw_replay(conn, &deployment, events).await;
    // The median of a few late replicas: each is short, and the machine is shared.
    let mut readies = Vec::new();
    let mut late_replayed = 0;
    for _ in 0..LATE_STARTS {
        let late = start_replica(conn, &deployment).await;
        assert_eq!(late.router.manager().active_leases() as u64, live);
        assert!(
            late.catch_up.snapshot_figures().loaded_sequence > 0,
            "loaded a snapshot"
        );
        readies.push(late.ready);
        late_replayed = late.catch_up.replayed();
        late.router.shutdown().await.expect("shuts down");
    }
    readies.sort();
    let run = Run {
        history: history_target,
        events,
        publish: publish_took,
        full_replay: first.ready,
        raw,
        late: readies[readies.len() / 2],
        late_replayed,
        snapshot_bytes,
    };
    first.router.shutdown().await.expect("shuts down");
    run
}

fn main() {
    run(async {
        let live = env("CATCHUP_LIVE", 100_000);
        let history = env("CATCHUP_HISTORY", 500_000);
        println!("machine: {}", machine());
        println!(
            "stream compression where the server can: {}",
            config().compression()
        );
        println!("live leases: {live}; 1x history: {history} events");
        let server = NatsServerBuilder::new()
            .jetstream(true)
            .spawn()
            .await
            .expect("nats-server with JetStream starts");
        let conn = nats(&server.url(), None).await;
        let mut runs = Vec::new();
        for multiple in [1, 4, 16] {
            let r = run_one(&conn, multiple, live, history).await;
            println!(
                "{multiple:>2}x: {} events ({} history) published in {:.1} s; full replay ready {:.3} s, raw replay {:.3} s; snapshot {} bytes; late replica ready {:.3} s (median of 5; {} events replayed after the snapshot)",
                r.events,
                r.history,
                r.publish.as_secs_f64(),
                r.full_replay.as_secs_f64(),
                r.raw.as_secs_f64(),
                r.snapshot_bytes,
                r.late.as_secs_f64(),
                r.late_replayed,
            );
            runs.push(r);
        }
        let (one, sixteen) = (&runs[0], &runs[2]);
        println!("catchup_ready_s={:.3}", sixteen.late.as_secs_f64());
        println!(
            "catchup_growth={:.3}",
            sixteen.late.as_secs_f64() / one.late.as_secs_f64()
        );
        println!(
            "catchup_full_replay_growth={:.3}",
            sixteen.full_replay.as_secs_f64() / one.full_replay.as_secs_f64()
        );
    });
}
