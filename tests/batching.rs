//! Wire 1.2 batches end to end against real nats-servers and the real ingress: publishers
//! that batch and publishers that do not on one deployment, a batch held open across a
//! server restart, and a durable batch re-sent after its acknowledgement was lost. Every wait
//! is bounded; no assertion is about time.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use common::*;
use futures::StreamExt;
use lease_router::wire::{self, EventKind, Message, MessageLimits};
use lease_router::{ensure_stream, CatchUpState, JetStreamIngress, LeaseStreamConfig};
use lease_router::{ApplyConfig, DropReason, IngressFigures, IngressStats};
use lease_router::{Batching, LeasePublisher, PublisherConfig, Router, RouterConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::timeout;
use tokio_util::task::TaskTracker;

/// The bound of one whole test.
const TEST_BOUND: Duration = Duration::from_secs(120);
const NO_EXPIRY: Duration = Duration::from_secs(3600);
/// A linger no test outlives: batches leave only when full or flushed.
const FOREVER: Duration = Duration::from_secs(3600);

fn ids(prefix: &str, range: impl IntoIterator<Item = usize>) -> impl Iterator<Item = String> {
    let prefix = prefix.to_owned();
    range.into_iter().map(move |i| format!("{prefix}-{i}"))
}

/// Waits until the stats received `events` and the identity holds; the snapshot then.
async fn settled(stats: &Arc<IngressStats>, events: u64) -> IngressFigures {
    let reached = eventually(BOUND, || async {
        let s = stats.snapshot();
        s.received >= events && s.accounted() == s.received
    })
    .await;
    let s = stats.snapshot();
    assert!(reached, "expected {events} events received: {s:?}");
    s
}

// ---------------------------------------------------------------------------------------------
// A TCP proxy that can lose what the server says and refuse clients
// ---------------------------------------------------------------------------------------------

/// Between a client and the nats-server. It records what the client sends; once the client
/// sends an armed pattern, that connection's server-to-client direction goes silent (the
/// server still gets everything: an acknowledgement lost on the way back). `sever` drops
/// every connection; while shut, new connections are closed at once, so the client keeps
/// retrying until `open`.
struct Proxy {
    addr: SocketAddr,
    state: Arc<ProxyState>,
    accept: tokio::task::JoinHandle<()>,
}

struct ProxyState {
    upstream: SocketAddr,
    open: AtomicBool,
    /// Silences the server's side of the connection that sends this, once.
    armed: Mutex<Option<Vec<u8>>>,
    /// Everything the clients sent, in order.
    sent: Mutex<Vec<u8>>,
    pipes: Mutex<JoinSet<()>>,
}

impl Proxy {
    async fn start(upstream_url: &str) -> Proxy {
        let upstream = upstream_url
            .trim_start_matches("nats://")
            .parse()
            .expect("a socket address");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ProxyState {
            upstream,
            open: AtomicBool::new(true),
            armed: Mutex::new(None),
            sent: Mutex::new(Vec::new()),
            pipes: Mutex::new(JoinSet::new()),
        });
        let accept = tokio::spawn({
            let state = state.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    if !state.open.load(Ordering::Acquire) {
                        continue; // dropped: closed at once
                    }
                    let pipe = Self::connection(state.clone(), client);
                    state.pipes.lock().unwrap().spawn(pipe);
                }
            }
        });
        Proxy {
            addr,
            state,
            accept,
        }
    }

    fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// The connection that sends `pattern` next gets nothing more from the server.
    fn silence_server_after(&self, pattern: &[u8]) {
        *self.state.armed.lock().unwrap() = Some(pattern.to_vec());
    }

    fn is_armed(&self) -> bool {
        self.state.armed.lock().unwrap().is_some()
    }

    /// Drops every connection, and refuses new ones until [`Proxy::open`].
    fn shut(&self) {
        self.state.open.store(false, Ordering::Release);
        self.sever();
    }

    fn open(&self) {
        self.state.open.store(true, Ordering::Release);
    }

    /// Drops every connection (new ones are accepted if open).
    fn sever(&self) {
        self.state.pipes.lock().unwrap().abort_all();
    }

    /// How often the clients sent `pattern`.
    fn times_sent(&self, pattern: &[u8]) -> usize {
        let sent = self.state.sent.lock().unwrap();
        sent.windows(pattern.len())
            .filter(|w| *w == pattern)
            .count()
    }

    async fn connection(state: Arc<ProxyState>, client: TcpStream) {
        let Ok(server) = TcpStream::connect(state.upstream).await else {
            return;
        };
        let silent = Arc::new(AtomicBool::new(false));
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        let upstream = async {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                state.record(&buf[..n], &silent);
                if server_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let downstream = async {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match server_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if silent.load(Ordering::Acquire) {
                    continue;
                }
                if client_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        // Either side ending ends both: the client sees the connection close.
        tokio::select! {
            () = upstream => {}
            () = downstream => {}
        }
    }
}

impl ProxyState {
    /// Records bytes on their way to the server; silences the way back first if they
    /// complete the armed pattern, so nothing the server answers to them gets through.
    fn record(&self, bytes: &[u8], silent: &AtomicBool) {
        let mut sent = self.sent.lock().unwrap();
        let before = sent.len();
        sent.extend_from_slice(bytes);
        let mut armed = self.armed.lock().unwrap();
        if let Some(pattern) = armed.as_ref() {
            let from = before.saturating_sub(pattern.len());
            if sent[from..].windows(pattern.len()).any(|w| w == pattern) {
                silent.store(true, Ordering::Release);
                *armed = None;
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.sever();
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-made batches
// ---------------------------------------------------------------------------------------------

/// `{"v": v, "kind": "batch", "events": [...]}` of already encoded events.
fn batch_of(v: u64, events: &[Vec<u8>]) -> Vec<u8> {
    assert!(events.len() < 16);
    let mut out = Mp::default()
        .map(3)
        .str("v")
        .uint(v)
        .str("kind")
        .str("batch")
        .str("events")
        .bytes(&[0x90 | events.len() as u8]);
    for event in events {
        out = out.bytes(event);
    }
    out.0
}

/// Counts what a plain subscriber sees of one publisher's messages.
#[derive(Default, Debug)]
struct Seen {
    events: u64,
    batches: u64,
    batched_events: u64,
}

/// Subscribes to the deployment on its own connection (the server has the interest when this
/// returns) and counts the messages of `publisher_id` until `events` of its events arrived.
async fn watch(
    url: &str,
    deployment: &str,
    publisher_id: u64,
    events: u64,
) -> tokio::task::JoinHandle<Seen> {
    let conn = client(url).await;
    let mut sub = conn
        .client()
        .subscribe(subjects(deployment).deployment_filter())
        .await
        .unwrap();
    conn.client().flush().await.unwrap();
    tokio::spawn(async move {
        let _conn = conn;
        let mut seen = Seen::default();
        while seen.events < events {
            let msg = sub.next().await.expect("subscription open");
            match wire::decode_message(&msg.payload, MessageLimits::default()) {
                Message::Event(Ok(env)) if env.publisher_id == publisher_id => seen.events += 1,
                Message::Batch(mut events) => {
                    let n = events.len() as u64;
                    if events
                        .next()
                        .is_some_and(|e| e.is_ok_and(|e| e.publisher_id == publisher_id))
                    {
                        seen.events += n;
                        seen.batches += 1;
                        seen.batched_events += n;
                    }
                }
                _ => {}
            }
        }
        seen
    })
}

// ---------------------------------------------------------------------------------------------
// 1. Mixed publishers on one deployment
// ---------------------------------------------------------------------------------------------

/// A batching publisher, a plain one and hand-made batches (a bad event in the middle, two
/// unreadable ones, one over the router's batch limit) on one deployment: every event is
/// counted received once, applied or dropped for its own reason, batches are counted, and the
/// leases are exactly those admitted and not completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_publishers_on_one_deployment_end_with_exact_leases_and_counts() {
    timeout(TEST_BOUND, async {
        let server = server().await;
        let url = server.url();
        let deployment = "mixed";
        let router_conn = client(&url).await;
        let config = ApplyConfig {
            max_batch_bytes: 32 * 1024,
            ..ApplyConfig::default()
        };
        let h = router(&router_conn, deployment, NO_EXPIRY, config).await;
        let publisher_conn = client(&url).await;

        // The batching publisher: workers 1 and 2.
        let batching = LeasePublisher::start(
            publisher_conn.client().clone(),
            subjects(deployment),
            PublisherConfig::default().with_batching(Batching::default()),
        );
        const B: usize = 100;
        let b_events = (B + B + B / 2) as u64;
        let seen = watch(&url, deployment, batching.publisher_id(), b_events).await;
        for i in 0..B {
            let worker = 1 + (i % 2) as u64;
            batching
                .publish(admitted(&format!("b-{i}"), worker, 64))
                .unwrap();
            batching
                .publish(progressed(&format!("b-{i}"), worker))
                .unwrap();
            if i % 2 == 0 {
                batching
                    .publish(completed(&format!("b-{i}"), worker))
                    .unwrap();
            }
        }
        timeout(BOUND, batching.flush()).await.unwrap().unwrap();
        // Everything before the flush is on the server: all of it applied.
        let stats = h.stats.clone();
        let s = settled(&stats, b_events).await;
        assert_eq!(s.received, b_events, "{s:?}");
        assert_eq!(s.applied_total(), b_events, "{s:?}");
        let batching_stats = batching.stats();
        assert_eq!(batching_stats.published, b_events);
        assert!(batching_stats.batches > 0, "{batching_stats:?}");

        // The plain publisher: worker 3, one message per event.
        let plain = LeasePublisher::start(
            publisher_conn.client().clone(),
            subjects(deployment),
            PublisherConfig::default(),
        );
        for i in 0..50 {
            plain.publish(admitted(&format!("s-{i}"), 3, 32)).unwrap();
        }
        for i in 0..25 {
            plain.publish(completed(&format!("s-{i}"), 3)).unwrap();
        }
        let plain_stats = timeout(BOUND, plain.close()).await.unwrap().unwrap();
        assert_eq!((plain_stats.published, plain_stats.batches), (75, 0));

        // Hand-made batches: worker 4.
        let mut raw = RawPublisher::new(publisher_conn.client().clone(), deployment, 4242);
        let subject = raw.subjects.worker_subject(4);
        let enc = |env: &wire::Envelope| wire::encode(env).unwrap();
        // A: three admissions, canonical.
        let a: Vec<_> = (0..3)
            .map(|i| raw.envelope(admitted(&format!("r-{i}"), 4, 16)))
            .collect();
        raw.send_bytes(subject.clone(), wire::encode_batch(&a).unwrap())
            .await;
        // B: six events, three bad ones among them.
        let unknown_kind = Mp::default()
            .map(7)
            .str("v")
            .uint(1)
            .str("pub")
            .uint(4242)
            .str("seq")
            .uint(1000)
            .str("ts")
            .uint(1)
            .str("kind")
            .str("teleported")
            .str("rid")
            .str("r-x")
            .str("wid")
            .uint(4)
            .0;
        let r3 = raw.envelope(admitted("r-3", 4, 16));
        let other_worker = raw.envelope(admitted("forged", 5, 16));
        let r4 = raw.envelope(admitted("r-4", 4, 16));
        let nested = wire::encode_batch(&[raw.envelope(admitted("nested", 4, 16))]).unwrap();
        let done0 = raw.envelope(completed("r-0", 4));
        let b = batch_of(
            1,
            &[
                enc(&r3),
                unknown_kind,
                enc(&other_worker),
                enc(&r4),
                nested,
                enc(&done0),
            ],
        );
        raw.send_bytes(subject.clone(), b).await;
        // C1: four events, cut short: unreadable, one drop per declared event.
        let lost: Vec<_> = (0..4)
            .map(|i| raw.envelope(admitted(&format!("cut-{i}"), 4, 16)))
            .collect();
        let mut c1 = wire::encode_batch(&lost).unwrap();
        c1.truncate(c1.len() - 3);
        raw.send_bytes(subject.clone(), c1).await;
        // C2: a batch of another version, two events.
        let newer: Vec<_> = (0..2)
            .map(|i| enc(&raw.envelope(admitted(&format!("v2-{i}"), 4, 16))))
            .collect();
        raw.send_bytes(subject.clone(), batch_of(2, &newer)).await;
        // A plain 1.0 message among the batches.
        raw.send(admitted("r-5", 4, 16)).await;
        // Over the router's 32 KiB batch limit: dropped unread, once.
        let big: Vec<_> = (0..600)
            .map(|i| raw.envelope(admitted(&format!("big-{i}"), 4, 16)))
            .collect();
        let big = wire::encode_batch(&big).unwrap();
        assert!(big.len() > 32 * 1024);
        raw.send_bytes(subject.clone(), big).await;
        raw.flush().await;

        let raw_events = 3 + 6 + 4 + 2 + 1 + 1;
        let total = b_events + 75 + raw_events;
        let s = settled(&stats, total).await;
        assert_eq!(s.received, total, "{s:?}");
        assert_eq!(s.held, 0, "{s:?}");
        assert_eq!(
            s.applied(EventKind::Admitted),
            B as u64 + 50 + 3 + 2 + 1,
            "{s:?}"
        );
        assert_eq!(s.applied(EventKind::Progressed), B as u64, "{s:?}");
        assert_eq!(
            s.applied(EventKind::Completed),
            B as u64 / 2 + 25 + 1,
            "{s:?}"
        );
        assert_eq!(s.applied(EventKind::WorkerReset), 0, "{s:?}");
        let dropped: Vec<_> = s.dropped.iter().filter(|(_, n)| *n > 0).copied().collect();
        assert_eq!(
            dropped,
            [
                (DropReason::Oversized.as_str(), 1),
                (DropReason::Decode.as_str(), 1 + 4),
                (DropReason::Version.as_str(), 2),
                (DropReason::UnknownKind.as_str(), 1),
                (DropReason::Identity.as_str(), 1),
            ],
            "{s:?}"
        );
        assert_eq!(s.applied_total() + s.dropped_total() + s.held, s.received);
        assert_eq!(s.gaps, 0, "{s:?}");

        // Batches: the publisher's (as a plain subscriber saw them) and the four hand-made
        // ones that fit the limit; the plain publisher sent none.
        let seen = timeout(BOUND, seen).await.unwrap().unwrap();
        assert_eq!(seen.events, b_events);
        assert_eq!(seen.batches, batching_stats.batches, "{seen:?}");
        assert_eq!(s.batches, seen.batches + 4, "{s:?} {seen:?}");
        assert_eq!(
            s.batched_events,
            seen.batched_events + 3 + 6 + 4 + 2,
            "{s:?} {seen:?}"
        );

        let expected: HashSet<String> = ids("b", (1..B).step_by(2))
            .chain(ids("s", 25..50))
            .chain(ids("r", 1..6))
            .collect();
        assert_eq!(live_ids(&h.router), expected);
        let final_stats = timeout(BOUND, batching.close()).await.unwrap().unwrap();
        assert_eq!(final_stats.published, b_events);
        assert_eq!(final_stats.failed, 0);
    })
    .await
    .expect("test timed out");
}

// ---------------------------------------------------------------------------------------------
// 2. A batch across a server restart
// ---------------------------------------------------------------------------------------------

/// A batch opened before the server dies, filled and sent while it is down, delivered after
/// it is back; the router reconnects too. The publisher's connection is held off (through a
/// proxy) until the router's subscription is routed again, so nothing sent meanwhile can miss
/// it: every event is applied exactly once, none lost, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_open_across_a_server_restart_is_applied_once() {
    timeout(TEST_BOUND, async {
        let mut server = server().await;
        let url = server.url();
        let deployment = "restart";
        let router_conn = fast_client(&url, "router").await;
        let h = router(&router_conn, deployment, NO_EXPIRY, ApplyConfig::default()).await;
        let stats = h.stats.clone();
        let proxy = Proxy::start(&url).await;
        let publisher_conn = fast_client(&proxy.url(), "publisher").await;
        const MAX_EVENTS: usize = 32;
        let publisher = LeasePublisher::start(
            publisher_conn.client().clone(),
            subjects(deployment),
            PublisherConfig::default().with_batching(Batching {
                linger: FOREVER,
                max_events: MAX_EVENTS,
                ..Batching::default()
            }),
        );
        let workers = 1..=4u64;

        // Before: long-lived leases, and short ones that end.
        for w in workers.clone() {
            publisher
                .publish(admitted(&format!("long-{w}"), w, 64))
                .unwrap();
        }
        for i in 0..20 {
            let w = 1 + i as u64 % 4;
            publisher
                .publish(admitted(&format!("x-{i}"), w, 8))
                .unwrap();
            publisher.publish(completed(&format!("x-{i}"), w)).unwrap();
        }
        timeout(BOUND, publisher.flush()).await.unwrap().unwrap();
        let mut expected_events = 4 + 40;
        settled(&stats, expected_events).await;
        assert_eq!(live_ids(&h.router), ids("long", 1..=4).collect());

        // Open batches: in the publisher, not yet sent.
        for w in workers.clone() {
            for i in 0..5 {
                publisher
                    .publish(admitted(&format!("open-{w}-{i}"), w, 8))
                    .unwrap();
            }
        }
        expected_events += 20;

        // The server goes away; the publisher cannot come back until told.
        proxy.shut();
        server.kill().await;
        let down = eventually(BOUND, || async {
            !publisher_conn.is_connected() && !router_conn.is_connected()
        })
        .await;
        assert!(down, "both connections see the server gone");

        // While it is down: each open batch fills up and goes to the client (which buffers
        // it), a flush sends the rest, more batches open after it.
        for w in workers.clone() {
            for i in 0..40 {
                publisher
                    .publish(admitted(&format!("out-{w}-{i}"), w, 8))
                    .unwrap();
            }
        }
        let flush_while_down = tokio::spawn({
            let publisher = publisher.clone();
            async move { publisher.flush().await }
        });
        expected_events += 4 * 40;
        // Only the flush sends the batches that did not fill up: once they are counted, the
        // flush was taken, and what follows opens new batches.
        let sent_while_down = eventually(BOUND, || async {
            publisher.stats().published == expected_events
        })
        .await;
        assert!(
            sent_while_down,
            "the full and the flushed batches went to the client while the server was down: \
             {:?}",
            publisher.stats()
        );
        for w in workers.clone() {
            for i in 0..10 {
                publisher
                    .publish(admitted(&format!("after-{w}-{i}"), w, 8))
                    .unwrap();
            }
        }
        expected_events += 4 * 10;
        assert!(!publisher_conn.is_connected());

        server.restart().await.expect("restarts on the same port");
        // The router's connection is back and its subscription routed: a probe subscribed
        // on the same connection after the resubscription is delivered.
        let reconnected = eventually(BOUND, || async {
            router_conn.stats().reconnects() >= 1 && router_conn.is_connected()
        })
        .await;
        assert!(reconnected, "the router reconnects");
        let probe_subject = format!("probe.{}", rand::random::<u64>());
        let mut probe = router_conn
            .client()
            .subscribe(probe_subject.clone())
            .await
            .unwrap();
        let prober = client(&url).await;
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            let _ = prober
                .client()
                .publish(probe_subject.clone(), "probe".into())
                .await;
            let _ = prober.client().flush().await;
            if timeout(Duration::from_millis(100), probe.next())
                .await
                .is_ok()
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the router's subscription is routed again"
            );
        }
        assert_eq!(stats.snapshot().received, 4 + 40, "nothing arrived before");

        // Now the publisher: what it buffered goes out.
        proxy.open();
        timeout(BOUND, flush_while_down)
            .await
            .expect("the flush started while down ends once reconnected")
            .unwrap()
            .expect("and succeeds");
        for w in workers.clone() {
            publisher
                .publish(completed(&format!("long-{w}"), w))
                .unwrap();
        }
        expected_events += 4;
        let publisher_stats = timeout(BOUND, publisher.close()).await.unwrap().unwrap();
        assert_eq!(publisher_stats.queued, expected_events);
        assert_eq!(
            publisher_stats.published, expected_events,
            "{publisher_stats:?}"
        );
        assert_eq!(publisher_stats.failed, 0, "{publisher_stats:?}");
        assert!(publisher_stats.batches > 0);

        let s = settled(&stats, expected_events).await;
        assert_eq!(
            s.received, expected_events,
            "every event arrived once: {s:?}"
        );
        assert_eq!(s.applied_total(), expected_events, "{s:?}");
        assert_eq!(s.dropped_total(), 0, "none twice: {s:?}");
        assert_eq!((s.held, s.gaps), (0, 0), "{s:?}");
        assert_eq!(s.batches, publisher_stats.batches, "{s:?}");
        assert!(publisher_conn.stats().reconnects() >= 1);

        let expected: HashSet<String> = workers
            .flat_map(|w| {
                ids(&format!("open-{w}"), 0..5)
                    .chain(ids(&format!("out-{w}"), 0..40))
                    .chain(ids(&format!("after-{w}"), 0..10))
            })
            .collect();
        assert_eq!(
            live_ids(&h.router),
            expected,
            "the long leases were released"
        );
    })
    .await
    .expect("test timed out");
}

// ---------------------------------------------------------------------------------------------
// 3. A durable batch whose acknowledgement is lost
// ---------------------------------------------------------------------------------------------

/// A durable publisher's batch reaches JetStream but its acknowledgement never comes back
/// (the proxy silences the server from the publish on, then drops the connection). The sink
/// re-sends the same bytes under the same `Nats-Msg-Id` after reconnecting: the stream keeps
/// the batch once and a durable router applies each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_batch_resent_after_a_lost_ack_is_stored_and_applied_once() {
    timeout(TEST_BOUND, async {
        let server = js_server().await;
        let url = server.url();
        let deployment = "lost-ack";
        let conn = client(&url).await;
        let js = jetstream::new(conn.client().clone());
        let mut stream = ensure_stream(&js, &LeaseStreamConfig::new(), &subjects(deployment))
            .await
            .expect("the stream");

        let proxy = Proxy::start(&url).await;
        let publisher_conn = fast_client(&proxy.url(), "durable publisher").await;
        let publisher = LeasePublisher::start_durable(
            publisher_conn.client().clone(),
            subjects(deployment),
            PublisherConfig::default().with_batching(Batching {
                linger: FOREVER,
                ..Batching::default()
            }),
            16,
        );
        const N: u64 = 10;
        let msg_id = format!("Nats-Msg-Id: {}-1-{N}\r\n", publisher.publisher_id());
        proxy.silence_server_after(msg_id.as_bytes());
        for i in 0..N {
            if i < 6 {
                publisher
                    .publish(admitted(&format!("d-{i}"), 1, 16))
                    .unwrap();
            } else {
                publisher
                    .publish(completed(&format!("d-{}", i - 6), 1))
                    .unwrap();
            }
        }
        let flush = tokio::spawn({
            let publisher = publisher.clone();
            async move { publisher.flush().await }
        });
        // The batch is stored; its acknowledgement is not getting through.
        let deadline = tokio::time::Instant::now() + BOUND;
        while stream.info().await.unwrap().state.messages == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the batch reaches the stream"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            !proxy.is_armed(),
            "the way back was silenced before the publish passed"
        );
        proxy.sever();
        timeout(Duration::from_secs(60), flush)
            .await
            .expect("the flush ends once the re-sent batch is acknowledged")
            .unwrap()
            .expect("and succeeds");
        assert_eq!(
            stream.info().await.unwrap().state.messages,
            1,
            "stored once"
        );
        assert!(
            proxy.times_sent(msg_id.as_bytes()) >= 2,
            "the batch was sent again under its id"
        );
        let publisher_stats = timeout(BOUND, publisher.close()).await.unwrap().unwrap();
        assert_eq!(
            (
                publisher_stats.published,
                publisher_stats.batches,
                publisher_stats.failed
            ),
            (N, 1, 0),
            "{publisher_stats:?}"
        );

        // A durable router reads the stream: each event once.
        let stats = Arc::new(IngressStats::new());
        let ingress = JetStreamIngress::new(
            conn.client().clone(),
            subjects(deployment),
            LeaseStreamConfig::new(),
            ApplyConfig::default(),
            stats.clone(),
            Arc::new(CatchUpState::new()),
        );
        let router = Router::start_tracked(
            RouterConfig::new(deployment).with_scan_interval(NO_EXPIRY),
            ingress,
            TaskTracker::new(),
        )
        .await
        .expect("durable router starts");
        let s = settled(&stats, N).await;
        assert_eq!(s.received, N, "{s:?}");
        assert_eq!((s.batches, s.batched_events), (1, N), "{s:?}");
        assert_eq!(s.applied(EventKind::Admitted), 6, "{s:?}");
        assert_eq!(s.applied(EventKind::Completed), 4, "{s:?}");
        assert_eq!(s.dropped(DropReason::Duplicate), 0, "{s:?}");
        assert_eq!(s.dropped_total(), 0, "{s:?}");
        assert_eq!(live_ids(&router), ids("d", 4..6).collect());
    })
    .await
    .expect("test timed out");
}
