//! Integration tests of `nats_server`, `connection` and `retry` against real `nats-server`
//! processes (each test starts its own on free ports; the system server on 4222 is never
//! used). Every wait is bounded. Without `nats-server` they fail with the install hint.

mod common;

use std::time::Duration;

use futures::StreamExt;
use lease_router::RetryPolicy;
use lease_router::{connect, ConnectNatsError, NatsConnectConfig, NatsConnection};
use lease_router_testkit::{pick_free_ports, NatsCluster, NatsServer, NatsServerBuilder};
use tokio::time::{timeout, Instant};

/// Fast reconnects, so tests do not wait for the production backoff.
fn test_config(urls: Vec<String>) -> NatsConnectConfig {
    NatsConnectConfig::new(urls)
        .with_name("nats_support test")
        .with_connect_deadline(Duration::from_secs(20))
        .with_connect_retry(
            RetryPolicy::new()
                .with_initial(Duration::from_millis(50))
                .with_max_interval(Duration::from_millis(250)),
        )
        .with_reconnect(
            RetryPolicy::new()
                .with_initial(Duration::from_millis(20))
                .with_max_interval(Duration::from_millis(250)),
        )
}

/// Publishes on `subject` from `publisher` until `sub` receives one of these messages,
/// at most `within`. Survives the connection being down meanwhile.
async fn round_trip(
    publisher: &async_nats::Client,
    sub: &mut async_nats::Subscriber,
    subject: &str,
    within: Duration,
) -> Result<u32, String> {
    let token = format!("rt-{}", rand::random::<u64>());
    let deadline = Instant::now() + within;
    let mut sent = 0u32;
    while Instant::now() < deadline {
        sent += 1;
        let payload = format!("{token}-{sent}");
        // Publishing only queues (it may be down); flush is bounded.
        let _ = publisher.publish(subject.to_string(), payload.into()).await;
        let _ = timeout(Duration::from_millis(200), publisher.flush()).await;
        let wait_until = (Instant::now() + Duration::from_millis(200)).min(deadline);
        while let Ok(Some(msg)) = tokio::time::timeout_at(wait_until, sub.next()).await {
            if msg.payload.starts_with(token.as_bytes()) {
                return Ok(sent);
            }
        }
    }
    Err(format!(
        "no message on {subject} within {within:?} ({sent} published)"
    ))
}

async fn wait_stats(
    conn: &NatsConnection,
    within: Duration,
    what: &str,
    pred: impl Fn(&lease_router::ConnectionStats) -> bool,
) {
    let ok = conn.stats().wait_until(within, pred).await;
    assert!(
        ok,
        "{what} did not happen within {within:?}: connected={} connects={} disconnects={} last_error={:?}",
        conn.stats().is_connected(),
        conn.stats().connects(),
        conn.stats().disconnects(),
        conn.stats().last_error()
    );
}

fn describe(server: &NatsServer) -> String {
    format!(
        "{} ({}), log {}:\n{}",
        server.url(),
        server.server_name(),
        server.log_path().display(),
        server.log_tail(20)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reconnects_after_server_restart_on_same_port() {
    common::init_tracing();
    timeout(Duration::from_secs(90), async {
        let mut server = NatsServerBuilder::new()
            .jetstream(true)
            .spawn()
            .await
            .unwrap();
        let port = server.port();
        let conn = connect(&test_config(vec![server.url()])).await.unwrap();
        assert!(conn.is_connected());
        assert_eq!(conn.stats().reconnects(), 0);
        assert_eq!(conn.server_url().as_deref(), Some(server.url().as_str()));
        let client = conn.client().clone();
        let mut sub = client.subscribe("nats_support.restart").await.unwrap();
        round_trip(
            &client,
            &mut sub,
            "nats_support.restart",
            Duration::from_secs(10),
        )
        .await
        .unwrap();

        server.kill().await;
        assert!(!server.is_running());
        wait_stats(&conn, Duration::from_secs(10), "disconnect", |s| {
            s.disconnects() >= 1 && !s.is_connected()
        })
        .await;

        server.restart().await.unwrap();
        assert_eq!(server.port(), port);
        wait_stats(&conn, Duration::from_secs(15), "reconnect", |s| {
            s.reconnects() >= 1 && s.is_connected()
        })
        .await;
        round_trip(
            &client,
            &mut sub,
            "nats_support.restart",
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}; server {}", describe(&server)));
        assert!(conn.stats().reconnects() >= 1);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_waits_for_a_server_that_starts_late() {
    common::init_tracing();
    timeout(Duration::from_secs(60), async {
        let port = pick_free_ports(1).unwrap()[0];
        let url = format!("nats://127.0.0.1:{port}");
        let config = test_config(vec![url.clone()]);
        let started = Instant::now();
        let connecting = tokio::spawn(async move { connect(&config).await });

        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !connecting.is_finished(),
            "connect returned while no server ran"
        );
        let server = NatsServerBuilder::new().port(port).spawn().await.unwrap();

        let conn = connecting
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{e}; server {}", describe(&server)));
        assert!(started.elapsed() >= Duration::from_secs(1));
        assert!(conn.is_connected());
        assert_eq!(conn.stats().connects(), 1);
        let client = conn.client().clone();
        let mut sub = client.subscribe("nats_support.late").await.unwrap();
        round_trip(
            &client,
            &mut sub,
            "nats_support.late",
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test]
async fn connect_without_server_fails_at_deadline_naming_the_url() {
    common::init_tracing();
    let port = pick_free_ports(1).unwrap()[0];
    let url = format!("nats://127.0.0.1:{port}");
    let config = test_config(vec![url.clone()]).with_connect_deadline(Duration::from_secs(1));
    let started = Instant::now();
    let err = timeout(Duration::from_secs(15), connect(&config))
        .await
        .expect("connect must give up at its deadline")
        .unwrap_err();
    let elapsed = started.elapsed();
    let msg = err.to_string();
    assert!(
        matches!(err, ConnectNatsError::Unreachable { attempts, .. } if attempts > 1),
        "{msg}"
    );
    assert!(msg.contains(&url), "{msg}");
    assert!(msg.contains("1s"), "{msg}");
    assert!(
        elapsed >= Duration::from_millis(900),
        "gave up early: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "gave up late: {elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_failure_is_permanent() {
    common::init_tracing();
    timeout(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().unwrap();
        let auth = dir.path().join("auth.conf");
        std::fs::write(&auth, "authorization { user: router, password: s3cret }\n").unwrap();
        let server = NatsServerBuilder::new()
            .config_file(&auth)
            .spawn()
            .await
            .unwrap();

        // Wrong credentials: fails at once, long before the 20 s deadline.
        let started = Instant::now();
        let config = test_config(vec![server.url()]).with_user_password("router", "wrong");
        let err = connect(&config).await.unwrap_err();
        assert!(err.is_authorization(), "{err}");
        assert!(err.to_string().contains("authorization failed"), "{err}");
        assert!(err.to_string().contains(&server.url()), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );

        // No credentials at all: same.
        let err = connect(&test_config(vec![server.url()])).await.unwrap_err();
        assert!(err.is_authorization(), "{err}");

        // The right ones connect.
        let config = test_config(vec![server.url()]).with_user_password("router", "s3cret");
        let conn = connect(&config).await.unwrap();
        assert!(conn.is_connected());
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_client_fails_over_to_another_node() {
    common::init_tracing();
    timeout(Duration::from_secs(150), async {
        let mut cluster = NatsCluster::start(3, true).await.unwrap();
        assert_eq!(cluster.len(), 3);
        for i in 0..3 {
            assert!(cluster.node(i).is_running());
        }

        // A: knows all three nodes. B: pinned to a node A is not connected to.
        let a = connect(&test_config(cluster.urls())).await.unwrap();
        let a_port = a.client().server_info().port;
        let a_node = cluster
            .node_by_port(a_port)
            .expect("A is on a cluster node");
        let b_node = (a_node + 1) % 3;
        let b = connect(&test_config(vec![cluster.node(b_node).url()]))
            .await
            .unwrap();

        let subject = "nats_support.cluster";
        let mut sub = a.client().subscribe(subject).await.unwrap();
        // B -> node b_node -> route -> node a_node -> A.
        round_trip(b.client(), &mut sub, subject, Duration::from_secs(15))
            .await
            .unwrap();

        cluster.kill(a_node).await;
        wait_stats(&a, Duration::from_secs(15), "failover", |s| {
            s.reconnects() >= 1 && s.is_connected()
        })
        .await;
        let new_port = a.client().server_info().port;
        assert_ne!(new_port, a_port, "A must have moved to another node");
        let want = format!("nats://127.0.0.1:{new_port}");
        assert!(
            a.stats()
                .wait_until(Duration::from_secs(5), |s| s.server_url().as_deref()
                    == Some(want.as_str()))
                .await,
            "stats server_url {:?}, want {want}",
            a.server_url()
        );
        assert!(b.is_connected(), "B's node was not killed");
        round_trip(b.client(), &mut sub, subject, Duration::from_secs(15))
            .await
            .unwrap();

        // The killed node comes back and the cluster (JetStream too) forms again.
        cluster.restart(a_node).await.unwrap();
        assert!(cluster.node(a_node).is_running());
        round_trip(a.client(), &mut sub, subject, Duration::from_secs(10))
            .await
            .unwrap();
    })
    .await
    .expect("test timed out");
}

/// A "server" that accepts connections and never says anything: each attempt hangs until
/// its own timeout, which must not carry connect past its deadline.
#[tokio::test]
async fn silent_server_does_not_stretch_the_deadline() {
    common::init_tracing();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("nats://{}", listener.local_addr().unwrap());
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let config = test_config(vec![url.clone()])
        .with_connect_deadline(Duration::from_secs(1))
        .with_connection_timeout(Duration::from_secs(30));
    let started = Instant::now();
    let err = timeout(Duration::from_secs(15), connect(&config))
        .await
        .expect("connect must give up at its deadline")
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(matches!(err, ConnectNatsError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains(&url), "{err}");
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    silent.abort();
}
