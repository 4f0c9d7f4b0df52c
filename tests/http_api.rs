//! The HTTP API of the service, in process, against a real `nats-server` started by each test
//! on a free port (the system server on 4222 is never used). Requests go through a minimal
//! HTTP/1.1 client over a `TcpStream` (below). Every wait is bounded: conditions are polled
//! until a deadline, never slept on. Without `nats-server` they fail with the install hint.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lease_router::connection::{connect, NatsConnectConfig};
use lease_router::retry::RetryPolicy;
use lease_router::service::{serve, ApiState, DeploymentHost, HostSettings};
use lease_router::wire::{self, Admitted, Envelope};
use lease_router_testkit::NatsServer;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;

/// Bound of one HTTP exchange.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of every poll for a condition.
const POLL_DEADLINE: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// A minimal HTTP/1.1 client
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One request on a fresh connection (`Connection: close`), read to the end.
async fn request(addr: SocketAddr, method: &str, path: &str) -> Reply {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = timeout(REQUEST_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer within {REQUEST_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    parse_reply(&raw).unwrap_or_else(|| panic!("{method} {path}: bad reply {raw:?}"))
}

fn parse_reply(raw: &[u8]) -> Option<Reply> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        body = dechunk(&body)?;
    }
    Some(Reply {
        status,
        headers,
        body: String::from_utf8(body).ok()?,
    })
}

fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&raw[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(..size)?);
        raw = raw.get(size + 2..)?;
    }
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path).await
}

/// Polls `check` until it returns `Some`, at most [`POLL_DEADLINE`].
async fn poll<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + POLL_DEADLINE;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not reached within {POLL_DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of the metrics line that starts with `series ` (name and labels), if any.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().expect("a number"))
}

// ---------------------------------------------------------------------------------------------
// The service under test
// ---------------------------------------------------------------------------------------------

struct Service {
    nats: NatsServer,
    host: DeploymentHost,
    addr: SocketAddr,
    shutdown: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
}

impl Service {
    async fn start(hook: Option<Arc<dyn lease_router::service::ReadinessHook>>) -> Self {
        let nats = common::server().await;
        let config = NatsConnectConfig::new([nats.url()])
            .with_name("http_api test")
            .with_connect_deadline(Duration::from_secs(10))
            .with_reconnect(
                RetryPolicy::new()
                    .with_initial(Duration::from_millis(20))
                    .with_max_interval(Duration::from_millis(250)),
            );
        let connection = connect(&config).await.expect("connect");
        let host = DeploymentHost::new(connection, HostSettings::default());
        let mut state = ApiState::new(host.clone());
        if let Some(hook) = hook {
            state = state.with_readiness_hook(hook);
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(listener, state, shutdown.clone()));
        Self {
            nats,
            host,
            addr,
            shutdown,
            server,
        }
    }

    async fn metrics(&self) -> String {
        let reply = get(self.addr, "/metrics").await;
        assert_eq!(reply.status, 200);
        reply.body
    }

    /// Stops the HTTP server and every deployment; checks that no task is left.
    async fn stop(self) {
        self.shutdown.cancel();
        timeout(Duration::from_secs(10), self.server)
            .await
            .expect("the HTTP server stops")
            .unwrap()
            .unwrap();
        timeout(Duration::from_secs(30), self.host.shutdown_all())
            .await
            .expect("shutdown_all ends")
            .expect("clean shutdown");
        assert_eq!(self.host.live_tasks(), 0);
        assert!(self.host.deployments().is_empty());
        drop(self.nats);
    }
}

/// Publishes one `admitted` event on `{leases}.{deployment}.{worker}` and flushes.
async fn admit(
    client: &async_nats::Client,
    deployment: &str,
    publisher: u64,
    seq: u64,
    worker_id: u64,
    request_id: &str,
) {
    let envelope = Envelope::new(
        publisher,
        seq,
        wire::unix_micros_now(),
        Admitted {
            request_id: request_id.into(),
            worker_id,
            dp_rank: 0,
            prompt_tokens: 100,
            expected_output_tokens: Some(20),
        },
    );
    let payload = wire::encode(&envelope).unwrap();
    client
        .publish(format!("leases.{deployment}.{worker_id}"), payload.into())
        .await
        .unwrap();
    timeout(Duration::from_secs(5), client.flush())
        .await
        .expect("flush in time")
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_follows_the_nats_connection() {
    common::init_tracing();
    let mut service = Service::start(None).await;
    let addr = service.addr;

    let reply = get(addr, "/healthz").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["status"], "ok");
    assert_eq!(body["nats"]["connected"], true);
    assert!(service
        .metrics()
        .await
        .contains("lease_router_nats_connected 1"));

    service.nats.kill().await;
    let body = poll("healthz says 503 once NATS is gone", || async {
        let reply = get(addr, "/healthz").await;
        (reply.status == 503).then(|| reply.json())
    })
    .await;
    assert_eq!(body["nats"]["connected"], false);
    assert!(
        body["reason"]
            .as_str()
            .unwrap()
            .contains("NATS connection is down"),
        "{body}"
    );
    assert!(service
        .metrics()
        .await
        .contains("lease_router_nats_connected 0"));

    service.nats.restart().await.expect("restart nats-server");
    poll("healthz says 200 again after the restart", || async {
        (get(addr, "/healthz").await.status == 200).then_some(())
    })
    .await;
    let text = service.metrics().await;
    assert!(text.contains("lease_router_nats_connected 1"), "{text}");
    assert!(
        metric(&text, "lease_router_nats_reconnects_total").unwrap() >= 1.0,
        "{text}"
    );
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_over_http() {
    common::init_tracing();
    let service = Service::start(None).await;
    let addr = service.addr;
    let publisher = async_nats::connect(service.nats.url()).await.unwrap();

    // Nothing hosted: ready.
    let reply = get(addr, "/readyz").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["ready"], true);

    // A first deployment, whose task count is the baseline.
    assert_eq!(
        request(addr, "PUT", "/v1/deployments/other").await.status,
        201
    );
    let baseline = metric(&service.metrics().await, "lease_router_live_tasks").unwrap();
    assert!(baseline >= 1.0, "the other deployment's router runs tasks");

    // Create, create again, invalid name.
    let reply = request(addr, "PUT", "/v1/deployments/d").await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    assert_eq!(reply.json()["created"], true);
    let reply = request(addr, "PUT", "/v1/deployments/d").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["created"], false);
    let reply = request(addr, "PUT", "/v1/deployments/a.b").await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let error = reply.json()["error"].as_str().unwrap().to_owned();
    assert!(error.contains("\"a.b\""), "the bad value is named: {error}");
    assert!(
        error.contains("ASCII letters"),
        "and what is allowed: {error}"
    );

    let reply = get(addr, "/v1/deployments").await;
    assert_eq!(reply.status, 200);
    let list = reply.json();
    let names: Vec<&str> = list["deployments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["d", "other"]);
    assert_eq!(list["deployments"][0]["active_leases"], 0);
    assert_eq!(get(addr, "/readyz").await.status, 200);

    // An event on the bus shows up in the leases, the workers and the metrics.
    admit(&publisher, "d", 11, 1, 7, "r-1").await;
    let leases = poll("the admitted lease is listed", || async {
        let body = get(addr, "/v1/deployments/d/leases").await.json();
        (body["leases"].as_array().unwrap().len() == 1).then_some(body)
    })
    .await;
    let lease = &leases["leases"][0];
    assert_eq!(lease["request_id"], "r-1");
    assert_eq!(lease["worker_id"], 7);
    assert_eq!(lease["dp_rank"], 0);
    assert_eq!(lease["state"], "touched");
    assert!(lease["age_seconds"].as_u64().unwrap() <= 5);
    assert_eq!(leases["active_leases"], 1);
    assert_eq!(leases["limit"], 1000);
    let limited = get(addr, "/v1/deployments/d/leases?limit=0").await.json();
    assert_eq!(limited["leases"].as_array().unwrap().len(), 0);
    assert_eq!(limited["truncated"], true);
    let bad = get(addr, "/v1/deployments/d/leases?limit=lots").await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.json()["error"].as_str().unwrap().contains("limit"));

    let workers = poll("the scheduler counts the booking", || async {
        let body = get(addr, "/v1/deployments/d/workers").await.json();
        (body["workers"].as_array().unwrap().len() == 1).then_some(body)
    })
    .await;
    let worker = &workers["workers"][0];
    assert_eq!(worker["worker_id"], 7);
    assert_eq!(worker["dp_rank"], 0);
    assert_eq!(worker["active_bookings"], 1);
    assert_eq!(worker["prompt_tokens"], 100);
    assert_eq!(worker["expected_output_tokens"], 20);
    assert_eq!(workers["least_loaded"]["worker_id"], 7);

    let reply = get(addr, "/metrics").await;
    assert!(
        reply
            .header("content-type")
            .unwrap()
            .starts_with("application/openmetrics-text"),
        "{:?}",
        reply.headers
    );
    let text = reply.body;
    for line in [
        "lease_router_active_leases{deployment=\"d\"} 1",
        "lease_router_events_received_total{deployment=\"d\"} 1",
        "lease_router_events_applied_total{deployment=\"d\",kind=\"admitted\"} 1",
        "lease_router_events_dropped_total{deployment=\"d\",reason=\"late\"} 0",
        "lease_router_publish_to_apply_lag_seconds_count{deployment=\"d\"} 1",
        "lease_router_worker_active_bookings{deployment=\"d\",worker_id=\"7\",dp_rank=\"0\"} 1",
        "lease_router_deployments 2",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }

    // Unknown deployments are 404s, in JSON.
    for path in [
        "/v1/deployments/nope/leases",
        "/v1/deployments/nope/workers",
        "/v1/deployments/nope",
    ] {
        let reply = get(addr, path).await;
        assert_eq!(reply.status, 404, "{path}");
        assert!(reply.json()["error"].as_str().unwrap().contains("nope"));
    }

    // Delete: 204, then 404; its tasks are gone, its counters stay.
    let reply = request(addr, "DELETE", "/v1/deployments/d").await;
    assert_eq!(reply.status, 204, "{}", reply.body);
    assert_eq!(
        request(addr, "DELETE", "/v1/deployments/d").await.status,
        404
    );
    assert_eq!(get(addr, "/v1/deployments/d/leases").await.status, 404);
    assert_eq!(get(addr, "/v1/deployments/d/workers").await.status, 404);
    let text = service.metrics().await;
    assert_eq!(
        metric(&text, "lease_router_live_tasks"),
        Some(baseline),
        "the removed router's tasks ended before DELETE answered:\n{text}"
    );
    assert_eq!(service.host.live_tasks() as f64, baseline);
    assert!(text
        .lines()
        .any(|l| l
            .starts_with("lease_router_events_dropped_total{deployment=\"d\",reason=\"late\"} ")));
    assert!(!text.contains("lease_router_active_leases{deployment=\"d\"}"));
    assert!(text.lines().any(|l| l == "lease_router_deployments 1"));

    // An event for the removed deployment creates nothing. Ordering argument: the host has one
    // connection and the publisher one, so had `d` still been subscribed, its event would have
    // arrived before `other`'s.
    admit(&publisher, "d", 11, 2, 7, "r-2").await;
    admit(&publisher, "other", 12, 1, 3, "o-1").await;
    poll("the other deployment sees its event", || async {
        let body = get(addr, "/v1/deployments/other/leases").await.json();
        (body["active_leases"] == 1).then_some(())
    })
    .await;
    let text = service.metrics().await;
    assert_eq!(
        metric(
            &text,
            "lease_router_events_received_total{deployment=\"d\"}"
        ),
        Some(1.0),
        "nothing was received for the removed deployment:\n{text}"
    );
    let list = get(addr, "/v1/deployments").await.json();
    assert_eq!(list["deployments"].as_array().unwrap().len(), 1);
    assert_eq!(list["deployments"][0]["name"], "other");

    // Added again: a fresh router, the same counters.
    assert_eq!(request(addr, "PUT", "/v1/deployments/d").await.status, 201);
    let leases = get(addr, "/v1/deployments/d/leases").await.json();
    assert_eq!(
        leases["active_leases"], 0,
        "the event sent while removed is gone"
    );
    let text = service.metrics().await;
    assert_eq!(
        metric(
            &text,
            "lease_router_events_received_total{deployment=\"d\"}"
        ),
        Some(1.0),
        "re-adding keeps the counters:\n{text}"
    );
    assert_eq!(
        metric(&text, "lease_router_active_leases{deployment=\"d\"}"),
        Some(0.0)
    );

    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_asks_the_readiness_hook() {
    common::init_tracing();
    let caught_up = Arc::new(AtomicBool::new(false));
    let flag = caught_up.clone();
    let hook = move || {
        (!flag.load(Ordering::Relaxed)).then(|| "catching up: replaying the lease stream".into())
    };
    let service = Service::start(Some(Arc::new(hook))).await;
    let addr = service.addr;
    assert_eq!(request(addr, "PUT", "/v1/deployments/d").await.status, 201);

    let reply = get(addr, "/readyz").await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["ready"], false);
    assert!(
        body["reason"].as_str().unwrap().contains("catching up"),
        "{body}"
    );

    caught_up.store(true, Ordering::Relaxed);
    let reply = get(addr, "/readyz").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["deployments"], 1);

    // Unknown routes are JSON 404s too.
    let reply = get(addr, "/nope").await;
    assert_eq!(reply.status, 404);
    assert!(reply.json()["error"].is_string());
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_and_deletes_agree() {
    common::init_tracing();
    let service = Service::start(None).await;
    let addr = service.addr;

    let puts = (0..8).map(|_| request(addr, "PUT", "/v1/deployments/race"));
    let mut statuses: Vec<u16> = futures::future::join_all(puts)
        .await
        .iter()
        .map(|r| r.status)
        .collect();
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 200, 200, 201]);

    let deletes = (0..4).map(|_| request(addr, "DELETE", "/v1/deployments/race"));
    let mut statuses: Vec<u16> = futures::future::join_all(deletes)
        .await
        .iter()
        .map(|r| r.status)
        .collect();
    statuses.sort_unstable();
    assert_eq!(statuses, [204, 404, 404, 404]);
    assert_eq!(service.host.live_tasks(), 0);

    // Interleaved: whatever the order, the end state is consistent and nothing leaks.
    let mixed = (0..6).map(|i| {
        let method = if i % 2 == 0 { "PUT" } else { "DELETE" };
        request(addr, method, "/v1/deployments/race")
    });
    for reply in futures::future::join_all(mixed).await {
        assert!(
            [200, 201, 204, 404].contains(&reply.status),
            "{}: {}",
            reply.status,
            reply.body
        );
    }
    let hosted = get(addr, "/v1/deployments").await.json()["deployments"]
        .as_array()
        .unwrap()
        .len();
    assert!(hosted <= 1);
    assert!(service.host.is_ready());

    // After shutdown_all, additions are refused.
    let host = service.host.clone();
    timeout(Duration::from_secs(30), host.shutdown_all())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(host.live_tasks(), 0);
    let reply = request(addr, "PUT", "/v1/deployments/late").await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(reply.json()["error"]
        .as_str()
        .unwrap()
        .contains("shutting down"));
    assert_eq!(get(addr, "/readyz").await.status, 503);
    service.stop().await;
}
