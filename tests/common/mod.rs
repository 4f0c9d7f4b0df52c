//! Shared by the integration tests: a real nats-server, a router fed by it, raw publishing,
//! and bounded waiting.
#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lease_router::wire::{self, Admitted, Completed, Envelope, LeaseEvent, Outcome, Progressed};
use lease_router::IngressStats;
use lease_router::RetryPolicy;
use lease_router::{connect, NatsConnectConfig, NatsConnection};
use lease_router::{ApplyConfig, NatsIngress};
use lease_router::{DeploymentName, Subjects};
use lease_router::{Router, RouterConfig};
use lease_router_testkit::{NatsServer, NatsServerBuilder};
use std::collections::HashSet;
use tokio_util::task::TaskTracker;

pub const BOUND: Duration = Duration::from_secs(20);

/// Logs of the code under test, shown for failing tests (`RUST_LOG` filters them).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
}

/// A nats-server of the test's own on a free port. The tests need one: a missing
/// `nats-server` fails them with the install hint rather than skipping them.
pub async fn server() -> NatsServer {
    init_tracing();
    NatsServerBuilder::new()
        .spawn()
        .await
        .expect("nats-server starts (is it on PATH?)")
}

/// A nats-server with JetStream, for durable mode.
pub async fn js_server() -> NatsServer {
    init_tracing();
    NatsServerBuilder::new()
        .jetstream(true)
        .spawn()
        .await
        .expect("nats-server with JetStream starts")
}

pub async fn client(url: &str) -> NatsConnection {
    connect(&NatsConnectConfig::new([url]).with_connect_deadline(Duration::from_secs(10)))
        .await
        .expect("connects")
}

/// A connection whose subscriptions buffer up to `capacity` messages.
pub async fn client_with_capacity(url: &str, capacity: usize) -> NatsConnection {
    let config = NatsConnectConfig::new([url])
        .with_connect_deadline(Duration::from_secs(10))
        .with_subscription_capacity(capacity);
    connect(&config).await.expect("connects")
}

pub fn subjects(deployment: &str) -> Subjects {
    Subjects::with_default_prefix(DeploymentName::new(deployment).unwrap())
}

/// A router for `deployment` whose ingress subscribes over `connection`.
pub struct Harness {
    pub router: Router,
    pub stats: Arc<IngressStats>,
    pub tracker: TaskTracker,
}

pub async fn router(
    connection: &NatsConnection,
    deployment: &str,
    scan_interval: Duration,
    config: ApplyConfig,
) -> Harness {
    let stats = Arc::new(IngressStats::new());
    let tracker = TaskTracker::new();
    let ingress = NatsIngress::new(
        connection.client().clone(),
        subjects(deployment),
        config,
        stats.clone(),
    );
    let router = Router::start_tracked(
        RouterConfig::new(deployment).with_scan_interval(scan_interval),
        ingress,
        tracker.clone(),
    )
    .await
    .expect("router starts");
    Harness {
        router,
        stats,
        tracker,
    }
}

/// Publishes envelopes as a worker would, with full control of ids and sequence numbers.
pub struct RawPublisher {
    pub client: async_nats::Client,
    pub subjects: Subjects,
    pub publisher_id: u64,
    pub next_seq: u64,
}

impl RawPublisher {
    pub fn new(client: async_nats::Client, deployment: &str, publisher_id: u64) -> Self {
        Self {
            client,
            subjects: subjects(deployment),
            publisher_id,
            next_seq: 1,
        }
    }

    pub fn envelope(&mut self, event: impl Into<LeaseEvent>) -> Envelope {
        let seq = self.next_seq;
        self.next_seq += 1;
        Envelope::new(self.publisher_id, seq, wire::unix_micros_now(), event)
    }

    pub async fn send(&mut self, event: impl Into<LeaseEvent>) {
        let envelope = self.envelope(event);
        self.send_envelope(&envelope).await;
    }

    pub async fn send_envelope(&self, envelope: &Envelope) {
        let subject = self.subjects.worker_subject(envelope.event.worker_id());
        let bytes = wire::encode(envelope).expect("encodes");
        self.send_bytes(subject, bytes).await;
    }

    pub async fn send_bytes(&self, subject: String, bytes: Vec<u8>) {
        self.client
            .publish(subject, Bytes::from(bytes))
            .await
            .expect("publish");
    }

    pub async fn flush(&self) {
        self.client.flush().await.expect("flush");
    }
}

pub fn admitted(request_id: &str, worker_id: u64, prompt_tokens: u32) -> Admitted {
    Admitted {
        block_hashes: Vec::new(),
        block_capacity: None,
        class: None,
        request_id: request_id.to_string(),
        worker_id,
        dp_rank: 0,
        prompt_tokens,
        expected_output_tokens: Some(16),
        cached_tokens: None,
    }
}

pub fn progressed(request_id: &str, worker_id: u64) -> Progressed {
    Progressed {
        request_id: request_id.to_string(),
        worker_id,
        dp_rank: 0,
        stage: wire::ProgressStage::Decoding,
        output_tokens: 1,
    }
}

pub fn completed(request_id: &str, worker_id: u64) -> Completed {
    Completed {
        request_id: request_id.to_string(),
        worker_id,
        dp_rank: 0,
        outcome: Outcome::Finished,
    }
}

/// Polls `check` until it holds or `bound` passes; returns whether it held.
pub async fn eventually<F, Fut>(bound: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A MessagePack writer that spells encodings out: for payloads the encoder never produces
/// (another version, unknown kinds, ints of other widths, wrong types) and for byte-exact
/// layouts. Builds by value; `.0` is the bytes.
#[derive(Default)]
pub struct Mp(pub Vec<u8>);

impl Mp {
    /// A map header of `len` entries (fixmap).
    pub fn map(mut self, len: u8) -> Self {
        assert!(len < 16);
        self.0.push(0x80 | len);
        self
    }

    /// A string of fewer than 32 bytes (fixstr).
    pub fn str(mut self, s: &str) -> Self {
        assert!(s.len() < 32);
        self.0.push(0xa0 | s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    /// An unsigned int in its smallest width, as the encoder writes it.
    pub fn uint(mut self, v: u64) -> Self {
        rmp::encode::write_uint(&mut self.0, v).unwrap();
        self
    }

    /// An unsigned int at full width (`0xcf`), as Go writes `uint64` fields.
    pub fn uint64(self, v: u64) -> Self {
        let mut out = self.bytes(&[0xcf]);
        out.0.extend_from_slice(&v.to_be_bytes());
        out
    }

    /// Raw bytes: any other encoding, written out by hand.
    pub fn bytes(mut self, raw: &[u8]) -> Self {
        self.0.extend_from_slice(raw);
        self
    }
}

/// A connection through the crate's own `connect`, with fast reconnects, so a server restart
/// does not wait for the production backoff.
pub async fn fast_client(url: &str, name: &str) -> NatsConnection {
    let config = NatsConnectConfig::new([url])
        .with_name(name)
        .with_connect_deadline(Duration::from_secs(10))
        .with_reconnect(
            RetryPolicy::new()
                .with_initial(Duration::from_millis(20))
                .with_max_interval(Duration::from_millis(200)),
        );
    connect(&config).await.expect("connects")
}

/// The request ids of the router's live leases.
pub fn live_ids(router: &Router) -> HashSet<String> {
    router
        .manager()
        .leases(usize::MAX)
        .into_iter()
        .map(|l| l.booking.request_id.as_str().to_string())
        .collect()
}

/// Each candidate of `decision` with its overlap, ordered by worker.
pub fn overlaps(
    decision: &lease_router::RouteDecision,
) -> Vec<(lease_router::WorkerWithDpRank, u32)> {
    let mut v: Vec<_> = decision
        .candidates
        .iter()
        .map(|c| (c.worker, c.overlap_blocks))
        .collect();
    v.sort();
    v
}
