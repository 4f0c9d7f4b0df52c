//! The HTTP API's bearer token, against a real `nats-server` started by each test on a free
//! port: every route × (no token, wrong token, right token, malformed header), in process
//! through `tower::ServiceExt::oneshot`, for both scopes (mutations only, reads too); each
//! refusal's shape and count; and once end to end over a socket. Without `nats-server` the
//! tests fail with the install hint.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request};
use lease_router::service::{
    router, serve, ApiAuth, ApiState, BearerToken, DeploymentHost, HostSettings,
    ParseBearerTokenError,
};
use lease_router::{connect, DeploymentName, NatsConnectConfig};
use lease_router_testkit::NatsServer;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

const TOKEN: &str = "tok-7c1e9b2f4d";
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The documented refusal: 401, `WWW-Authenticate: Bearer ...`, a JSON `{"error"}` only.
    fn assert_refused(&self, what: &str) {
        assert_eq!(self.status, 401, "{what}: {self:?}");
        let challenge = self.header("www-authenticate").unwrap_or_default();
        assert!(
            challenge.starts_with("Bearer realm=\"lease-router\""),
            "{what}: {self:?}"
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{what}"
        );
        let body: Value = serde_json::from_str(&self.body).expect("JSON");
        let keys: Vec<&String> = body.as_object().expect("an object").keys().collect();
        assert_eq!(keys, ["error"], "{what}: {body}");
        assert!(!self.body.contains(TOKEN), "{what}: the token leaked");
    }
}

/// How a request presents itself.
#[derive(Clone, Copy, Debug)]
enum Credential {
    None,
    Wrong,
    Right,
    Malformed,
}

impl Credential {
    const ALL: [Credential; 4] = [Self::None, Self::Wrong, Self::Malformed, Self::Right];

    fn header(self) -> Option<String> {
        match self {
            Self::None => None,
            Self::Wrong => Some("Bearer tok-not-the-one".into()),
            Self::Right => Some(format!("Bearer {TOKEN}")),
            // The right token under another scheme is no credential.
            Self::Malformed => Some(format!("Basic {TOKEN}")),
        }
    }

    /// The `reason` label a refusal of this credential is counted under.
    fn reason(self) -> &'static str {
        match self {
            Self::None => "missing",
            Self::Wrong => "wrong",
            Self::Malformed => "malformed",
            Self::Right => unreachable!("the right token is not refused"),
        }
    }
}

struct Api {
    _nats: NatsServer,
    host: DeploymentHost,
    state: ApiState,
    app: axum::Router,
}

impl Api {
    /// A router hosting `auth-a`, behind `auth` (if any).
    async fn start(auth: Option<ApiAuth>) -> Self {
        let nats = common::server().await;
        let config = NatsConnectConfig::new([nats.url()])
            .with_name("http_auth test")
            .with_connect_deadline(Duration::from_secs(10));
        let connection = connect(&config).await.expect("connect");
        let host = DeploymentHost::new(connection, HostSettings::default());
        host.add(&name("auth-a")).await.expect("hosted");
        let mut state = ApiState::new(host.clone());
        if let Some(auth) = auth {
            state = state.with_auth(auth);
        }
        Self {
            _nats: nats,
            host,
            app: router(state.clone()),
            state,
        }
    }

    async fn send(&self, method: &str, path: &str, headers: &[(&str, &[u8])]) -> Reply {
        let mut request = Request::builder().method(method).uri(path);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let body = if path.ends_with("/route") {
            Body::from(r#"{"request_id": "auth-r", "prompt_tokens": 10}"#)
        } else {
            Body::empty()
        };
        let exchange = async {
            let response = self
                .app
                .clone()
                .oneshot(request.body(body).unwrap())
                .await
                .expect("infallible");
            let (parts, body) = response.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
            Reply {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body: String::from_utf8(body.to_vec()).expect("UTF-8"),
            }
        };
        timeout(REQUEST_TIMEOUT, exchange)
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: no answer"))
    }

    async fn call(&self, method: &str, path: &str, credential: Credential) -> Reply {
        let header = credential.header();
        let headers: Vec<(&str, &[u8])> = header
            .iter()
            .map(|h| ("authorization", h.as_bytes()))
            .collect();
        self.send(method, path, &headers).await
    }

    /// `lease_router_http_auth_failures_total` by reason, read with the token.
    async fn failures(&self) -> BTreeMap<String, u64> {
        let reply = self.call("GET", "/metrics", Credential::Right).await;
        assert_eq!(reply.status, 200, "{reply:?}");
        reply
            .body
            .lines()
            .filter_map(|l| l.strip_prefix("lease_router_http_auth_failures_total{reason=\""))
            .map(|l| {
                let (reason, value) = l.split_once("\"} ").expect("one label");
                (reason.to_owned(), value.parse().expect("a count"))
            })
            .collect()
    }

    fn hosts(&self, deployment: &str) -> bool {
        self.host.get(&name(deployment)).is_some()
    }

    async fn stop(self) {
        timeout(Duration::from_secs(30), self.host.shutdown_all())
            .await
            .expect("shutdown_all ends")
            .expect("clean shutdown");
        assert_eq!(self.host.live_tasks(), 0);
    }
}

fn name(raw: &str) -> DeploymentName {
    DeploymentName::new(raw).unwrap()
}

fn token() -> BearerToken {
    // Whitespace around the token, as a file would have it, is not part of it.
    BearerToken::new(&format!("  {TOKEN}\n")).expect("a token")
}

/// What a route is to the token check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// The probes and the status page's HTML: never checked.
    Open,
    /// Checked only when reads are protected.
    Read,
    /// Always checked.
    Write,
}

/// Every route (and a wrong route and method), with its class and its answer to the right
/// token. PUT creates `auth-b`, DELETE removes it: in this order.
const ROUTES: [(&str, &str, Class, u16); 14] = [
    ("GET", "/", Class::Open, 200),
    ("GET", "/healthz", Class::Open, 200),
    ("GET", "/readyz", Class::Open, 200),
    ("GET", "/metrics", Class::Read, 200),
    ("GET", "/v1/deployments", Class::Read, 200),
    ("GET", "/v1/deployments/auth-a", Class::Read, 200),
    ("GET", "/v1/deployments/auth-a/leases", Class::Read, 200),
    ("GET", "/v1/deployments/auth-a/workers", Class::Read, 200),
    // A decision query: no worker has spoken, so 409 once let through.
    ("POST", "/v1/deployments/auth-a/route", Class::Read, 409),
    ("GET", "/no-such-route", Class::Read, 404),
    ("PUT", "/v1/deployments/auth-b", Class::Write, 201),
    ("DELETE", "/v1/deployments/auth-b", Class::Write, 204),
    // An unknown route or a wrong method is no way around the token.
    ("PUT", "/no-such-route", Class::Write, 404),
    ("DELETE", "/metrics", Class::Write, 405),
];

/// Every route × every credential; returns the refusals expected by reason.
async fn every_route_and_credential(api: &Api, protect_reads: bool) -> BTreeMap<String, u64> {
    let mut expected: BTreeMap<String, u64> = ["missing", "malformed", "wrong"]
        .into_iter()
        .map(|r| (r.to_owned(), 0))
        .collect();
    for (method, path, class, right_status) in ROUTES {
        let guarded = match class {
            Class::Open => false,
            Class::Read => protect_reads,
            Class::Write => true,
        };
        for credential in Credential::ALL {
            let what =
                format!("{method} {path} with {credential:?} (reads protected: {protect_reads})");
            let before_b = api.hosts("auth-b");
            let reply = api.call(method, path, credential).await;
            match credential {
                Credential::Right => assert_eq!(reply.status, right_status, "{what}: {reply:?}"),
                _ if guarded => {
                    reply.assert_refused(&what);
                    *expected.get_mut(credential.reason()).unwrap() += 1;
                    assert_eq!(
                        api.hosts("auth-b"),
                        before_b,
                        "{what}: a refusal changes nothing"
                    );
                }
                // Unguarded: the header is not looked at.
                _ => assert_eq!(reply.status, right_status, "{what}: {reply:?}"),
            }
        }
    }
    expected
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutations_need_the_token_reads_stay_open() {
    let api = Api::start(Some(ApiAuth::new(token()))).await;
    let expected = every_route_and_credential(&api, false).await;
    assert_eq!(api.failures().await, expected);
    assert_eq!(expected["missing"], 4, "{expected:?}");
    assert!(!api.hosts("auth-b"));
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_reads_need_the_token_but_probes_and_the_page_do_not() {
    let api = Api::start(Some(ApiAuth::new(token()).protect_reads(true))).await;
    let expected = every_route_and_credential(&api, true).await;
    assert_eq!(api.failures().await, expected);
    assert_eq!(expected["missing"], 11, "{expected:?}");
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_auth_everything_is_open_and_nothing_is_counted() {
    let api = Api::start(None).await;
    for (method, path, _, right_status) in ROUTES {
        // A header that would be refused is not even looked at.
        let reply = api.call(method, path, Credential::Wrong).await;
        assert_eq!(reply.status, right_status, "{method} {path}: {reply:?}");
    }
    assert!(api.failures().await.values().all(|&n| n == 0));
    api.stop().await;
}

/// Headers that are not one `Bearer <token>`: refused as malformed, never as a match, even
/// when they hold the right token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_authorization_headers_are_refused_and_the_scheme_is_case_insensitive() {
    let api = Api::start(Some(ApiAuth::new(token()))).await;
    let right = format!("Bearer {TOKEN}");
    let malformed: Vec<Vec<u8>> = vec![
        b"Bearer".to_vec(),
        b"Bearer ".to_vec(),
        format!("Bearer  {TOKEN}").into_bytes(),
        format!("Bearer {TOKEN} extra").into_bytes(),
        format!("Bearer{TOKEN}").into_bytes(),
        format!("Token {TOKEN}").into_bytes(),
        TOKEN.as_bytes().to_vec(),
        format!("Bearer {TOKEN}\u{e9}").into_bytes(),
        b"Bearer \xff\xfe".to_vec(),
    ];
    for value in &malformed {
        let what = format!("Authorization: {:?}", String::from_utf8_lossy(value));
        let reply = api
            .send("PUT", "/v1/deployments/auth-c", &[("authorization", value)])
            .await;
        reply.assert_refused(&what);
        assert!(
            reply
                .header("www-authenticate")
                .unwrap()
                .contains("error=\"invalid_request\""),
            "{what}"
        );
    }
    // Two Authorization headers, even both right: ambiguous, refused.
    let reply = api
        .send(
            "PUT",
            "/v1/deployments/auth-c",
            &[
                ("authorization", right.as_bytes()),
                ("authorization", right.as_bytes()),
            ],
        )
        .await;
    reply.assert_refused("two Authorization headers");
    assert!(!api.hosts("auth-c"));
    let failures = api.failures().await;
    assert_eq!(failures["malformed"], malformed.len() as u64 + 1);
    assert_eq!(failures["wrong"], 0);

    // A wrong token of the right length, and a prefix of the right one: wrong, not accepted.
    let same_length = format!("Bearer {}", "x".repeat(TOKEN.len()));
    let prefix = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
    let longer = format!("Bearer {TOKEN}0");
    for value in [&same_length, &prefix, &longer] {
        let reply = api
            .send(
                "PUT",
                "/v1/deployments/auth-c",
                &[("authorization", value.as_bytes())],
            )
            .await;
        reply.assert_refused(value);
        assert!(reply
            .header("www-authenticate")
            .unwrap()
            .contains("error=\"invalid_token\""));
    }
    assert_eq!(api.failures().await["wrong"], 3);

    let lower = format!("bearer {TOKEN}");
    let reply = api
        .send(
            "PUT",
            "/v1/deployments/auth-c",
            &[("authorization", lower.as_bytes())],
        )
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(api.hosts("auth-c"));
    api.stop().await;
}

#[test]
fn tokens_are_trimmed_refused_when_empty_and_never_shown() {
    assert_eq!(
        BearerToken::new("").err(),
        Some(ParseBearerTokenError::Empty)
    );
    assert_eq!(
        BearerToken::new(" \n\t ").err(),
        Some(ParseBearerTokenError::Empty)
    );
    assert_eq!(
        BearerToken::new("abc def").err(),
        Some(ParseBearerTokenError::InvalidCharacter { position: 3 })
    );
    assert!(BearerToken::new("caf\u{e9}").is_err());
    let auth = ApiAuth::new(token()).protect_reads(true);
    let shown = format!("{auth:?} {:?}", token());
    assert!(!shown.contains(TOKEN), "{shown}");
    assert!(shown.contains("redacted"), "{shown}");
    for err in [
        BearerToken::new("").unwrap_err(),
        BearerToken::new("tok-7c1e 9b2f4d").unwrap_err(),
    ] {
        assert!(!err.to_string().contains("7c1e"), "{err}");
    }
}

/// Over a socket with a real client: the served router refuses, then obeys the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_over_a_socket() {
    let api = Api::start(Some(ApiAuth::new(token()).protect_reads(true))).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve(listener, api.state.clone(), shutdown.clone()));
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .unwrap();
    let url = |path: &str| format!("http://{addr}{path}");

    let refused = client
        .put(url("/v1/deployments/auth-d"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(
        refused.headers()["www-authenticate"],
        "Bearer realm=\"lease-router\""
    );
    let body: Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    assert!(body["error"].as_str().unwrap().contains("Bearer"), "{body}");
    assert!(!api.hosts("auth-d"));

    let created = client
        .put(url("/v1/deployments/auth-d"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    assert!(api.hosts("auth-d"));

    let listed = client.get(url("/v1/deployments")).send().await.unwrap();
    assert_eq!(listed.status(), 401);
    let listed = client
        .get(url("/v1/deployments"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(
        listed["deployments"].as_array().unwrap().len(),
        2,
        "{listed}"
    );
    // The probes and the page stay open.
    for path in ["/healthz", "/readyz", "/"] {
        let reply = client.get(url(path)).send().await.unwrap();
        assert_eq!(reply.status(), 200, "{path}");
    }

    shutdown.cancel();
    timeout(Duration::from_secs(10), task)
        .await
        .expect("the HTTP server stops")
        .unwrap()
        .unwrap();
    api.stop().await;
}
