//! `LeasePublisher` against real `nats-server` processes (each test starts its own on a free
//! port; the system server on 4222 is never used). Every wait is bounded. Without
//! `nats-server` they fail with the install hint.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use lease_router::wire::{self, Envelope, LeaseEvent, Outcome, ProgressStage};
use lease_router::{DeploymentName, SubjectPrefix, Subjects};
use lease_router::{LeasePublisher, PublishEventError, PublisherConfig};
use tokio::time::timeout;

/// The bound of one whole test.
const TEST_BOUND: Duration = Duration::from_secs(90);
/// The bound of one step inside a test.
const STEP: Duration = Duration::from_secs(20);

fn subjects(deployment: &str) -> Subjects {
    Subjects::new(
        SubjectPrefix::new("pubtest").unwrap(),
        DeploymentName::new(deployment).unwrap(),
    )
}

/// A raw subscriber on `prefix.deployment.>`, with its own connection.
struct Watcher {
    client: async_nats::Client,
    sub: async_nats::Subscriber,
    subjects: Subjects,
}

impl Watcher {
    async fn new(url: &str, subjects: &Subjects) -> Watcher {
        let client = async_nats::ConnectOptions::new()
            .name("publisher test watcher")
            .reconnect_delay_callback(|_| Duration::from_millis(20))
            .connect(url)
            .await
            .expect("watcher connects");
        let sub = client
            .subscribe(subjects.deployment_filter())
            .await
            .unwrap();
        Watcher {
            client,
            sub,
            subjects: subjects.clone(),
        }
    }

    /// Returns once the server routes what `publisher` sends to this watcher: a fresh probe
    /// subscription on the watcher's connection (ordered after its other subscriptions, also
    /// after the ones a reconnect sends again) receives a probe sent by `publisher`.
    async fn wait_routed(&self, publisher: &async_nats::Client) {
        let probe = format!("pubtest-probe.{}", rand::random::<u64>());
        let mut sub = self.client.subscribe(probe.clone()).await.unwrap();
        timeout(STEP, async {
            loop {
                let _ = publisher.publish(probe.clone(), "probe".into()).await;
                let _ = timeout(Duration::from_millis(200), publisher.flush()).await;
                if let Ok(Some(_)) = timeout(Duration::from_millis(200), sub.next()).await {
                    return;
                }
            }
        })
        .await
        .expect("the watcher's subscription is routed");
        let _ = sub.unsubscribe().await;
    }

    /// Receives and decodes `n` events, checking that each subject names the body's worker.
    async fn take(&mut self, n: usize) -> Vec<Envelope> {
        let mut out = Vec::with_capacity(n);
        let result = timeout(STEP, async {
            while out.len() < n {
                let msg = self.sub.next().await.expect("subscription open");
                let env =
                    wire::decode(&msg.payload, wire::DEFAULT_MAX_EVENT_BYTES).expect("decodes");
                assert_eq!(
                    self.subjects.parse_worker(msg.subject.as_str()),
                    Some(env.event.worker_id()),
                    "subject {} vs body {:?}",
                    msg.subject,
                    env.event
                );
                out.push(env);
            }
        })
        .await;
        assert!(result.is_ok(), "received {} of {n} events", out.len());
        out
    }

    /// Receives until `done` holds for the events so far, at most `within`.
    async fn take_until(
        &mut self,
        within: Duration,
        done: impl Fn(&[Envelope]) -> bool,
    ) -> Vec<Envelope> {
        let mut out = Vec::new();
        let _ = timeout(within, async {
            while !done(&out) {
                let Some(msg) = self.sub.next().await else {
                    return;
                };
                out.push(wire::decode(&msg.payload, wire::DEFAULT_MAX_EVENT_BYTES).unwrap());
            }
        })
        .await;
        out
    }
}

/// Event number `i` of a stream over 4 workers, of every kind in turn.
fn event(i: u64) -> LeaseEvent {
    let worker_id = i % 4;
    let request_id = format!("req-{i}");
    let dp_rank = (i % 2) as u32;
    match i % 4 {
        0 => wire::Admitted {
            block_hashes: Vec::new(),
            block_capacity: None,
            class: None,
            request_id,
            worker_id,
            dp_rank,
            prompt_tokens: 100,
            expected_output_tokens: Some(10),
            cached_tokens: None,
        }
        .into(),
        1 => wire::Progressed {
            request_id,
            worker_id,
            dp_rank,
            stage: ProgressStage::Decoding,
            output_tokens: 3,
        }
        .into(),
        2 => wire::Completed {
            request_id,
            worker_id,
            dp_rank,
            outcome: Outcome::Finished,
        }
        .into(),
        _ => wire::WorkerReset {
            worker_id,
            dp_rank: None,
            leaving: false,
        }
        .into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_in_order_and_numbered() {
    common::init_tracing();
    timeout(TEST_BOUND, async {
        let server = common::server().await;
        let subjects = subjects("order");
        let mut watcher = Watcher::new(&server.url(), &subjects).await;
        let conn = common::fast_client(&server.url(), "publisher order").await;
        watcher.wait_routed(conn.client()).await;

        let publisher = LeasePublisher::start(
            conn.client().clone(),
            subjects.clone(),
            PublisherConfig::default(),
        );
        for i in 0..1_000 {
            publisher.publish(event(i)).unwrap();
        }
        let got = watcher.take(1_000).await;
        for (i, env) in got.iter().enumerate() {
            assert_eq!(env.sequence, i as u64 + 1, "in order, from 1");
            assert_eq!(env.publisher_id, publisher.publisher_id());
            assert_eq!(env.event, event(i as u64));
            assert!(env.published_at_us > 0);
        }
        let stats = timeout(STEP, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.queued, 1_000);
        assert_eq!(stats.published, 1_000);
        assert_eq!(
            (stats.failed, stats.dropped_queue_full, stats.pending()),
            (0, 0, 0)
        );
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_never_blocks_the_caller() {
    common::init_tracing();
    timeout(TEST_BOUND, async {
        let mut server = common::server().await;
        // A one-command client buffer: while disconnected, the client's second publish waits,
        // so the publisher task stalls for real with at most one event handed over.
        let client = async_nats::ConnectOptions::new()
            .client_capacity(1)
            .reconnect_delay_callback(|_| Duration::from_millis(20))
            .connect(server.url())
            .await
            .unwrap();
        let publisher = LeasePublisher::start(
            client.clone(),
            subjects("full"),
            PublisherConfig::default().with_queue_capacity(4),
        );

        server.kill().await;
        timeout(STEP, async {
            while client.connection_state() != async_nats::connection::State::Disconnected {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the client sees the server gone");

        // On a blocking thread, so that the timeout can fire even if `publish` blocked.
        const ATTEMPTED: u64 = 10_000;
        let handle = publisher.clone();
        let (accepted, full) = timeout(
            STEP,
            tokio::task::spawn_blocking(move || {
                let (mut accepted, mut full) = (0u64, 0u64);
                for i in 0..ATTEMPTED {
                    match handle.publish(event(i)) {
                        Ok(()) => accepted += 1,
                        Err(PublishEventError::QueueFull) => full += 1,
                        Err(other) => panic!("unexpected {other}"),
                    }
                }
                (accepted, full)
            }),
        )
        .await
        .expect("publishing never blocks")
        .unwrap();
        assert!(full > 0, "the queue filled up");
        assert_eq!(accepted + full, ATTEMPTED);
        let stalled = publisher.stats();
        assert_eq!(stalled.dropped_queue_full, full);
        assert_eq!(stalled.queued, accepted);
        assert!(stalled.published <= 1, "{stalled:?}");
        assert!(stalled.pending() >= 3, "the task is stalled: {stalled:?}");
        // While the server is away nothing can be flushed.
        assert!(
            timeout(Duration::from_millis(300), publisher.flush())
                .await
                .is_err(),
            "flush completed without a server"
        );

        server.restart().await.unwrap();
        let stats = timeout(STEP, publisher.close())
            .await
            .expect("close completes once the server is back")
            .unwrap();
        assert_eq!(stats.pending(), 0, "{stats:?}");
        assert_eq!(
            stats.published + stats.dropped_queue_full + stats.failed + stats.pending(),
            ATTEMPTED,
            "{stats:?}"
        );
        assert_eq!(stats.dropped_queue_full, full);
        assert_eq!(stats.attempted(), ATTEMPTED);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_and_close_deliver_everything() {
    common::init_tracing();
    timeout(TEST_BOUND, async {
        let server = common::server().await;
        let subjects = subjects("flush");
        let mut watcher = Watcher::new(&server.url(), &subjects).await;
        let conn = common::fast_client(&server.url(), "publisher flush").await;
        watcher.wait_routed(conn.client()).await;
        let publisher = LeasePublisher::start(
            conn.client().clone(),
            subjects.clone(),
            PublisherConfig::default(),
        );

        for i in 0..500 {
            publisher.publish(event(i)).unwrap();
        }
        timeout(STEP, publisher.flush()).await.unwrap().unwrap();
        let after_flush = publisher.stats();
        assert_eq!(after_flush.published, 500, "flush waited for the task");
        let got = watcher.take(500).await;
        assert_eq!(got.last().unwrap().sequence, 500);

        for i in 500..800 {
            publisher.publish(event(i)).unwrap();
        }
        let stats = timeout(STEP, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.queued, 800);
        assert_eq!(stats.published, stats.queued);
        assert_eq!(stats.pending(), 0);
        let got = watcher.take(300).await;
        let sequences: Vec<u64> = got.iter().map(|e| e.sequence).collect();
        assert_eq!(sequences, (501..=800).collect::<Vec<_>>());
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_a_server_restart() {
    common::init_tracing();
    timeout(TEST_BOUND, async {
        let mut server = common::server().await;
        let port = server.port();
        let subjects = subjects("restart");
        let mut watcher = Watcher::new(&server.url(), &subjects).await;
        let conn = common::fast_client(&server.url(), "publisher restart").await;
        watcher.wait_routed(conn.client()).await;
        let publisher = LeasePublisher::start(
            conn.client().clone(),
            subjects.clone(),
            PublisherConfig::default(),
        );

        // Before: delivered.
        for i in 0..200 {
            publisher.publish(event(i)).unwrap();
        }
        timeout(STEP, publisher.flush()).await.unwrap().unwrap();
        let before = watcher.take(200).await;
        assert_eq!(before.last().unwrap().sequence, 200);

        // During: the client buffers, or loses what was in the broken socket.
        server.kill().await;
        for i in 200..400 {
            publisher.publish(event(i)).unwrap();
        }
        server.restart().await.unwrap();
        assert_eq!(server.port(), port);
        // Both connections are back and the watcher's subscription is routed again.
        watcher.wait_routed(conn.client()).await;

        // After: every event arrives.
        for i in 400..700 {
            publisher.publish(event(i)).unwrap();
        }
        timeout(STEP, publisher.flush())
            .await
            .expect("flush works again")
            .unwrap();
        // Event i has sequence i + 1 (a sequence number is spent even on a lost event).
        let got = watcher
            .take_until(STEP, |got| got.last().is_some_and(|e| e.sequence >= 700))
            .await;
        let after: Vec<&Envelope> = got.iter().filter(|e| e.sequence > 400).collect();
        let sequences: Vec<u64> = after.iter().map(|e| e.sequence).collect();
        assert_eq!(
            sequences,
            (401..=700).collect::<Vec<_>>(),
            "every event after the restart arrived, in order"
        );
        for env in &after {
            assert_eq!(env.event, event(env.sequence - 1));
        }
        // Whatever arrived of the ones during the outage is in order, no duplicate.
        let mut all: Vec<u64> = got.iter().map(|e| e.sequence).collect();
        let len = all.len();
        all.dedup();
        assert_eq!(all.len(), len);
        assert!(all.windows(2).all(|w| w[0] < w[1]));

        let stats = timeout(STEP, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.queued, 700);
        assert_eq!(stats.published + stats.failed, 700, "{stats:?}");
        assert_eq!(stats.dropped_queue_full, 0);
        assert_eq!(stats.pending(), 0);
        assert!(conn.stats().reconnects() >= 1);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_publishers_number_separately() {
    common::init_tracing();
    timeout(TEST_BOUND, async {
        let server = common::server().await;
        let subjects = subjects("two");
        let mut watcher = Watcher::new(&server.url(), &subjects).await;
        let conn = common::fast_client(&server.url(), "publisher two").await;
        watcher.wait_routed(conn.client()).await;
        let a = LeasePublisher::start(
            conn.client().clone(),
            subjects.clone(),
            PublisherConfig::default(),
        );
        let b = LeasePublisher::start(
            conn.client().clone(),
            subjects.clone(),
            PublisherConfig::default(),
        );
        assert_ne!(a.publisher_id(), b.publisher_id());
        for i in 0..300 {
            a.admitted(format!("a-{i}"), 1, 0, 10, None).unwrap();
            if i < 200 {
                b.completed(format!("b-{i}"), 2, 0, Outcome::Cancelled)
                    .unwrap();
            }
        }
        let got = watcher.take(500).await;
        let mut by_publisher: HashMap<u64, Vec<u64>> = HashMap::new();
        for env in &got {
            by_publisher
                .entry(env.publisher_id)
                .or_default()
                .push(env.sequence);
        }
        assert_eq!(by_publisher.len(), 2);
        assert_eq!(
            by_publisher[&a.publisher_id()],
            (1..=300).collect::<Vec<_>>()
        );
        assert_eq!(
            by_publisher[&b.publisher_id()],
            (1..=200).collect::<Vec<_>>()
        );
        let (sa, sb) = (
            timeout(STEP, a.close()).await.unwrap().unwrap(),
            timeout(STEP, b.close()).await.unwrap().unwrap(),
        );
        assert_eq!((sa.published, sb.published), (300, 200));
    })
    .await
    .expect("test timed out");
}
