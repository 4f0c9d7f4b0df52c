//! The HTTP API of the service, against a real `nats-server` started by each test on a free
//! port (the system server on 4222 is never used). HTTP semantics are tested in process,
//! through `tower::ServiceExt::oneshot` on the one axum `Router` that `serve` serves; a few
//! tests go end to end over a socket with reqwest. Every wait is bounded: conditions are
//! polled until a deadline, never slept on. Without `nats-server` they fail with the install
//! hint.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, Request};
use lease_router::service::{router, serve, ApiState, DeploymentHost, HostSettings, ReadinessHook};
use lease_router::wire::{self, Admitted, Envelope};
use lease_router::RetryPolicy;
use lease_router::{connect, NatsConnectConfig};
use lease_router_testkit::NatsServer;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Bound of one HTTP exchange.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of every poll for a condition.
const POLL_DEADLINE: Duration = Duration::from_secs(20);
/// The NATS connect deadline of the service under test.
const CONNECT_DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts the documented error shape: `{"error": "..."}`, served as JSON, with
    /// `status`.
    fn assert_error(&self, status: u16, what: &str) -> String {
        assert_eq!(self.status, status, "{what}: {self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{what}: {self:?}"
        );
        let body = self.json();
        let fields: Vec<&String> = body.as_object().expect("an object").keys().collect();
        assert_eq!(fields, ["error"], "{what}: {body}");
        let error = body["error"].as_str().expect("a string").to_owned();
        assert!(!error.is_empty(), "{what}: {body}");
        error
    }
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

/// The candidate of a route answer on worker `worker_id`.
fn candidate_on(decision: &serde_json::Value, worker_id: &serde_json::Value) -> serde_json::Value {
    decision["candidates"]
        .as_array()
        .expect("candidates")
        .iter()
        .find(|c| &c["worker_id"] == worker_id)
        .unwrap_or_else(|| panic!("no candidate on worker {worker_id}: {decision}"))
        .clone()
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
    state: ApiState,
    app: axum::Router,
}

impl Service {
    async fn start(hook: Option<Arc<dyn ReadinessHook>>) -> Self {
        Self::start_with(hook, CONNECT_DEADLINE).await
    }

    async fn start_with(hook: Option<Arc<dyn ReadinessHook>>, connect_deadline: Duration) -> Self {
        Self::start_settings(hook, connect_deadline, HostSettings::default()).await
    }

    async fn start_settings(
        hook: Option<Arc<dyn ReadinessHook>>,
        connect_deadline: Duration,
        settings: HostSettings,
    ) -> Self {
        let nats = common::server().await;
        let config = NatsConnectConfig::new([nats.url()])
            .with_name("http_api test")
            .with_connect_deadline(connect_deadline)
            .with_reconnect(
                RetryPolicy::new()
                    .with_initial(Duration::from_millis(20))
                    .with_max_interval(Duration::from_millis(250)),
            );
        let connection = connect(&config).await.expect("connect");
        let host = DeploymentHost::new(connection, settings);
        let mut state = ApiState::new(host.clone());
        if let Some(hook) = hook {
            state = state.with_readiness_hook(hook);
        }
        Self {
            nats,
            host,
            app: router(state.clone()),
            state,
        }
    }

    /// One request through the router, in process.
    async fn send(&self, request: Request<Body>) -> Reply {
        let what = format!("{} {}", request.method(), request.uri());
        let exchange = async {
            let response = self.app.clone().oneshot(request).await.expect("infallible");
            let (parts, body) = response.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX)
                .await
                .expect("the body is read");
            Reply {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body: String::from_utf8(body.to_vec()).expect("UTF-8 body"),
            }
        };
        timeout(REQUEST_TIMEOUT, exchange)
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer within {REQUEST_TIMEOUT:?}"))
    }

    async fn call(&self, method: &str, uri: &str) -> Reply {
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::empty())
            .expect("a valid request");
        self.send(request).await
    }

    async fn get(&self, uri: &str) -> Reply {
        self.call("GET", uri).await
    }

    async fn metrics(&self) -> String {
        let reply = self.get("/metrics").await;
        assert_eq!(reply.status, 200);
        reply.body
    }

    /// Serves the same API on a socket until the returned server is stopped.
    async fn serve(&self) -> Served {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve(listener, self.state.clone(), shutdown.clone()));
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .unwrap();
        Served {
            addr,
            shutdown,
            task,
            client,
        }
    }

    /// Stops every deployment; checks that no task is left.
    async fn stop(self) {
        timeout(Duration::from_secs(30), self.host.shutdown_all())
            .await
            .expect("shutdown_all ends")
            .expect("clean shutdown");
        assert_eq!(self.host.live_tasks(), 0);
        assert!(self.host.deployments().is_empty());
        drop(self.nats);
    }
}

/// The API served on a real socket, and a client for it.
struct Served {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
    client: reqwest::Client,
}

impl Served {
    async fn call(&self, method: &str, path: &str) -> Reply {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let url = format!("http://{}{path}", self.addr);
        let response = self
            .client
            .request(method, &url)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        Reply {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.text().await.expect("a body"),
        }
    }

    async fn get(&self, path: &str) -> Reply {
        self.call("GET", path).await
    }

    /// Stops the HTTP server gracefully.
    async fn stop(self) {
        self.shutdown.cancel();
        timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the HTTP server stops")
            .unwrap()
            .unwrap();
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
            block_hashes: Vec::new(),
            block_capacity: None,
            class: None,
            request_id: request_id.into(),
            worker_id,
            dp_rank: 0,
            prompt_tokens: 100,
            expected_output_tokens: Some(20),
            cached_tokens: None,
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
// End to end, over a socket
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_follows_the_nats_connection() {
    common::init_tracing();
    let mut service = Service::start(None).await;
    let http = service.serve().await;

    let reply = http.get("/healthz").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["status"], "ok");
    assert_eq!(body["nats"]["connected"], true);
    let metrics = http.get("/metrics").await.body;
    assert!(
        metrics.contains("lease_router_nats_connected 1"),
        "{metrics}"
    );

    service.nats.kill().await;
    let body = poll("healthz says 503 once NATS is gone", || async {
        let reply = http.get("/healthz").await;
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
    let metrics = http.get("/metrics").await.body;
    assert!(
        metrics.contains("lease_router_nats_connected 0"),
        "{metrics}"
    );

    service.nats.restart().await.expect("restart nats-server");
    poll("healthz says 200 again after the restart", || async {
        (http.get("/healthz").await.status == 200).then_some(())
    })
    .await;
    let text = http.get("/metrics").await.body;
    assert!(text.contains("lease_router_nats_connected 1"), "{text}");
    assert!(
        metric(&text, "lease_router_nats_reconnects_total").unwrap() >= 1.0,
        "{text}"
    );
    http.stop().await;
    service.stop().await;
}

/// What hyper adds on the way (framing, the `Allow` header, percent-encoded paths) survives
/// a real socket, and the server stops gracefully.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_over_a_socket() {
    common::init_tracing();
    let service = Service::start(None).await;
    let http = service.serve().await;

    let reply = http.call("PUT", "/v1/deployments/d").await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    assert_eq!(reply.json()["created"], true);
    let list = http.get("/v1/deployments").await.json();
    assert_eq!(list["deployments"][0]["name"], "d");

    let reply = http.call("POST", "/v1/deployments/d").await;
    reply.assert_error(405, "POST over a socket");
    assert!(reply.header("allow").is_some(), "{reply:?}");
    http.call("PUT", "/v1/deployments/%FF")
        .await
        .assert_error(400, "a name that is not UTF-8, over a socket");
    http.get("/nope").await.assert_error(404, "unknown route");

    let reply = http.call("DELETE", "/v1/deployments/d").await;
    assert_eq!(reply.status, 204, "{}", reply.body);
    http.stop().await;
    service.stop().await;
}

// ---------------------------------------------------------------------------------------------
// In process, through the router
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_over_http() {
    common::init_tracing();
    let service = Service::start(None).await;
    let publisher = async_nats::connect(service.nats.url()).await.unwrap();

    // Nothing hosted: ready.
    let reply = service.get("/readyz").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["ready"], true);

    // A first deployment, whose task count is the baseline.
    assert_eq!(
        service.call("PUT", "/v1/deployments/other").await.status,
        201
    );
    let baseline = metric(&service.metrics().await, "lease_router_live_tasks").unwrap();
    assert!(baseline >= 1.0, "the other deployment's router runs tasks");

    // Create, create again, invalid name.
    let reply = service.call("PUT", "/v1/deployments/d").await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    assert_eq!(reply.json()["created"], true);
    let reply = service.call("PUT", "/v1/deployments/d").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["created"], false);
    let reply = service.call("PUT", "/v1/deployments/a.b").await;
    let error = reply.assert_error(400, "an invalid name");
    assert!(error.contains("\"a.b\""), "the bad value is named: {error}");
    assert!(
        error.contains("ASCII letters"),
        "and what is allowed: {error}"
    );

    let reply = service.get("/v1/deployments").await;
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
    assert_eq!(service.get("/readyz").await.status, 200);

    // An event on the bus shows up in the leases, the workers and the metrics.
    admit(&publisher, "d", 11, 1, 7, "r-1").await;
    let leases = poll("the admitted lease is listed", || async {
        let body = service.get("/v1/deployments/d/leases").await.json();
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
    let limited = service.get("/v1/deployments/d/leases?limit=0").await.json();
    assert_eq!(limited["leases"].as_array().unwrap().len(), 0);
    assert_eq!(limited["truncated"], true);
    let bad = service.get("/v1/deployments/d/leases?limit=lots").await;
    assert!(bad.assert_error(400, "limit=lots").contains("limit"));

    let workers = poll("the scheduler counts the booking", || async {
        let body = service.get("/v1/deployments/d/workers").await.json();
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

    let reply = service.get("/metrics").await;
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
        let error = service.get(path).await.assert_error(404, path);
        assert!(error.contains("nope"), "{path}: {error}");
    }

    // Delete: 204, then 404; its tasks are gone, its counters stay.
    let reply = service.call("DELETE", "/v1/deployments/d").await;
    assert_eq!(reply.status, 204, "{}", reply.body);
    service
        .call("DELETE", "/v1/deployments/d")
        .await
        .assert_error(404, "a second DELETE");
    assert_eq!(service.get("/v1/deployments/d/leases").await.status, 404);
    assert_eq!(service.get("/v1/deployments/d/workers").await.status, 404);
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
        let body = service.get("/v1/deployments/other/leases").await.json();
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
    let list = service.get("/v1/deployments").await.json();
    assert_eq!(list["deployments"].as_array().unwrap().len(), 1);
    assert_eq!(list["deployments"][0]["name"], "other");

    // Added again: a fresh router, the same counters.
    assert_eq!(service.call("PUT", "/v1/deployments/d").await.status, 201);
    let leases = service.get("/v1/deployments/d/leases").await.json();
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
    assert_eq!(service.call("PUT", "/v1/deployments/d").await.status, 201);

    let reply = service.get("/readyz").await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["ready"], false);
    assert!(
        body["reason"].as_str().unwrap().contains("catching up"),
        "{body}"
    );

    caught_up.store(true, Ordering::Relaxed);
    let reply = service.get("/readyz").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["deployments"], 1);
    service.stop().await;
}

/// Whatever a careless or hostile client sends, an error is the documented JSON with the
/// right status, and a 405 keeps its `Allow` header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_json() {
    common::init_tracing();
    let service = Service::start(None).await;
    assert_eq!(service.call("PUT", "/v1/deployments/d").await.status, 201);

    // Wrong methods: 405, with the methods the route has.
    for (method, path, allow) in [
        ("POST", "/v1/deployments/x", "DELETE,GET,HEAD,PUT"),
        ("PATCH", "/v1/deployments/d", "DELETE,GET,HEAD,PUT"),
        ("OPTIONS", "/v1/deployments/d", "DELETE,GET,HEAD,PUT"),
        ("DELETE", "/v1/deployments", "GET,HEAD"),
        ("POST", "/v1/deployments/d/leases", "GET,HEAD"),
        ("PUT", "/v1/deployments/d/workers", "GET,HEAD"),
        ("POST", "/healthz", "GET,HEAD"),
        ("DELETE", "/metrics", "GET,HEAD"),
        ("BREW", "/readyz", "GET,HEAD"),
        ("POST", "/", "GET,HEAD"),
    ] {
        let what = format!("{method} {path}");
        let reply = service.call(method, path).await;
        let error = reply.assert_error(405, &what);
        assert!(error.contains(method), "{what}: {error}");
        let mut allowed: Vec<&str> = reply
            .header("allow")
            .unwrap_or_else(|| panic!("{what}: an Allow header: {reply:?}"))
            .split(',')
            .map(str::trim)
            .collect();
        allowed.sort_unstable();
        assert_eq!(allowed.join(","), allow, "{what}");
    }

    // Names that are not UTF-8, or not names: 400, wherever the name is.
    let overlong = format!("/v1/deployments/{}", "a".repeat(10_000));
    for (method, path) in [
        ("PUT", "/v1/deployments/%FF"),
        ("GET", "/v1/deployments/%FF"),
        ("DELETE", "/v1/deployments/%C3%28"),
        ("GET", "/v1/deployments/%FF/leases"),
        ("GET", "/v1/deployments/%E2%82/workers"),
        ("PUT", "/v1/deployments/a%2Fb"),
        ("PUT", "/v1/deployments/%00"),
        ("PUT", "/v1/deployments/%20"),
        ("PUT", "/v1/deployments/d*"),
        ("GET", "/v1/deployments//leases"),
        ("PUT", overlong.as_str()),
    ] {
        let what = format!("{method} {path:.60}");
        let error = service.call(method, path).await.assert_error(400, &what);
        assert!(error.len() < 1_000, "{what}: a bounded message: {error}");
    }

    // Bad query strings on the route that reads one.
    for query in [
        "limit=lots",
        "limit=-1",
        "limit=1.5",
        "limit=99999999999999999999999999",
        "limit=%FF",
        "limit=1&limit=2",
    ] {
        let path = format!("/v1/deployments/d/leases?{query}");
        service.get(&path).await.assert_error(400, &path);
    }

    // Unknown routes.
    for path in [
        "/nope",
        "/index.html",
        "/v1",
        "/v1/deployments/",
        "/v1/deployments/d/",
        "/v1/deployments/d/leases/extra",
        "/v1/deployments/%FF/nope",
        "/healthz/",
    ] {
        service.get(path).await.assert_error(404, path);
    }

    // A body where none is read is ignored, whatever it claims to be (a PUT reads its
    // optional routing body: see route_over_http).
    let request = Request::builder()
        .method("GET")
        .uri("/v1/deployments/d")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    let reply = service.send(request).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["deployment"]["name"], "d");
    // An unknown query string where none is read, too.
    assert_eq!(service.get("/healthz?verbose=%FF").await.status, 200);

    service.stop().await;
}

/// In core mode a PUT while NATS is down answers 503 within the connect deadline instead of
/// waiting for NATS to come back; once it is back, the PUT succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_answers_503_while_nats_is_down() {
    common::init_tracing();
    let deadline = Duration::from_secs(2);
    let mut service = Service::start_with(None, deadline).await;
    service.nats.kill().await;
    poll("the host sees NATS down", || async {
        (!service.host.connection().is_connected()).then_some(())
    })
    .await;

    // A generous bound that only proves the PUT does not hang.
    let reply = timeout(deadline * 3, service.call("PUT", "/v1/deployments/d"))
        .await
        .expect("PUT answers while NATS is down instead of hanging");
    let error = reply.assert_error(503, "PUT while NATS is down");
    assert!(error.contains("NATS"), "{error}");
    assert!(error.contains("\"d\"") || error.contains(" d "), "{error}");
    // Nothing of the failed start is left behind.
    assert!(service.host.names().is_empty());
    service
        .get("/v1/deployments/d")
        .await
        .assert_error(404, "the deployment after a failed PUT");

    service.nats.restart().await.expect("restart nats-server");
    poll("the host sees NATS back", || async {
        service.host.connection().is_connected().then_some(())
    })
    .await;
    let reply = service.call("PUT", "/v1/deployments/d").await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(reply.json()["created"], true);
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_and_deletes_agree() {
    common::init_tracing();
    let service = Service::start(None).await;

    let puts = (0..8).map(|_| service.call("PUT", "/v1/deployments/race"));
    let mut statuses: Vec<u16> = futures::future::join_all(puts)
        .await
        .iter()
        .map(|r| r.status)
        .collect();
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 200, 200, 201]);

    let deletes = (0..4).map(|_| service.call("DELETE", "/v1/deployments/race"));
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
        service.call(method, "/v1/deployments/race")
    });
    for reply in futures::future::join_all(mixed).await {
        assert!(
            [200, 201, 204, 404].contains(&reply.status),
            "{}: {}",
            reply.status,
            reply.body
        );
    }
    let hosted = service.get("/v1/deployments").await.json()["deployments"]
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
    let reply = service.call("PUT", "/v1/deployments/late").await;
    assert!(reply
        .assert_error(503, "PUT after shutdown_all")
        .contains("shutting down"));
    assert_eq!(service.get("/readyz").await.status, 503);
    service.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

impl Service {
    async fn post_json(&self, uri: &str, method: &str, body: &str) -> Reply {
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_owned()))
            .expect("a valid request");
        self.send(request).await
    }
}

fn worker_series_in(text: &str, name: &str, worker: u64) -> Option<f64> {
    metric(
        text,
        &format!("lease_router_{name}{{deployment=\"r\",worker_id=\"{worker}\",dp_rank=\"0\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_over_http() {
    let service = Service::start(None).await;
    let publisher = common::client(&service.nats.url()).await.client().clone();

    // A bad body creates nothing; a good one sets the routing.
    for bad in [
        r#"{"policy": "nope"}"#,
        r#"{"weights": {"prefill": -1, "kv": 1}}"#,
        r#"{"polcy": "random"}"#,
        "{",
    ] {
        service
            .post_json("/v1/deployments/r", "PUT", bad)
            .await
            .assert_error(400, bad);
    }
    assert_eq!(service.get("/v1/deployments/r").await.status, 404);
    let reply = service
        .post_json("/v1/deployments/r", "PUT", r#"{"policy": "weighted_cost"}"#)
        .await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    assert_eq!(reply.json()["routing"]["policy"], "weighted_cost");
    assert_eq!(reply.json()["routing"]["weights"]["kv"], 0.25);

    let route = |body: &'static str| service.post_json("/v1/deployments/r/route", "POST", body);
    let ok = r#"{"request_id": "x", "prompt_tokens": 50}"#;
    service
        .post_json("/v1/deployments/nope/route", "POST", ok)
        .await
        .assert_error(404, "unknown deployment");
    route(ok).await.assert_error(409, "no worker yet");

    admit(&publisher, "r", 21, 1, 7, "a").await;
    admit(&publisher, "r", 22, 1, 8, "b").await;
    let workers = poll("both workers are members", || async {
        let body = service.get("/v1/deployments/r/workers").await.json();
        (body["workers"].as_array().unwrap().len() == 2).then_some(body)
    })
    .await;
    for worker in workers["workers"].as_array().unwrap() {
        assert!(
            worker["last_seen_ms"].as_u64().unwrap() < 20_000,
            "{worker}"
        );
        assert_eq!(worker["prefill_tokens"], 100);
        assert_eq!(worker["kv_tokens"], 100);
    }

    let reply = route(ok).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let decision = reply.json();
    assert_eq!(decision["policy"], "weighted_cost");
    assert_eq!(decision["request_id"], "x");
    // Equal costs: the lower worker. Cost = (100 + 50) prefill + 0.25 × (100 + 50) KV.
    assert_eq!(
        (decision["worker_id"].clone(), decision["dp_rank"].clone()),
        (7.into(), 0.into())
    );
    let candidates = decision["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 2, "{decision}");
    assert_eq!(candidates[0]["worker_id"], 7);
    assert_eq!(candidates[0]["cost"], 187.5);
    // Booked at once: the next one goes to worker 8.
    let next = route(r#"{"request_id": "y", "prompt_tokens": 50, "cached_tokens": 10, "expected_output_tokens": 5}"#).await;
    assert_eq!(next.json()["worker_id"], 8, "{}", next.body);

    for bad in [
        r#"{"request_id": "z"}"#,
        r#"{"request_id": "z", "prompt_tokens": 0}"#,
        r#"{"request_id": "z", "prompt_tokens": 5, "cached_tokens": 6}"#,
        r#"{"request_id": "z", "prompt_tokens": -5}"#,
        "not json",
    ] {
        route(bad).await.assert_error(400, bad);
    }
    let long_id = format!(
        r#"{{"request_id": "{}", "prompt_tokens": 1}}"#,
        "z".repeat(lease_router::MAX_ROUTE_REQUEST_ID_BYTES + 1)
    );
    let error = service
        .post_json("/v1/deployments/r/route", "POST", &long_id)
        .await
        .assert_error(400, "a request id over the limit");
    assert!(error.contains("request_id"), "{error}");
    let huge = format!(
        r#"{{"request_id": "{}", "prompt_tokens": 1}}"#,
        "x".repeat(3 << 20)
    );
    service
        .post_json("/v1/deployments/r/route", "POST", &huge)
        .await
        .assert_error(413, "a body over axum's limit");

    let text = service.metrics().await;
    let decisions = |outcome: &str| {
        metric(
            &text,
            &format!("lease_router_route_decisions_total{{deployment=\"r\",policy=\"weighted_cost\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(decisions("routed"), Some(2.0), "{text}");
    assert_eq!(decisions("no_workers"), Some(1.0));
    // The five bad bodies, the long id and the body over the limit.
    assert_eq!(decisions("invalid"), Some(7.0));
    // Timed: the decisions the scheduler made (routed and no workers), not the invalid ones.
    assert_eq!(
        metric(
            &text,
            "lease_router_route_decision_seconds_count{deployment=\"r\"}"
        ),
        Some(3.0),
        "{text}"
    );
    let worker_series = |name: &str, worker: u64| worker_series_in(&text, name, worker);
    assert_eq!(worker_series("worker_kv_tokens", 7), Some(150.0));
    assert_eq!(worker_series("worker_prefill_tokens", 8), Some(140.0));
    assert_eq!(
        worker_series("worker_remaining_output_tokens", 8),
        Some(25.0)
    );

    // A gateway whose request "x" never reached worker 7 releases its booking at once, once.
    let cancel = service.call("DELETE", "/v1/deployments/r/route/x").await;
    assert_eq!(cancel.status, 200, "{}", cancel.body);
    assert_eq!(cancel.json()["released"], true, "{}", cancel.body);
    let again = service.call("DELETE", "/v1/deployments/r/route/x").await;
    assert_eq!(
        (again.status, again.json()["released"].clone()),
        (200, false.into())
    );
    service
        .call("DELETE", "/v1/deployments/nope/route/x")
        .await
        .assert_error(404, "unknown deployment");
    let unknown = service
        .call("DELETE", "/v1/deployments/r/route/never-routed")
        .await;
    assert_eq!(unknown.json()["released"], false, "{}", unknown.body);
    let text = service.metrics().await;
    assert_eq!(worker_series_in(&text, "worker_kv_tokens", 7), Some(100.0));
    assert_eq!(
        metric(
            &text,
            "lease_router_routes_cancelled_total{deployment=\"r\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // A field this router does not know (a newer gateway's) is ignored, as the wire
    // contract ignores unknown keys; the PUT body, a configuration, refuses one (above).
    let newer = route(r#"{"request_id": "fwd", "prompt_tokens": 5, "colour": "red"}"#).await;
    assert_eq!(newer.status, 200, "{}", newer.body);
    assert!(
        service
            .call("DELETE", "/v1/deployments/r/route/fwd")
            .await
            .json()["released"]
            == true
    );

    // Worker 8 leaves: gone from /workers, its series removed, never chosen.
    let leaving = Envelope::new(
        22,
        2,
        wire::unix_micros_now(),
        wire::WorkerReset {
            worker_id: 8,
            dp_rank: None,
            leaving: true,
        },
    );
    publisher
        .publish("leases.r.8", wire::encode(&leaving).unwrap().into())
        .await
        .unwrap();
    publisher.flush().await.unwrap();
    poll("worker 8 is gone", || async {
        let body = service.get("/v1/deployments/r/workers").await.json();
        (body["workers"].as_array().unwrap().len() == 1).then_some(())
    })
    .await;
    let text = service.metrics().await;
    assert!(!text.contains("worker_id=\"8\""), "{text}");
    assert!(text.contains("worker_id=\"7\""), "{text}");
    for i in 0..10 {
        let body = format!(r#"{{"request_id": "after-{i}", "prompt_tokens": 1}}"#);
        let reply = service
            .post_json("/v1/deployments/r/route", "POST", &body)
            .await;
        assert_eq!(reply.json()["worker_id"], 7, "{}", reply.body);
    }

    // A prompt's token ids: nothing cached anywhere yet, so the cheaper worker, whose index
    // entry the decision makes at once: the same prompt again finds its two blocks there.
    let tokens: Vec<u32> = (0..40).collect();
    let with_tokens = |id: &str| format!(r#"{{"request_id": "{id}", "token_ids": {tokens:?}}}"#);
    let first = service
        .post_json("/v1/deployments/r/route", "POST", &with_tokens("p1"))
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let first = first.json();
    let chosen = first["worker_id"].clone();
    for candidate in first["candidates"].as_array().unwrap() {
        assert_eq!(candidate["overlap_blocks"], 0, "{first}");
    }
    let again = service
        .post_json("/v1/deployments/r/route", "POST", &with_tokens("p2"))
        .await
        .json();
    let on_chosen = candidate_on(&again, &chosen);
    assert_eq!(
        (
            on_chosen["overlap_blocks"].clone(),
            on_chosen["cached_tokens"].clone()
        ),
        (2.into(), 32.into()),
        "{again}"
    );
    for bad in [
        r#"{"request_id": "z", "token_ids": ["a", "b"]}"#,
        r#"{"request_id": "z", "prompt_tokens": 32, "block_hashes": [-1, 2]}"#,
        r#"{"request_id": "z", "token_ids": [1, 2], "block_hashes": [1]}"#,
        r#"{"request_id": "z", "prompt_tokens": 16, "block_hashes": [1, 2]}"#,
        r#"{"request_id": "z", "prompt_tokens": 3, "token_ids": [1, 2]}"#,
        r#"{"request_id": "z", "token_ids": []}"#,
        r#"{"request_id": "z", "token_ids": 5}"#,
        r#"{"request_id": "z", "prompt": "hello world"}"#,
    ] {
        route(bad).await.assert_error(400, bad);
    }
    service.stop().await;
}

/// With a tokenizer file, a route request may carry its prompt as text: the router tokenizes
/// it into the same ids a gateway would send (the second request, as ids, finds the first
/// one's blocks on the worker it went to).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_with_prompt_text_through_the_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokenizer.json");
    std::fs::write(
        &file,
        r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1,
        "[UNK]": 2}, "unk_token": "[UNK]"}}"#,
    )
    .unwrap();
    let tokenizer = lease_router::PromptTokenizer::from_file(&file).unwrap();
    let settings = HostSettings {
        tokenizer: Some(Arc::new(tokenizer)),
        ..HostSettings::default()
    };
    let service = Service::start_settings(None, CONNECT_DEADLINE, settings).await;
    let publisher = common::client(&service.nats.url()).await.client().clone();
    assert_eq!(
        service
            .post_json("/v1/deployments/t", "PUT", "")
            .await
            .status,
        201
    );
    admit(&publisher, "t", 31, 1, 7, "a").await;
    admit(&publisher, "t", 32, 1, 8, "b").await;
    poll("both workers are members", || async {
        let body = service.get("/v1/deployments/t/workers").await.json();
        (body["workers"].as_array().unwrap().len() == 2).then_some(())
    })
    .await;
    let text = "hello world ".repeat(16);
    let body = format!(r#"{{"request_id": "text", "prompt": "{text}"}}"#);
    let first = service
        .post_json("/v1/deployments/t/route", "POST", &body)
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let chosen = first.json()["worker_id"].clone();
    let ids: Vec<u32> = (0..32).map(|i| i % 2).collect();
    let body = format!(r#"{{"request_id": "ids", "token_ids": {ids:?}}}"#);
    let second = service
        .post_json("/v1/deployments/t/route", "POST", &body)
        .await
        .json();
    let on_chosen = candidate_on(&second, &chosen);
    assert_eq!(on_chosen["overlap_blocks"], 2, "{second}");
    // Text with ids, or a prompt_tokens that is not the text's length: refused.
    for bad in [
        r#"{"request_id": "x", "prompt": "hello", "token_ids": [0]}"#.to_string(),
        format!(r#"{{"request_id": "x", "prompt": "{text}", "prompt_tokens": 5}}"#),
    ] {
        service
            .post_json("/v1/deployments/t/route", "POST", &bad)
            .await
            .assert_error(400, &bad);
    }
    service.stop().await;
}

/// Publishes an `admitted` of class `class` (wire 1.4 `cls`) and flushes.
async fn admit_in_class(
    client: &async_nats::Client,
    seq: u64,
    worker_id: u64,
    request_id: &str,
    class: Option<&str>,
) {
    let envelope = Envelope::new(
        31,
        seq,
        wire::unix_micros_now(),
        Admitted {
            block_hashes: Vec::new(),
            block_capacity: None,
            class: class.map(str::to_owned),
            request_id: request_id.into(),
            worker_id,
            dp_rank: 0,
            prompt_tokens: 100,
            expected_output_tokens: Some(20),
            cached_tokens: None,
        },
    );
    client
        .publish(
            format!("leases.c.{worker_id}"),
            wire::encode(&envelope).unwrap().into(),
        )
        .await
        .unwrap();
    timeout(Duration::from_secs(5), client.flush())
        .await
        .expect("flush in time")
        .unwrap();
}

/// Admission classes through the PUT body: bad ones are clear JSON 400s that create or
/// change nothing; good ones are shown, changed and removed; each class's requests in flight
/// (from the workers' `admitted`, `cls` or not) are on /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_classes_over_http() {
    let service = Service::start(None).await;
    let publisher = common::client(&service.nats.url()).await.client().clone();
    let many: Vec<String> = (0..65)
        .map(|i| format!(r#"{{"name": "c{i}", "band": 0, "weight": 1}}"#))
        .collect();
    let too_many = format!(
        r#"{{"classes": [{}], "default_class": "c0"}}"#,
        many.join(",")
    );
    for (bad, needle) in [
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": 0}], "default_class": "a"}"#,
            "weight must be a finite number above 0",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": 1000.5}], "default_class": "a"}"#,
            "at most 1000",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": -2}], "default_class": "a"}"#,
            "weight must be",
        ),
        (
            r#"{"classes": [{"name": "a.b", "band": 0, "weight": 1}], "default_class": "a.b"}"#,
            "invalid class name \"a.b\"",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": 1}, {"name": "a", "band": 1, "weight": 1}], "default_class": "a"}"#,
            "given twice",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": 1}]}"#,
            "default_class is required",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": 1}], "default_class": "b"}"#,
            "default_class \"b\" is not one of the classes",
        ),
        (r#"{"default_class": "a"}"#, "without classes"),
        (
            r#"{"classes": [{"name": "a", "band": 256, "weight": 1}], "default_class": "a"}"#,
            "invalid JSON body",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": 1, "colour": 1}], "default_class": "a"}"#,
            "unknown field `colour`",
        ),
        (
            r#"{"classes": [{"name": "a", "weight": 1}], "default_class": "a"}"#,
            "missing field `band`",
        ),
        (r#"{"classes": {"name": "a"}}"#, "invalid JSON body"),
        (too_many.as_str(), "65 classes: a deployment has at most 64"),
        // Weights JSON has no number for: a string, null, NaN, out of f64's range.
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": "4"}], "default_class": "a"}"#,
            "invalid type: string \"4\", expected f64",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": null}], "default_class": "a"}"#,
            "invalid type: null, expected f64",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": NaN}], "default_class": "a"}"#,
            "invalid JSON body",
        ),
        (
            r#"{"classes": [{"name": "a", "band": 0, "weight": 1e999}], "default_class": "a"}"#,
            "number out of range",
        ),
        ("[1, 2]", "invalid JSON body"),
        ("\"classes\"", "invalid JSON body"),
        // A queue with no bound: it would hold requests without end, in memory and in time.
        (
            r#"{"queue": {"max_queued": 65537}}"#,
            "max_queued must be at most 65536",
        ),
        (
            r#"{"queue": {"max_wait_ms": 18446744073709551615}}"#,
            "max_wait_ms must be at most 600000",
        ),
    ] {
        let error = service
            .post_json("/v1/deployments/c", "PUT", bad)
            .await
            .assert_error(400, bad);
        assert!(error.contains(needle), "{bad}: {error}");
    }
    assert_eq!(
        service.get("/v1/deployments/c").await.status,
        404,
        "a bad body creates nothing"
    );

    let good = r#"{"classes": [{"name": "premium", "band": 1, "weight": 4}, {"name": "regular", "band": 0, "weight": 1}], "default_class": "regular"}"#;
    let reply = service.post_json("/v1/deployments/c", "PUT", good).await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    let admission = &reply.json()["admission"];
    assert_eq!(admission["default_class"], "regular", "{admission}");
    assert_eq!(
        admission["classes"],
        serde_json::json!([
            {"name": "premium", "band": 1, "weight": 4.0},
            {"name": "regular", "band": 0, "weight": 1.0},
        ])
    );
    // A PUT without classes keeps them; a bad default alone changes nothing.
    let reply = service
        .post_json("/v1/deployments/c", "PUT", r#"{"policy": "round_robin"}"#)
        .await;
    assert_eq!(reply.json()["admission"]["default_class"], "regular");
    service
        .post_json("/v1/deployments/c", "PUT", r#"{"default_class": "gold"}"#)
        .await
        .assert_error(400, "an unknown default");
    let reply = service
        .post_json(
            "/v1/deployments/c",
            "PUT",
            r#"{"default_class": "premium"}"#,
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["admission"]["default_class"], "premium");
    let reply = service.post_json("/v1/deployments/c", "PUT", good).await;
    assert_eq!(reply.json()["admission"]["default_class"], "regular");

    // Two premium, one regular, one unclassed and one of an unknown class (both: regular).
    admit_in_class(&publisher, 1, 7, "a", Some("premium")).await;
    admit_in_class(&publisher, 2, 7, "b", Some("premium")).await;
    admit_in_class(&publisher, 3, 8, "c", Some("regular")).await;
    admit_in_class(&publisher, 4, 8, "d", None).await;
    admit_in_class(&publisher, 5, 8, "e", Some("gold")).await;
    let series = |class: &str, what: &str| {
        format!("lease_router_class_inflight_{what}{{deployment=\"c\",class=\"{class}\"}}")
    };
    let text = poll("five admissions counted", || async {
        let text = service.metrics().await;
        (metric(&text, &series("regular", "requests")) == Some(3.0)).then_some(text)
    })
    .await;
    assert_eq!(metric(&text, &series("premium", "requests")), Some(2.0));
    assert_eq!(metric(&text, &series("premium", "tokens")), Some(240.0));
    assert_eq!(metric(&text, &series("regular", "tokens")), Some(360.0));
    let shown = service.get("/v1/deployments/c").await.json();
    let admission = &shown["admission"];
    assert_eq!(admission["default_class"], "regular", "{shown}");
    assert_eq!(admission["saturation_now"]["saturated"], false, "{shown}");
    assert_eq!(admission["saturation_now"]["members"], 2, "{shown}");
    assert_eq!(
        admission["per_class"][0],
        serde_json::json!({"class": "premium", "band": 1, "weight": 4.0,
            "in_flight_requests": 2, "in_flight_tokens": 240, "admitted": 0, "queued": 0,
            "waiting": 0, "refused": 0, "abandoned": 0,
            "wait": {"count": 0, "sum_seconds": 0.0}}),
        "{shown}"
    );

    // A route request names its class (an invalid name is refused); the provisional
    // booking counts at once.
    let reply = service
        .post_json(
            "/v1/deployments/c/route",
            "POST",
            r#"{"request_id": "r1", "prompt_tokens": 10, "class": "premium"}"#,
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let text = service.metrics().await;
    assert_eq!(metric(&text, &series("premium", "requests")), Some(3.0));
    let error = service
        .post_json(
            "/v1/deployments/c/route",
            "POST",
            r#"{"request_id": "r2", "prompt_tokens": 10, "class": "no such class!"}"#,
        )
        .await
        .assert_error(400, "an invalid class name");
    assert!(error.contains("is not a class name"), "{error}");
    for (bad, needle) in [
        (
            r#"{"request_id": "r2", "prompt_tokens": 10, "class": 5}"#,
            "invalid type: integer `5`, expected a string",
        ),
        (
            r#"{"request_id": "r2", "prompt_tokens": 10, "max_wait_ms": -1}"#,
            "invalid value: integer `-1`",
        ),
        (
            r#"{"request_id": "r2", "prompt_tokens": 10, "max_wait_ms": "soon"}"#,
            "invalid type: string \"soon\"",
        ),
    ] {
        let error = service
            .post_json("/v1/deployments/c/route", "POST", bad)
            .await
            .assert_error(400, bad);
        assert!(error.contains(needle), "{bad}: {error}");
    }
    // A valid name the deployment does not have: routed, under the default class.
    let reply = service
        .post_json(
            "/v1/deployments/c/route",
            "POST",
            r#"{"request_id": "g1", "prompt_tokens": 10, "class": "gold"}"#,
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let text = service.metrics().await;
    assert_eq!(metric(&text, &series("regular", "requests")), Some(4.0));
    let admitted = |class: &str| {
        format!("lease_router_class_admitted_total{{deployment=\"c\",class=\"{class}\"}}")
    };
    assert_eq!(metric(&text, &admitted("premium")), Some(1.0), "{text}");
    assert_eq!(metric(&text, &admitted("regular")), Some(1.0), "{text}");
    assert!(!text.contains("class=\"gold\""), "{text}");
    // Released, so the saturation figures below are the workers' and r1's.
    let cancel = service.call("DELETE", "/v1/deployments/c/route/g1").await;
    assert_eq!(cancel.json()["released"], true, "{}", cancel.body);

    // Saturation: prefill waiting per member worker, (200 + 310) / 2, against the threshold.
    let saturated = |text: &str| metric(text, "lease_router_saturated{deployment=\"c\"}");
    assert_eq!(saturated(&service.metrics().await), Some(0.0));
    for bad in [
        r#"{"saturation": {"max_kv_share": 1.5}}"#,
        r#"{"saturation": {"kv_capacity_tokens": 0}}"#,
        r#"{"saturation": {"max_prefill": 1}}"#,
    ] {
        service
            .post_json("/v1/deployments/c", "PUT", bad)
            .await
            .assert_error(400, bad);
    }
    let reply = service
        .post_json(
            "/v1/deployments/c",
            "PUT",
            r#"{"saturation": {"max_prefill_tokens_per_worker": 255}}"#,
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["admission"]["saturation"]["max_prefill_tokens_per_worker"],
        255
    );
    assert_eq!(
        reply.json()["admission"]["default_class"],
        "regular",
        "kept"
    );
    assert_eq!(saturated(&service.metrics().await), Some(0.0), "at it");
    service
        .post_json(
            "/v1/deployments/c",
            "PUT",
            r#"{"saturation": {"max_prefill_tokens_per_worker": 254}}"#,
        )
        .await;
    assert_eq!(saturated(&service.metrics().await), Some(1.0), "past it");
    // KV held (510 tokens) against two workers of 500: past a share of 0.5.
    service
        .post_json(
            "/v1/deployments/c",
            "PUT",
            r#"{"saturation": {"kv_capacity_tokens": 500, "max_kv_share": 0.6}}"#,
        )
        .await;
    assert_eq!(saturated(&service.metrics().await), Some(0.0));
    service
        .post_json(
            "/v1/deployments/c",
            "PUT",
            r#"{"saturation": {"kv_capacity_tokens": 500, "max_kv_share": 0.5}}"#,
        )
        .await;
    assert_eq!(saturated(&service.metrics().await), Some(1.0));

    // Removed: no admission, no class series.
    let reply = service
        .post_json("/v1/deployments/c", "PUT", r#"{"classes": []}"#)
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["admission"]["classes"], serde_json::json!([]));
    let text = service.metrics().await;
    assert!(
        !text.lines().any(|l| l.starts_with("lease_router_class_")),
        "{text}"
    );
    service.stop().await;
}

/// While saturated, a route request of a class over its part of the room is answered 429
/// with a JSON error and `Retry-After`: at once when the queue is full, after its wait
/// otherwise; one whose client goes away leaves the queue. A class under its part is routed
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_deployment_answers_429_with_retry_after() {
    let service = Service::start(None).await;
    let publisher = common::client(&service.nats.url()).await.client().clone();
    let put = |body: &'static str| service.post_json("/v1/deployments/c", "PUT", body);
    let reply = put(r#"{"classes": [{"name": "premium", "band": 0, "weight": 4}, {"name": "regular", "band": 0, "weight": 1}], "default_class": "regular", "saturation": {"max_prefill_tokens_per_worker": 50}, "queue": {"max_queued": 0, "max_wait_ms": 2500}}"#).await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    assert_eq!(reply.json()["admission"]["queue"]["max_queued"], 0);
    // Another replica's premium request: 100 prefill tokens waiting on the only worker.
    admit_in_class(&publisher, 1, 7, "a", Some("premium")).await;
    poll("saturated", || async {
        let text = service.metrics().await;
        (metric(&text, "lease_router_saturated{deployment=\"c\"}") == Some(1.0)).then_some(())
    })
    .await;
    let route = |body: &'static str| service.post_json("/v1/deployments/c/route", "POST", body);
    let premium = r#"{"request_id": "p1", "prompt_tokens": 10, "class": "premium"}"#;
    let started = Instant::now();
    let reply = route(premium).await;
    let error = reply.assert_error(429, "the queue holds none");
    assert!(started.elapsed() < Duration::from_secs(1), "at once");
    assert!(
        error.contains("saturated") && error.contains("premium"),
        "{error}"
    );
    assert_eq!(
        reply.header("retry-after"),
        Some("3"),
        "the wait, rounded up"
    );
    let reply = route(r#"{"request_id": "r1", "prompt_tokens": 10, "class": "regular"}"#).await;
    assert_eq!(reply.status, 200, "under its part: {}", reply.body);

    // A queue: the request waits its own max_wait_ms, then 429.
    assert_eq!(
        put(r#"{"queue": {"max_queued": 4, "max_wait_ms": 3000}}"#)
            .await
            .status,
        200
    );
    let started = Instant::now();
    route(r#"{"request_id": "p2", "prompt_tokens": 10, "class": "premium", "max_wait_ms": 200}"#)
        .await
        .assert_error(429, "waited");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(2),
        "{waited:?}"
    );

    // A client that gives up: its request leaves the queue at once, not at its deadline.
    let served = service.serve().await;
    let asked = Instant::now();
    let gone = served
        .client
        .post(format!("http://{}/v1/deployments/c/route", served.addr))
        .timeout(Duration::from_millis(100))
        .header("content-type", "application/json")
        .body(r#"{"request_id": "p3", "prompt_tokens": 10, "class": "premium"}"#)
        .send()
        .await;
    assert!(gone.is_err(), "the client timed out: {gone:?}");
    let scheduler = service
        .host
        .get(&"c".parse().unwrap())
        .unwrap()
        .scheduler()
        .clone();
    poll("the abandoned request left the queue", || async {
        (scheduler.stats().admission_abandoned == 1).then_some(())
    })
    .await;
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "before its 3 s deadline: {:?}",
        asked.elapsed()
    );
    let stats = scheduler.stats();
    assert_eq!(stats.admission_waited, 2, "p2 and p3");

    // A queue at its bound: one request waits, the next is refused at once.
    assert_eq!(
        put(r#"{"queue": {"max_queued": 1, "max_wait_ms": 3000}}"#)
            .await
            .status,
        200
    );
    let waits = {
        let (client, url) = (served.client.clone(), served.addr);
        tokio::spawn(async move {
            client
                .post(format!("http://{url}/v1/deployments/c/route"))
                .header("content-type", "application/json")
                .body(r#"{"request_id": "p4", "prompt_tokens": 10, "class": "premium", "max_wait_ms": 1000}"#)
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    let class_series = |name: &str, class: &str| {
        format!("lease_router_class_{name}{{deployment=\"c\",class=\"{class}\"}}")
    };
    poll("p4 waits", || async {
        let text = service.metrics().await;
        (metric(&text, &class_series("waiting", "premium")) == Some(1.0)).then_some(())
    })
    .await;
    let started = Instant::now();
    let error = route(r#"{"request_id": "p5", "prompt_tokens": 10, "class": "premium"}"#)
        .await
        .assert_error(429, "the queue is at its bound");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "at once: {:?}",
        started.elapsed()
    );
    assert!(error.contains("queue is full (1 waiting)"), "{error}");
    assert_eq!(
        waits.await.unwrap().unwrap(),
        429,
        "p4, at the end of its wait"
    );

    // Per class, what this replica did: premium p1, p2, p5 and p4 refused, p2, p3 and p4
    // queued, p3 abandoned; regular r1 admitted. The per-deployment counters are the sums.
    let text = service.metrics().await;
    for (series, value) in [
        ("lease_router_admission_waited_total{deployment=\"c\"}", 3.0),
        ("lease_router_admission_abandoned_total{deployment=\"c\"}", 1.0),
        (
            "lease_router_route_decisions_total{deployment=\"c\",policy=\"weighted_cost\",outcome=\"refused\"}",
            4.0,
        ),
        (
            "lease_router_route_decisions_total{deployment=\"c\",policy=\"weighted_cost\",outcome=\"routed\"}",
            1.0,
        ),
        (&class_series("refused_total", "premium"), 4.0),
        (&class_series("queued_total", "premium"), 3.0),
        (&class_series("abandoned_total", "premium"), 1.0),
        (&class_series("admitted_total", "premium"), 0.0),
        (&class_series("waiting", "premium"), 0.0),
        (&class_series("queue_wait_seconds_count", "premium"), 3.0),
        (&class_series("admitted_total", "regular"), 1.0),
        (&class_series("refused_total", "regular"), 0.0),
        (&class_series("queued_total", "regular"), 0.0),
    ] {
        assert_eq!(metric(&text, series), Some(value), "{series} in {text}");
    }
    // p2 waited 0.2 s, p3 until its caller left (0.1 s or more), p4 1 s.
    let waited = metric(&text, &class_series("queue_wait_seconds_sum", "premium")).unwrap();
    assert!((1.25..3.0).contains(&waited), "{waited}");
    let shown = service.get("/v1/deployments/c").await.json();
    let premium = &shown["admission"]["per_class"][0];
    assert_eq!(premium["class"], "premium", "{shown}");
    for (field, value) in [
        ("admitted", 0),
        ("queued", 3),
        ("waiting", 0),
        ("refused", 4),
        ("abandoned", 1),
    ] {
        assert_eq!(premium[field], value, "{field}: {shown}");
    }
    assert_eq!(premium["wait"]["count"], 3, "{shown}");
    assert_eq!(shown["admission"]["per_class"][1]["admitted"], 1, "{shown}");
    drop(scheduler);
    served.stop().await;
    service.stop().await;
}
