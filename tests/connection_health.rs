//! Connection health under the faults a real network makes, against a real `nats-server`:
//! a silent partition (a TCP proxy in the test that stops forwarding without closing a
//! socket) and a router too slow for the server (cut off as a slow consumer). The health
//! endpoints and metrics are read through the service's axum router in process. Every wait
//! is bounded; the one timed assertion is the bound the service promises (a silent partition
//! is seen within 15 s).

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use common::RawPublisher;
use lease_router::service::{router, ApiState, DeploymentHost, HostSettings};
use lease_router::DEFAULT_PING_INTERVAL;
use lease_router::{connect, ApplyConfig, DeploymentName, NatsConnectConfig, RetryPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

/// What the issue asks: a silent partition turns `/healthz` to 503 within this.
const PARTITION_SEEN_WITHIN: Duration = Duration::from_secs(15);
/// Generous bound of the reconnect after the heal (a connect attempt caught by the partition
/// waits for its 5 s connection timeout).
const RECONNECT_WITHIN: Duration = Duration::from_secs(30);
/// Durable mode: requests admitted during the partition that are still live after it.
const LONG_LIVED: usize = 20;
/// The lease scan interval of both routers: a lease dies 1-2 s after its last touch.
const SCAN: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// A black-hole proxy
// ---------------------------------------------------------------------------------------------

/// A TCP proxy that can stop forwarding, in both directions, without closing anything: what
/// a partition or a dead middlebox looks like to both ends. Connections accepted while cut
/// wait (no upstream connection, no bytes) until the heal.
struct BlackHole {
    addr: SocketAddr,
    open: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl BlackHole {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (open, _) = watch::channel(true);
        let mut tasks = JoinSet::new();
        let gate = open.clone();
        tasks.spawn(async move {
            let mut pipes = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let gate = gate.subscribe();
                pipes.spawn(Self::forward(client, upstream, gate));
            }
        });
        Self { addr, open, tasks }
    }

    fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    fn cut(&self) {
        self.open.send_replace(false);
    }

    fn heal(&self) {
        self.open.send_replace(true);
    }

    async fn forward(client: TcpStream, upstream: SocketAddr, mut gate: watch::Receiver<bool>) {
        if gate.wait_for(|open| *open).await.is_err() {
            return;
        }
        let Ok(server) = TcpStream::connect(upstream).await else {
            return;
        };
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = server.into_split();
        tokio::join!(
            Self::pipe(client_read, server_write, gate.clone()),
            Self::pipe(server_read, client_write, gate),
        );
    }

    /// Copies one direction while the gate is open; while it is shut, holds what it read.
    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut gate: watch::Receiver<bool>,
    ) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if gate.wait_for(|open| *open).await.is_err() {
                return;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            };
            if gate.wait_for(|open| *open).await.is_err() || to.write_all(&buf[..n]).await.is_err()
            {
                return;
            }
        }
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

// ---------------------------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    /// Requests start, renew every 300 ms and complete after 0.5-1.7 s.
    Churn,
    /// No request starts or ends; the live ones keep renewing.
    Hold,
    Stop,
}

/// Four workers publishing lease events directly to the server; `live` is how many
/// requests are in flight.
async fn workers(
    client: async_nats::Client,
    deployment: &str,
    load: watch::Receiver<Load>,
) -> Arc<AtomicUsize> {
    let live_count = Arc::new(AtomicUsize::new(0));
    let count = live_count.clone();
    let deployment = deployment.to_owned();
    tokio::spawn(async move {
        let mut publishers: Vec<RawPublisher> = (1..=4)
            .map(|w| RawPublisher::new(client.clone(), &deployment, 100 + w))
            .collect();
        // (request id, worker, ends at, next renewal)
        let mut live: Vec<(String, u64, Instant, Instant)> = Vec::new();
        let mut next_id = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tick.tick().await;
            let mode = *load.borrow();
            let now = Instant::now();
            if mode == Load::Stop {
                return;
            }
            if mode == Load::Churn {
                for (w, publisher) in publishers.iter_mut().enumerate() {
                    let worker = w as u64 + 1;
                    let id = format!("r{next_id}");
                    let lifetime = Duration::from_millis(500 + (next_id % 4) * 400);
                    next_id += 1;
                    publisher.send(common::admitted(&id, worker, 64)).await;
                    live.push((id, worker, now + lifetime, now + Duration::from_millis(300)));
                }
                let mut i = 0;
                while i < live.len() {
                    if live[i].2 <= now {
                        let (id, worker, ..) = live.swap_remove(i);
                        publishers[worker as usize - 1]
                            .send(common::completed(&id, worker))
                            .await;
                    } else {
                        i += 1;
                    }
                }
            }
            for (id, worker, _, renew) in live.iter_mut() {
                if *renew <= now {
                    publishers[*worker as usize - 1]
                        .send(common::progressed(id, *worker))
                        .await;
                    *renew = now + Duration::from_millis(300);
                }
            }
            count.store(live.len(), Ordering::Release);
        }
    });
    live_count
}

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

async fn get(app: &axum::Router, uri: &str) -> (u16, String) {
    let request = Request::builder().uri(uri).body(Body::empty()).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), app.clone().oneshot(request))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let status = response.status().as_u16();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

/// Polls `/healthz` every 50 ms until it answers `status`; how long that took.
async fn healthz_turns(app: &axum::Router, status: u16, bound: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if get(app, "/healthz").await.0 == status {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < bound,
            "/healthz did not answer {status} within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

/// A silent partition between the router and the server: with the default ping interval,
/// `/healthz` answers 503 within 15 s, the router reconnects after the heal, and its leases
/// converge to those of a reference router connected directly (core mode: what was missed
/// is gone, the stale leases expire by their clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_partition_is_seen_within_the_bound_and_heals() {
    let nats = common::server().await;
    partition_scenario(&nats, None, Duration::ZERO).await;
}

/// Durable mode, a 30 s partition: the same, and nothing is lost: the router resumes the
/// stream where it left it, so no sequence gap, and requests admitted during the partition
/// that are still live after it are on the router too (a core router never sees them).
/// Slow (about 40 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_mode_loses_nothing_across_a_30s_partition() {
    let nats = common::js_server().await;
    let stream = lease_router::LeaseStreamConfig::new();
    let gaps = partition_scenario(&nats, Some(stream), Duration::from_secs(30)).await;
    assert_eq!(gaps, 0, "durable mode loses nothing");
}

/// Runs the partition through a [`BlackHole`] (cut for `partition`, at least until
/// `/healthz` turns, plus 3 s of reconnect attempts into it); returns the router's
/// sequence gaps.
async fn partition_scenario(
    nats: &lease_router_testkit::NatsServer,
    durable: Option<lease_router::LeaseStreamConfig>,
    partition: Duration,
) -> u64 {
    let mode = if durable.is_some() { "durable" } else { "core" };
    let upstream: SocketAddr = format!("127.0.0.1:{}", nats.client_port()).parse().unwrap();
    let proxy = BlackHole::start(upstream).await;

    // The library's default ping interval: the bound holds without any setting.
    let config = NatsConnectConfig::new([proxy.url()])
        .with_name("connection_health partition")
        .with_connect_deadline(Duration::from_secs(10))
        .with_reconnect(
            RetryPolicy::new()
                .with_initial(Duration::from_millis(50))
                .with_max_interval(Duration::from_millis(500)),
        );
    assert_eq!(config.ping_interval(), Some(DEFAULT_PING_INTERVAL));
    assert!(config.dead_connection_bound() <= PARTITION_SEEN_WITHIN);
    let connection = connect(&config).await.expect("connects through the proxy");
    let host = DeploymentHost::new(
        connection,
        HostSettings {
            lease_scan_interval: SCAN,
            durable,
            ..HostSettings::default()
        },
    );
    let name = DeploymentName::new("part").unwrap();
    host.add(&name).await.expect("deployment starts");
    let app = router(ApiState::new(host.clone()));
    assert!(
        common::eventually(common::BOUND, || async {
            get(&app, "/readyz").await.0 == 200
        })
        .await,
        "ready before the partition"
    );

    let direct = common::client(&nats.url()).await;
    let reference = common::router(&direct, "part", SCAN, ApplyConfig::default()).await;
    let (load, load_rx) = watch::channel(Load::Churn);
    let live = workers(direct.client().clone(), "part", load_rx).await;
    let host_leases = || {
        host.get(&name)
            .map_or(0, |view| view.manager().active_leases())
    };
    assert!(
        common::eventually(common::BOUND, || async { host_leases() > 20 }).await,
        "the router mirrors the workers before the partition"
    );
    assert_eq!(get(&app, "/healthz").await.0, 200);

    let cut_at = Instant::now();
    proxy.cut();
    // Durable mode: requests that start during the partition and outlive it; the router
    // only knows them from the stream.
    let long_lived = if mode == "durable" { LONG_LIVED } else { 0 };
    let (renew_stop, mut renew_rx) = watch::channel(false);
    let mut long = RawPublisher::new(direct.client().clone(), "part", 900);
    let renewer = tokio::spawn(async move {
        for i in 0..long_lived {
            long.send(common::admitted(&format!("long{i}"), 9, 64))
                .await;
        }
        while !*renew_rx.borrow_and_update() {
            for i in 0..long_lived {
                long.send(common::progressed(&format!("long{i}"), 9)).await;
            }
            tokio::select! {
                _ = renew_rx.changed() => {}
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
        }
    });
    let seen = healthz_turns(&app, 503, PARTITION_SEEN_WITHIN).await;
    let metrics = get(&app, "/metrics").await.1;
    assert_eq!(metric(&metrics, "lease_router_nats_connected"), 0.0);
    assert_eq!(metric(&metrics, "lease_router_nats_disconnects_total"), 1.0);
    // Reconnect attempts run into the partition for a while.
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::time::sleep_until(cut_at + partition).await;
    assert_eq!(get(&app, "/healthz").await.0, 503);
    let cut_for = cut_at.elapsed();

    proxy.heal();
    let back = healthz_turns(&app, 200, RECONNECT_WITHIN).await;
    eprintln!(
        "silent partition ({}): /healthz 503 after {seen:?} (bound {PARTITION_SEEN_WITHIN:?}, \
         ping interval {DEFAULT_PING_INTERVAL:?}); cut for {cut_for:?}; 200 again {back:?} \
         after the heal",
        mode
    );
    let metrics = get(&app, "/metrics").await.1;
    assert_eq!(metric(&metrics, "lease_router_nats_connected"), 1.0);
    let reconnects = metric(&metrics, "lease_router_nats_reconnects_total");
    assert!(reconnects >= 1.0, "{metrics}");
    assert_eq!(
        metric(&metrics, "lease_router_nats_disconnects_total"),
        reconnects,
        "connected: as many losses as reconnects"
    );

    // Every request of the partition has ended (lifetimes are at most 1.7 s), then nothing
    // starts or ends: the router holds exactly the reference's leases, the live requests.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    load.send_replace(Load::Hold);
    let converged = common::eventually(common::BOUND, || async {
        let expected = live.load(Ordering::Acquire) + long_lived;
        expected > long_lived
            && reference.router.manager().active_leases() == expected
            && host_leases() == expected
    })
    .await;
    assert!(
        converged,
        "leases converge: router {}, reference {}, live requests {} + {long_lived}",
        host_leases(),
        reference.router.manager().active_leases(),
        live.load(Ordering::Acquire)
    );
    assert_eq!(get(&app, "/readyz").await.0, 200);
    let gaps = host.get(&name).unwrap().ingress_stats().snapshot().gaps;

    load.send_replace(Load::Stop);
    renew_stop.send_replace(true);
    renewer.await.unwrap();
    host.shutdown_all().await.expect("clean shutdown");
    reference.router.shutdown().await.expect("reference stops");
    gaps
}

/// The resident memory of this process, in bytes (Linux).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// A router on a runtime of its own, on a thread of its own, that the test can freeze (as
/// SIGSTOP would): the client's connection task, the ingress and the leases all stop.
struct Freezable {
    host: DeploymentHost,
    freeze: tokio::sync::mpsc::UnboundedSender<Duration>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Freezable {
    async fn start(config: NatsConnectConfig, deployment: DeploymentName) -> Self {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (freeze, mut freezes) = tokio::sync::mpsc::unbounded_channel::<Duration>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let connection = connect(&config).await.expect("connects");
                let host = DeploymentHost::new(connection, HostSettings::default());
                host.add(&deployment).await.expect("deployment starts");
                ready_tx.send(host.clone()).ok().unwrap();
                while let Some(pause) = freezes.recv().await {
                    // Blocks the runtime's only thread: every task of the router stops.
                    std::thread::sleep(pause);
                }
                host.shutdown_all().await.expect("clean shutdown");
            });
        });
        let host = ready_rx.await.expect("the router starts");
        Self {
            host,
            freeze,
            thread: Some(thread),
        }
    }

    fn freeze_for(&self, pause: Duration) {
        self.freeze.send(pause).unwrap();
    }

    /// Stops the router (its deployments first) and joins its thread.
    async fn stop(mut self) {
        drop(self.freeze);
        let thread = self.thread.take().unwrap();
        tokio::task::spawn_blocking(move || thread.join().unwrap())
            .await
            .unwrap();
    }
}

/// A router frozen for 8 s under ~40,000 events/s, against a server with the recommended
/// limits (deploy/nats/limits.conf): the server cuts it off as a slow consumer, it
/// reconnects, every lost event is counted (received + gaps = published), `/readyz` ends at
/// 200, its memory stays bounded and its connection metrics agree with each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_router_is_cut_off_reconnects_and_counts_its_loss() {
    common::init_tracing();
    let nats = lease_router_testkit::NatsServerBuilder::new()
        .config_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/nats/limits.conf"
        ))
        .spawn()
        .await
        .expect("nats-server starts with the recommended limits");
    let name = DeploymentName::new("slow").unwrap();
    let config = NatsConnectConfig::new([nats.url()])
        .with_name("connection_health slow consumer")
        .with_connect_deadline(Duration::from_secs(10))
        // Smaller than what the socket holds after the freeze: the client drops messages as
        // it catches up, and the burst of slow-consumer events overflows its event queue (128)
        // just before it reads the server's close: what used to lose the Disconnected event.
        .with_subscription_capacity(256);
    let router_under_test = Freezable::start(config, name.clone()).await;
    let host = router_under_test.host.clone();
    let app = router(ApiState::new(host.clone()));
    let stats = || host.get(&name).unwrap().ingress_stats().snapshot();

    let direct = common::client(&nats.url()).await;
    let mut publisher = RawPublisher::new(direct.client().clone(), "slow", 7);
    const REQUESTS: usize = 1000;
    // In steps the small subscription buffer takes.
    for step in 0..REQUESTS / 100 {
        for i in step * 100..(step + 1) * 100 {
            publisher
                .send(common::admitted(&format!("r{i}"), 1, 64))
                .await;
        }
        publisher.flush().await;
        let sent = (step as u64 + 1) * 100;
        assert!(
            common::eventually(common::BOUND, || async { stats().received >= sent }).await,
            "the router receives the admissions"
        );
    }
    assert!(
        common::eventually(common::BOUND, || async {
            host.get(&name).unwrap().manager().active_leases() == REQUESTS
        })
        .await,
        "the router holds the requests before the freeze"
    );
    let memory_before = resident_bytes();

    // ~40,000 events/s: 400 renewals every 10 ms, until told to stop.
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let flood = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        let mut i = 0usize;
        while !*stop_rx.borrow_and_update() {
            tick.tick().await;
            for _ in 0..400 {
                publisher
                    .send(common::progressed(&format!("r{}", i % REQUESTS), 1))
                    .await;
                i += 1;
            }
        }
        // A gentle tail longer than the sequence window (4,096), so that every loss of the
        // flood, the last ones included, is judged.
        for step in 0..50 {
            for j in 0..100 {
                let r = (step * 100 + j) % REQUESTS;
                publisher
                    .send(common::progressed(&format!("r{r}"), 1))
                    .await;
            }
            publisher.flush().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        publisher.next_seq - 1
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    router_under_test.freeze_for(Duration::from_secs(8));
    tokio::time::sleep(Duration::from_secs(8)).await;

    let metrics_text = || async { get(&app, "/metrics").await.1 };
    let reconnected = common::eventually(Duration::from_secs(30), || async {
        let text = metrics_text().await;
        metric(&text, "lease_router_nats_reconnects_total") >= 1.0
            && metric(&text, "lease_router_nats_connected") == 1.0
    })
    .await;
    assert!(
        reconnected,
        "the server cut the frozen router off and it reconnected:\n{}\n{}",
        metrics_text().await,
        nats.log_tail(20)
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_tx.send_replace(true);
    let published = flood.await.unwrap();

    let counted = common::eventually(common::BOUND, || async {
        let s = stats();
        s.received + s.gaps == published
    })
    .await;
    let s = stats();
    assert!(
        counted,
        "every event is received or counted lost: received {} + gaps {} != published {published}",
        s.received, s.gaps
    );
    assert!(s.gaps > 0, "the freeze lost events: {s:?}");

    let text = metrics_text().await;
    let reconnects = metric(&text, "lease_router_nats_reconnects_total");
    assert_eq!(
        metric(&text, "lease_router_nats_disconnects_total"),
        reconnects,
        "connected again: as many losses as reconnects\n{text}"
    );
    let slow_consumer_events = metric(&text, "lease_router_slow_consumer_events_total");
    assert!(
        slow_consumer_events >= 1.0,
        "the client dropped messages: {text}"
    );
    assert_eq!(get(&app, "/healthz").await.0, 200);
    assert_eq!(get(&app, "/readyz").await.0, 200);
    assert_eq!(
        host.get(&name).unwrap().manager().active_leases(),
        REQUESTS,
        "no lease lost: the renewals resumed"
    );
    let growth = resident_bytes().saturating_sub(memory_before);
    eprintln!(
        "frozen router: published {published}, received {}, gaps {}, reconnects {reconnects}, \
         slow-consumer events {slow_consumer_events}, resident memory +{} MiB",
        s.received,
        s.gaps,
        growth >> 20
    );
    assert!(
        growth < 256 << 20,
        "memory stays bounded: +{} MiB",
        growth >> 20
    );
    router_under_test.stop().await;
}
