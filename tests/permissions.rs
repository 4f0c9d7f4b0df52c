//! Least privilege on the bus, with the repository's own server configuration
//! (`deploy/nats/permissions.conf`): a worker user may publish only on its own subject, a
//! router user may only subscribe; and whatever gets through, the router's identity check
//! drops an event whose body names another worker than its subject.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use lease_router::wire;
use lease_router::ApplyConfig;
use lease_router::DropReason;
use lease_router::{connect, NatsConnectConfig, NatsConnection};
use lease_router_testkit::{NatsServer, NatsServerBuilder};

const DEPLOYMENT: &str = "perm";

fn config_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/nats/permissions.conf")
}

async fn secured_server() -> NatsServer {
    NatsServerBuilder::new()
        .config_file(config_path())
        .spawn()
        .await
        .expect("nats-server starts with deploy/nats/permissions.conf")
}

async fn connect_as(server: &NatsServer, user: &str) -> NatsConnection {
    let password = format!("{user}-example-secret");
    let config = NatsConnectConfig::new([server.url()])
        .with_connect_deadline(Duration::from_secs(10))
        .with_user_password(user, password);
    connect(&config).await.expect("connects")
}

async fn wait_server_error(conn: &NatsConnection, what: &str) -> String {
    let stats = conn.stats();
    let seen = stats
        .wait_until(BOUND, |s| {
            s.last_error()
                .is_some_and(|e| e.to_lowercase().contains("permissions violation"))
        })
        .await;
    let last = stats.last_error().unwrap_or_default();
    assert!(
        seen,
        "{what}: expected a permissions violation, last error {last:?}"
    );
    assert!(stats.server_errors() >= 1);
    last
}

#[tokio::test]
async fn workers_publish_only_as_themselves_and_routers_only_subscribe() {
    let server = secured_server().await;
    let router_conn = connect_as(&server, "router").await;
    let h = router(
        &router_conn,
        DEPLOYMENT,
        Duration::from_secs(3600),
        ApplyConfig::default(),
    )
    .await;

    // The start confirmed its subscription with a message to itself, which the router user
    // may send: the server refused nothing.
    let conf = std::fs::read_to_string(config_path()).unwrap();
    assert!(
        conf.contains(lease_router::PROBE_SUBJECTS),
        "deploy/nats/permissions.conf grants {}",
        lease_router::PROBE_SUBJECTS
    );
    assert_eq!(router_conn.stats().server_errors(), 0);

    // A raw subscription of the router user too: what the server delivers at all.
    let mut tap = router_conn
        .client()
        .subscribe(format!("leases.{DEPLOYMENT}.>"))
        .await
        .unwrap();
    router_conn.client().flush().await.unwrap();

    let worker1 = connect_as(&server, "worker-1").await;
    let mut as_worker1 = RawPublisher::new(worker1.client().clone(), DEPLOYMENT, 11);

    // Worker 1 publishes as worker 2: the server refuses it.
    as_worker1.send(admitted("forged", 2, 100)).await;
    as_worker1.flush().await;
    let err = wait_server_error(&worker1, "worker-1 publishing on worker 2's subject").await;
    assert!(err.contains(&format!("leases.{DEPLOYMENT}.2")), "{err}");

    // Then an honest event on its own subject: once the router has it, the forged one
    // (published before it on the same connection) would have arrived too if it had passed.
    as_worker1.send(admitted("honest", 1, 100)).await;
    as_worker1.flush().await;
    let applied = eventually(BOUND, || {
        let s = h.stats.snapshot();
        async move { s.applied_total() >= 1 }
    })
    .await;
    assert!(applied, "{:?}", h.stats.snapshot());
    let first = tokio::time::timeout(BOUND, futures::StreamExt::next(&mut tap))
        .await
        .expect("the tap sees the honest event")
        .unwrap();
    assert_eq!(first.subject.as_str(), format!("leases.{DEPLOYMENT}.1"));
    let s = h.stats.snapshot();
    assert_eq!(
        s.received, 1,
        "only the honest event reached the router: {s:?}"
    );
    let leases = h.router.manager().leases(100);
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].booking.worker.worker_id.0, 1);

    // Worker 2 may publish on its own subject (the permission is per worker, not a typo).
    let worker2 = connect_as(&server, "worker-2").await;
    let mut as_worker2 = RawPublisher::new(worker2.client().clone(), DEPLOYMENT, 22);
    as_worker2.send(admitted("w2", 2, 100)).await;
    as_worker2.flush().await;
    assert!(
        eventually(BOUND, || {
            let s = h.stats.snapshot();
            async move { s.applied_total() >= 2 }
        })
        .await
    );
    assert_eq!(worker2.stats().server_errors(), 0);

    // A worker may not read the bus.
    let _sub = worker2.client().subscribe("leases.>").await.unwrap();
    worker2.client().flush().await.unwrap();
    wait_server_error(&worker2, "worker-2 subscribing").await;

    // A router may not publish lease events.
    router_conn
        .client()
        .publish(
            format!("leases.{DEPLOYMENT}.1"),
            Bytes::from_static(b"router must not publish"),
        )
        .await
        .unwrap();
    router_conn.client().flush().await.unwrap();
    wait_server_error(&router_conn, "router publishing").await;
    let s = h.stats.snapshot();
    assert_eq!(s.received, 2, "{s:?}");

    h.router.shutdown().await.unwrap();
}

#[tokio::test]
async fn identity_check_drops_a_body_naming_another_worker() {
    let server = secured_server().await;
    let router_conn = connect_as(&server, "router").await;
    let h = router(
        &router_conn,
        DEPLOYMENT,
        Duration::from_secs(3600),
        ApplyConfig::default(),
    )
    .await;

    // Worker 1, on its own (permitted) subject, with a body that claims to be worker 2: the
    // server lets it through (it checks subjects, not bodies); the router drops it.
    let worker1 = connect_as(&server, "worker-1").await;
    let mut as_worker1 = RawPublisher::new(worker1.client().clone(), DEPLOYMENT, 11);
    let forged = as_worker1.envelope(admitted("claims-worker-2", 2, 100));
    let own_subject = as_worker1.subjects.worker_subject(1);
    as_worker1
        .send_bytes(own_subject, wire::encode(&forged).unwrap())
        .await;
    // And one honest event after it, so that we know when the forged one was processed.
    as_worker1.send(admitted("honest", 1, 100)).await;
    as_worker1.flush().await;

    let done = eventually(BOUND, || {
        let s = h.stats.snapshot();
        async move { s.received >= 2 }
    })
    .await;
    assert!(done, "{:?}", h.stats.snapshot());
    let s = h.stats.snapshot();
    assert_eq!(s.dropped(DropReason::Identity), 1, "{s:?}");
    assert_eq!(s.applied_total(), 1, "{s:?}");
    assert_eq!(worker1.stats().server_errors(), 0);
    let leases = h.router.manager().leases(100);
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].booking.worker.worker_id.0, 1);
    assert_eq!(leases[0].booking.request_id.as_str(), "honest");

    h.router.shutdown().await.unwrap();
}

#[tokio::test]
async fn unknown_user_is_refused_with_an_authorization_error() {
    let server = secured_server().await;
    let config = NatsConnectConfig::new([server.url()])
        .with_connect_deadline(Duration::from_secs(5))
        .with_user_password("worker-1", "wrong-password");
    let err = connect(&config).await.expect_err("bad password is refused");
    assert!(err.is_authorization(), "{err}");
    let text = format!("{err} {err:?}");
    assert!(text.contains("authorization"), "{text}");
    assert!(!text.contains("wrong-password"), "{text}");
}

#[tokio::test]
async fn nkey_seed_file_authenticates_and_a_wrong_seed_is_refused() {
    let user = nkeys::KeyPair::new_user();
    let other = nkeys::KeyPair::new_user();
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("nkey.conf");
    std::fs::write(
        &conf,
        format!(
            "authorization {{\n  users = [\n    {{ nkey: \"{}\", permissions: {{ publish: {{ allow: [\"leases.*.1\"] }}, subscribe: {{ deny: [\">\"] }} }} }}\n  ]\n}}\n",
            user.public_key()
        ),
    )
    .unwrap();
    let server = NatsServerBuilder::new()
        .config_file(&conf)
        .spawn()
        .await
        .expect("nats-server starts with an nkey user");

    let good_seed = dir.path().join("worker-1.nk");
    std::fs::write(&good_seed, format!("{}\n", user.seed().unwrap())).unwrap();
    let config = NatsConnectConfig::new([server.url()])
        .with_connect_deadline(Duration::from_secs(10))
        .with_nkey_seed_file(&good_seed);
    let conn = connect(&config).await.expect("the nkey user connects");
    assert!(conn.is_connected());

    let bad_seed_text = other.seed().unwrap();
    let bad_seed = dir.path().join("intruder.nk");
    std::fs::write(&bad_seed, &bad_seed_text).unwrap();
    let config = NatsConnectConfig::new([server.url()])
        .with_connect_deadline(Duration::from_secs(5))
        .with_nkey_seed_file(&bad_seed);
    let err = connect(&config)
        .await
        .expect_err("an unknown nkey is refused");
    assert!(err.is_authorization(), "{err}");
    let text = format!("{err} {err:?}");
    assert!(text.contains("nkey seed file"), "{text}");
    assert!(!text.contains(&bad_seed_text), "{text}");
}

/// Durable mode under the repository's permissions: the router user creates its
/// deployment's stream and writes snapshots; a worker user can neither write a snapshot nor
/// take the writer's entry (a replica trusts what it loads from there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_routers_write_snapshots() {
    use lease_router::{
        snapshot_bucket, snapshot_lock_bucket, CatchUpState, IngressStats, JetStreamIngress,
        LeaseStreamConfig, Router, RouterConfig,
    };
    use std::sync::Arc;
    let server = NatsServerBuilder::new()
        .jetstream(true)
        .config_file(config_path())
        .spawn()
        .await
        .expect("nats-server starts with JetStream and deploy/nats/permissions.conf");
    let router_conn = connect_as(&server, "router").await;
    let catch_up = Arc::new(CatchUpState::new());
    let ingress = JetStreamIngress::new(
        router_conn.client().clone(),
        subjects(DEPLOYMENT),
        LeaseStreamConfig::new().with_snapshots(Duration::from_millis(200), 300),
        ApplyConfig::default(),
        Arc::new(IngressStats::new()),
        catch_up.clone(),
    );
    let router = Router::start(RouterConfig::new(DEPLOYMENT), ingress)
        .await
        .expect("the router user starts a durable router");
    assert!(
        eventually(BOUND, || async { catch_up.snapshot_figures().written >= 1 }).await,
        "the router user writes snapshots: {:?}",
        catch_up.snapshot_figures()
    );
    assert_eq!(catch_up.snapshot_figures().failed, 0);

    let bucket = snapshot_bucket(&subjects(DEPLOYMENT));
    for subject in [
        format!("$O.{bucket}.M.c25hcHNob3Q="),
        format!("$O.{bucket}.C.forged"),
        format!("$KV.{}.writer", snapshot_lock_bucket(&subjects(DEPLOYMENT))),
    ] {
        let worker = connect_as(&server, "worker-1").await;
        worker
            .client()
            .publish(subject.clone(), Bytes::from_static(b"forged"))
            .await
            .unwrap();
        let last = wait_server_error(&worker, &subject).await;
        assert!(last.contains(&subject), "{subject}: {last}");
    }
    router.shutdown().await.unwrap();
}
