//! The HTTP API (axum, JSON) and `/metrics`.
//!
//! | route | answer |
//! | --- | --- |
//! | `GET /` | the status page: one self-contained HTML page that reads the routes below |
//! | `GET /healthz` | 200 while the client reports its NATS connection up (a silent partition turns it 503 within three ping intervals), 503 otherwise |
//! | `GET /readyz` | 200 once every deployment's router is live (and the [`ReadinessHook`], if any, agrees), 503 otherwise; `degraded` lists durable deployments whose stream lacked events they needed |
//! | `GET /metrics` | OpenMetrics text (see [`super::metrics`]) |
//! | `GET /v1/deployments` | the deployments with their active lease counts |
//! | `GET /v1/deployments/{name}` | one deployment, its ingress counters, in durable mode its catch-up, and its admission (settings, saturation now, each class's in-flight work and this replica's admission counts) |
//! | `PUT /v1/deployments/{name}` | start a router: 201, 200 if it exists, 400 for an invalid name or body, 503 if NATS does not answer within the connect deadline; an optional JSON body `{"policy": "...", "weights": {"prefill": x, "kv": y}, "classes": [{"name", "band", "weight"}], "default_class": "...", "saturation": {"max_prefill_tokens_per_worker", "kv_capacity_tokens", "max_kv_share"}, "queue": {"max_queued", "max_wait_ms"}}` sets its routing, admission classes, saturation thresholds and admission queue (also of a router that exists; `"classes": []` removes the classes, `default_class` alone changes the default among the classes in force, what is left out is kept) |
//! | `DELETE /v1/deployments/{name}` | tear it down: 204, 404 if absent |
//! | `GET /v1/deployments/{name}/leases?limit=N` | active leases (default limit 1000) |
//! | `GET /v1/deployments/{name}/workers` | load by phase of each member worker, with its last-seen age, and the least loaded |
//! | `POST /v1/deployments/{name}/route` | a routing decision for the JSON body `{"request_id", "prompt_tokens", "cached_tokens"?, "expected_output_tokens"?, "token_ids"?, "block_hashes"?, "class"?, "max_wait_ms"?}`, booked provisionally: 200 with the worker, the policy and the candidates with their costs and prefix overlaps; 404 unknown deployment, 409 no live worker, 400 missing or nonsense sizes, 429 (with `Retry-After`) saturated and the request's class could not be admitted within its wait or the queue is full, 503 leases full or router gone |
//! | `DELETE /v1/deployments/{name}/route/{request_id}` | release this replica's provisional booking of `request_id` at once (the request never reached its worker): 200 `{"request_id", "released": true}`, or `"released": false` when there is none (any more: released already, admitted by its worker, expired); idempotent; 404 unknown deployment |
//!
//! Every error is JSON, `{"error": "..."}`, also those axum would answer itself: an
//! unknown route (404), a wrong method (405, with its `Allow` header), a name in the path
//! that is not UTF-8 or not a name (400), a bad query string (400). An unknown deployment
//! is a 404.
//!
//! # Auth
//! With an [`ApiAuth`], every request but the probes (`/healthz`, `/readyz`) and the status
//! page's HTML (`GET /`, which holds no data) is checked against its bearer token: always the
//! mutating ones (`PUT` and `DELETE`, and any method that is not a read), the reads too
//! (`GET`, and `POST .../route`) when it protects reads. `POST .../route` counts as a read: it
//! is the question a gateway asks for every request, and its effect, a provisional booking,
//! is taken over or released by the worker's own events. A refusal is a 401 with a JSON
//! error and a `WWW-Authenticate: Bearer` header, counted by reason in
//! `lease_router_http_auth_failures_total`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::host::{AddDeploymentError, AddOutcome, DeploymentHost, DeploymentView};
use super::metrics::{AuthFailure, Metrics, CONTENT_TYPE};
use crate::admission::{AdmissionClass, AdmissionConfig, QueueConfig, SaturationConfig};
use crate::lease::LeaseState;
use crate::load::WorkerLoad;
use crate::routing::{CostWeights, RoutePolicy, RouteRequest, RouteRequestError, RoutingConfig};
use crate::scheduler::WorkerStatus;
use crate::subject::DeploymentName;
use crate::types::WorkerWithDpRank;

/// Leases listed when no `limit` is given.
pub(super) const DEFAULT_LEASE_LIMIT: usize = 1000;
/// The largest `limit` honoured.
pub(super) const MAX_LEASE_LIMIT: usize = 100_000;
/// How long a scheduler may take to answer a worker listing.
const SCHEDULER_QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// Something else that must agree before `/readyz` says ready, such as a durable ingress
/// that is still replaying its stream.
pub trait ReadinessHook: Send + Sync + 'static {
    /// `None` when ready; otherwise why not (for example `"catching up: 1200 events
    /// behind"`).
    fn not_ready(&self) -> Option<String>;
}

impl<F> ReadinessHook for F
where
    F: Fn() -> Option<String> + Send + Sync + 'static,
{
    fn not_ready(&self) -> Option<String> {
        self()
    }
}

/// What every handler shares. Cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    host: DeploymentHost,
    metrics: Arc<Metrics>,
    readiness: Option<Arc<dyn ReadinessHook>>,
    auth: Option<ApiAuth>,
}

impl ApiState {
    /// The API of `host`, with its metrics, open to anyone who can reach it (see
    /// [`ApiState::with_auth`]).
    pub fn new(host: DeploymentHost) -> Self {
        Self {
            metrics: Arc::new(Metrics::new(host.clone())),
            host,
            readiness: None,
            auth: None,
        }
    }

    /// Requests must carry `auth`'s bearer token (which ones: see the module's Auth section).
    pub fn with_auth(mut self, auth: ApiAuth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// Serves these metrics on `/metrics` instead (to add more collectors to the registry).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Arc::new(metrics);
        self
    }

    /// `/readyz` also asks `hook`.
    pub fn with_readiness_hook(mut self, hook: Arc<dyn ReadinessHook>) -> Self {
        self.readiness = Some(hook);
        self
    }

    /// The host the API serves.
    pub fn host(&self) -> &DeploymentHost {
        &self.host
    }

    /// The metrics served on `/metrics`.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// A bearer token the API demands. Its `Debug` never shows it, and it is compared in time
/// that does not depend on the bytes compared.
#[derive(Clone)]
pub struct BearerToken(Arc<str>);

/// Why a string is not a usable bearer token. The token itself is never part of it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseBearerTokenError {
    /// The string is empty after trimming whitespace.
    #[error("the token is empty (after trimming whitespace)")]
    Empty,
    #[error(
        "the token has a character a client cannot send in an Authorization header (byte \
         {position}); use visible ASCII, such as the output of `openssl rand -hex 32`"
    )]
    /// The string has a byte a client cannot send in an `Authorization` header.
    InvalidCharacter {
        /// The offending byte's offset in the token.
        position: usize,
    },
}

impl BearerToken {
    /// `token` with surrounding whitespace (a file's trailing newline) trimmed.
    ///
    /// # Errors
    /// [`ParseBearerTokenError`] for an empty token, or one with a character that is not
    /// visible ASCII (a client could not send it).
    pub fn new(token: &str) -> Result<Self, ParseBearerTokenError> {
        let token = token.trim();
        if token.is_empty() {
            return Err(ParseBearerTokenError::Empty);
        }
        if let Some(position) = token.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(ParseBearerTokenError::InvalidCharacter { position });
        }
        Ok(Self(token.into()))
    }

    /// Whether `presented` is this token, in time that does not depend on where they differ
    /// (`subtle` keeps the compiler from turning the comparison into an early exit). Only
    /// the length can show, as with every such comparison: use a long random token.
    pub fn matches(&self, presented: impl AsRef<[u8]>) -> bool {
        bool::from(self.0.as_bytes().ct_eq(presented.as_ref()))
    }
}

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

/// Who may call the API: the holders of one bearer token, for the mutating routes and,
/// if asked, for the reads.
#[derive(Clone, Debug)]
pub struct ApiAuth {
    token: BearerToken,
    protect_reads: bool,
}

impl ApiAuth {
    /// The mutating routes need `token`; reads stay open.
    pub fn new(token: BearerToken) -> Self {
        Self {
            token,
            protect_reads: false,
        }
    }

    /// Whether the reads (`/metrics`, the `GET`s of `/v1`, `POST .../route`) need the token
    /// too. The probes and the status page's HTML never do.
    pub fn protect_reads(mut self, protect: bool) -> Self {
        self.protect_reads = protect;
        self
    }

    /// The token requests must carry.
    pub fn token(&self) -> &BearerToken {
        &self.token
    }

    /// Whether the reads need the token too.
    pub fn reads_protected(&self) -> bool {
        self.protect_reads
    }

    fn needs_token(&self, method: &Method, path: &str) -> bool {
        match access(method, path) {
            Access::Open => false,
            Access::Read => self.protect_reads,
            Access::Write => true,
        }
    }

    fn check(&self, headers: &HeaderMap) -> Result<(), AuthFailure> {
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let value = values.next().ok_or(AuthFailure::Missing)?;
        if values.next().is_some() {
            return Err(AuthFailure::Malformed);
        }
        // The scheme is case-insensitive (RFC 9110, 11.1); one space, then the token.
        let bytes = value.as_bytes();
        let token = match bytes.split_at_checked(7) {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case(b"Bearer ") => token,
            _ => return Err(AuthFailure::Malformed),
        };
        if token.is_empty() || !token.iter().all(u8::is_ascii_graphic) {
            return Err(AuthFailure::Malformed);
        }
        if self.token.matches(token) {
            Ok(())
        } else {
            Err(AuthFailure::Wrong)
        }
    }
}

/// What a request is, for the token check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// The probes and the status page's HTML.
    Open,
    /// Reads, and the route decision.
    Read,
    /// Everything else: a method that is not a read is checked as a write, whatever the path.
    Write,
}

fn access(method: &Method, path: &str) -> Access {
    let reads = [Method::GET, Method::HEAD, Method::OPTIONS];
    match path {
        "/healthz" | "/readyz" => return Access::Open,
        "/" if method == Method::GET || method == Method::HEAD => return Access::Open,
        _ => {}
    }
    if reads.contains(method) {
        return Access::Read;
    }
    let segments: Vec<&str> = path.split('/').collect();
    let is_route =
        matches!(segments.as_slice(), ["", "v1", "deployments", name, "route"] if !name.is_empty());
    if method == Method::POST && is_route {
        Access::Read
    } else {
        Access::Write
    }
}

/// Refuses a request without the token where one is needed: 401, JSON, `WWW-Authenticate`.
async fn authorize(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    let Some(auth) = &state.auth else {
        return next.run(request).await;
    };
    if !auth.needs_token(request.method(), request.uri().path()) {
        return next.run(request).await;
    }
    let failure = match auth.check(request.headers()) {
        Ok(()) => return next.run(request).await,
        Err(failure) => failure,
    };
    state.metrics.count_auth_failure(failure);
    let (message, challenge) = match failure {
        AuthFailure::Missing => (
            "this route needs the API's bearer token: send the header `Authorization: Bearer \
             <token>`",
            r#"Bearer realm="lease-router""#,
        ),
        AuthFailure::Malformed => (
            "the Authorization header is not one `Bearer <token>` (visible ASCII)",
            r#"Bearer realm="lease-router", error="invalid_request""#,
        ),
        AuthFailure::Wrong => (
            "the bearer token is not the API's",
            r#"Bearer realm="lease-router", error="invalid_token""#,
        ),
    };
    let mut response = ApiError(StatusCode::UNAUTHORIZED, message.into()).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(challenge),
    );
    response
}

/// The routes, for embedding in a larger router or serving with [`serve`].
pub fn router(state: ApiState) -> axum::Router {
    axum::Router::new()
        .route("/", get(status_page))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/deployments", get(list_deployments))
        .route(
            "/v1/deployments/{name}",
            get(get_deployment)
                .put(put_deployment)
                .delete(delete_deployment),
        )
        .route("/v1/deployments/{name}/leases", get(leases))
        .route("/v1/deployments/{name}/workers", get(workers))
        .route("/v1/deployments/{name}/route", post(route))
        .route(
            "/v1/deployments/{name}/prefix/{worker_id}",
            get(worker_prefix),
        )
        .route(
            "/v1/deployments/{name}/route/{request_id}",
            axum::routing::delete(cancel_route),
        )
        .fallback(not_found)
        // After the routes: it applies to those registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        // Around everything, fallbacks included: an unknown route is no way around the token.
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .with_state(state)
}

/// The status page: data-free HTML whose script reads the JSON routes (sending the token
/// the user types when reads are protected).
const STATUS_PAGE: &str = include_str!("status.html");

/// Nothing but the page itself may load: no script, style or image from elsewhere.
const STATUS_PAGE_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; \
    style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

async fn status_page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, STATUS_PAGE_CSP),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        STATUS_PAGE,
    )
        .into_response()
}

/// Serves the API on `listener` until `shutdown` fires, then lets requests in progress
/// finish.
///
/// # Errors
/// An I/O error of the server.
pub async fn serve(
    listener: TcpListener,
    state: ApiState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "HTTP API listening");
    }
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await?;
    info!("HTTP API stopped");
    Ok(())
}

/// A JSON error answer.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

fn parse_name(raw: &str) -> ApiResult<DeploymentName> {
    DeploymentName::new(raw).map_err(|err| ApiError(StatusCode::BAD_REQUEST, err.to_string()))
}

fn unknown(name: &DeploymentName) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!("no deployment named {:?} is hosted", name.as_str()),
    )
}

/// The `{name}` of a deployment route, checked. Its rejection is a JSON error, where
/// axum's own `Path` rejection (a name that is not UTF-8) would be plain text.
struct NameInPath(DeploymentName);

impl<S: Send + Sync> FromRequestParts<S> for NameInPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> ApiResult<Self> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|err| {
                ApiError(
                    err.status(),
                    format!("invalid deployment name in the path: {}", err.body_text()),
                )
            })?;
        parse_name(&raw).map(Self)
    }
}

fn running_view(state: &ApiState, name: &DeploymentName) -> ApiResult<DeploymentView> {
    state.host.get(name).ok_or_else(|| unknown(name))
}

async fn not_found() -> ApiError {
    ApiError(StatusCode::NOT_FOUND, "no such route".into())
}

/// axum adds the `Allow` header to this answer.
async fn method_not_allowed(method: Method) -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "method {method} is not allowed on this route; the Allow header lists those that are"
        ),
    )
}

async fn healthz(State(state): State<ApiState>) -> Response {
    let connection = state.host.connection();
    let stats = connection.stats();
    let connected = stats.is_connected();
    let body = json!({
        "status": if connected { "ok" } else { "unavailable" },
        "nats": {
            "connected": connected,
            "server": connection.server_url(),
            "urls": connection.urls(),
            "reconnects": stats.reconnects(),
            "last_error": stats.last_error(),
        },
        "reason": (!connected).then_some("the NATS connection is down; the client is reconnecting"),
    });
    let status = if connected {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn readyz(State(state): State<ApiState>) -> Response {
    let not_ready: Vec<_> = state
        .host
        .not_ready()
        .into_iter()
        .map(|(name, why)| json!({ "deployment": name, "reason": why }))
        .collect();
    let hook = state.readiness.as_ref().and_then(|hook| hook.not_ready());
    let closed = state.host.is_closed();
    let ready = not_ready.is_empty() && hook.is_none() && !closed;
    let mut reasons: Vec<String> = Vec::new();
    if closed {
        reasons.push("shutting down".into());
    }
    if !not_ready.is_empty() {
        reasons.push(format!("{} deployment(s) not live", not_ready.len()));
    }
    reasons.extend(hook);
    let body = json!({
        "ready": ready,
        "deployments": state.host.names().len(),
        "not_ready": not_ready,
        "degraded": state.host.degraded().into_iter()
            .map(|(name, why)| json!({ "deployment": name, "reason": why }))
            .collect::<Vec<_>>(),
        "reason": (!ready).then(|| reasons.join("; ")),
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<ApiState>) -> Response {
    let text = state.metrics.render().await;
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response()
}

async fn list_deployments(State(state): State<ApiState>) -> Response {
    Json(json!({ "deployments": state.host.deployments() })).into_response()
}

async fn get_deployment(
    State(state): State<ApiState>,
    NameInPath(name): NameInPath,
) -> ApiResult<Response> {
    let summary = state
        .host
        .deployments()
        .into_iter()
        .find(|d| d.name == name)
        .ok_or_else(|| unknown(&name))?;
    let stats = state.host.ingress_stats(&name).map(|s| s.snapshot());
    let figures = state
        .host
        .figures()
        .deployments
        .into_iter()
        .find(|d| d.name == name.as_str());
    let prefix = figures.as_ref().and_then(|d| d.prefix);
    let (admission, decisions) = match state.host.get(&name) {
        Some(view) => {
            let scheduler = view.scheduler().clone();
            drop(view);
            let times = scheduler.decision_times();
            let decisions = json!({
                "count": times.count,
                "sum_seconds": times.sum_seconds,
                "buckets": times.buckets,
                "p99_at_most_seconds": times.bound_of_quantile(0.99),
            });
            (admission_figures(&scheduler).await, decisions)
        }
        None => (serde_json::Value::Null, serde_json::Value::Null),
    };
    let catch_up = figures
        .and_then(|d| d.catch_up)
        .map(|c| json!({ "done": c.done, "replayed": c.replayed, "seconds": c.seconds }));
    Ok(Json(json!({
        "deployment": summary,
        "ingress": stats,
        "catch_up": catch_up,
        "prefix": prefix,
        "admission": admission,
        "decisions": decisions,
    }))
    .into_response())
}

/// A running deployment's admission: its settings, whether it is saturated now, and per
/// class its in-flight work across the fleet with this replica's admission counts (no
/// figures when the scheduler does not answer in time).
async fn admission_figures(scheduler: &crate::scheduler::SchedulerHandle) -> serde_json::Value {
    let config = scheduler.admission();
    let figures = tokio::time::timeout(SCHEDULER_QUERY_TIMEOUT, async {
        let loads = scheduler.loads().await.ok()?;
        let classes = scheduler.class_loads().await.ok()?;
        Some((loads, classes))
    })
    .await
    .ok()
    .flatten();
    let mut json = admission_json(&config);
    if let Some((loads, classes)) = figures {
        let saturation = config.saturation().assess(loads.iter().map(|(_, l)| l));
        json["saturation_now"] = json!(saturation);
        json["per_class"] = json!(classes);
    }
    json
}

/// The optional body of a PUT: the deployment's routing and admission classes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutBody {
    policy: Option<RoutePolicy>,
    weights: Option<CostWeights>,
    /// Replaces the classes (`[]`: none, no admission).
    classes: Option<Vec<AdmissionClass>>,
    /// With `classes`, their default; alone, a new default among the classes in force.
    default_class: Option<String>,
    /// When the deployment counts as saturated (kept when absent).
    saturation: Option<SaturationConfig>,
    /// The bounds of waiting route requests (kept when absent).
    queue: Option<QueueConfig>,
}

impl PutBody {
    /// The admission classes this body asks for, over `current`; `None` when it names
    /// none.
    fn admission(&self, current: &AdmissionConfig) -> Option<AdmissionConfig> {
        if self.classes.is_none()
            && self.default_class.is_none()
            && self.saturation.is_none()
            && self.queue.is_none()
        {
            return None;
        }
        let mut config = match &self.classes {
            Some(classes) => AdmissionConfig::default()
                .with_classes(classes.clone())
                .with_saturation(current.saturation())
                .with_queue(current.queue()),
            None => current.clone(),
        };
        if let Some(queue) = self.queue {
            config = config.with_queue(queue);
        }
        if let Some(name) = &self.default_class {
            config = config.with_default_class(name.clone());
        }
        if let Some(saturation) = self.saturation {
            config = config.with_saturation(saturation);
        }
        Some(config)
    }
}

/// The admission classes as the API shows them.
fn admission_json(admission: &AdmissionConfig) -> serde_json::Value {
    json!({
        "classes": admission.classes(),
        "default_class": admission.default_class(),
        "saturation": admission.saturation(),
        "queue": admission.queue(),
    })
}

fn bad_body(err: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, format!("invalid JSON body: {err}"))
}

/// A body that could not be read (too large, say), as a JSON error where axum's own
/// rejection would be plain text.
fn unread_body(err: BytesRejection) -> ApiError {
    ApiError(
        err.status(),
        format!("the request body could not be read: {}", err.body_text()),
    )
}

async fn put_deployment(
    State(state): State<ApiState>,
    NameInPath(name): NameInPath,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body.map_err(unread_body)?;
    // Checked before anything starts: a bad body creates nothing.
    let routing = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let body: PutBody = serde_json::from_slice(&body).map_err(bad_body)?;
        if let Some(weights) = &body.weights {
            weights.validate().map_err(bad_body)?;
        }
        // A default class alone is checked against the classes in force (none for a
        // deployment not hosted yet).
        let current = state
            .host
            .get(&name)
            .map(|view| view.scheduler().admission())
            .unwrap_or_default();
        if let Some(admission) = body.admission(&current) {
            admission.validate().map_err(bad_body)?;
        }
        Some(body)
    };
    match state.host.add(&name).await {
        Ok(outcome) => {
            let (status, created) = match outcome {
                AddOutcome::Created => (StatusCode::CREATED, true),
                AddOutcome::Existed => (StatusCode::OK, false),
            };
            let scheduler = running_view(&state, &name)?.scheduler().clone();
            if let Some(admission) = routing
                .as_ref()
                .and_then(|body| body.admission(&scheduler.admission()))
            {
                scheduler.set_admission(admission).map_err(bad_body)?;
            }
            let admission = scheduler.admission();
            let applied = async {
                let current = scheduler.routing().await.map_err(|e| e.to_string())?;
                let Some(body) = routing else {
                    return Ok(current);
                };
                let wanted = RoutingConfig {
                    policy: body.policy.unwrap_or(current.policy),
                    weights: body.weights.unwrap_or(current.weights),
                    ..current
                };
                scheduler
                    .set_routing(wanted)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(wanted)
            };
            let routing = tokio::time::timeout(SCHEDULER_QUERY_TIMEOUT, applied)
                .await
                .map_err(|_| "no answer".to_owned())
                .and_then(|r| r)
                .map_err(|err| {
                    ApiError(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("the scheduler of deployment {name} did not answer: {err}"),
                    )
                })?;
            Ok((
                status,
                Json(json!({
                    "deployment": name,
                    "created": created,
                    "routing": { "policy": routing.policy, "weights": routing.weights },
                    "admission": admission_json(&admission),
                })),
            )
                .into_response())
        }
        Err(err @ AddDeploymentError::ShuttingDown { .. }) => {
            Err(ApiError(StatusCode::SERVICE_UNAVAILABLE, err.to_string()))
        }
        Err(err) => {
            warn!(error = %err, "PUT deployment failed");
            Err(ApiError(StatusCode::SERVICE_UNAVAILABLE, err.to_string()))
        }
    }
}

async fn delete_deployment(
    State(state): State<ApiState>,
    NameInPath(name): NameInPath,
) -> ApiResult<Response> {
    match state.host.remove(&name).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT.into_response()),
        Ok(false) => Err(unknown(&name)),
        Err(err) => {
            warn!(error = %err, "DELETE deployment failed");
            Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))
        }
    }
}

#[derive(Deserialize)]
struct LeasesQuery {
    limit: Option<usize>,
}

#[derive(Serialize)]
struct LeaseJson {
    request_id: String,
    worker_id: u64,
    dp_rank: u32,
    state: LeaseState,
    age_seconds: u64,
}

async fn leases(
    State(state): State<ApiState>,
    NameInPath(name): NameInPath,
    query: Result<Query<LeasesQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let Query(query) = query.map_err(|err| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("invalid query: {err}; expected ?limit=N with N a whole number"),
        )
    })?;
    let limit = query
        .limit
        .unwrap_or(DEFAULT_LEASE_LIMIT)
        .min(MAX_LEASE_LIMIT);
    let view = running_view(&state, &name)?;
    let manager = view.manager();
    let leases: Vec<LeaseJson> = manager
        .leases(limit)
        .into_iter()
        .map(|record| LeaseJson {
            request_id: record.booking.request_id.as_str().to_owned(),
            worker_id: record.booking.worker.worker_id.0,
            dp_rank: record.booking.worker.dp_rank.0,
            state: record.state,
            age_seconds: record.age.as_secs(),
        })
        .collect();
    // Counted after the listing, which events may change meanwhile: never fewer than it
    // shows (a lease admitted between a count and the listing once made `active_leases` 0
    // beside a listed lease).
    let active = manager.active_leases().max(leases.len());
    let body = json!({
        "deployment": view.name(),
        "active_leases": active,
        "limit": limit,
        "truncated": leases.len() < active && leases.len() >= limit,
        "leases": leases,
    });
    Ok(Json(body).into_response())
}

#[derive(Serialize)]
struct WorkerJson {
    worker_id: u64,
    dp_rank: u32,
    #[serde(flatten)]
    load: WorkerLoad,
}

impl WorkerJson {
    fn new((worker, load): (WorkerWithDpRank, WorkerLoad)) -> Self {
        Self {
            worker_id: worker.worker_id.0,
            dp_rank: worker.dp_rank.0,
            load,
        }
    }
}

/// A member worker in `/workers`: its load and how long ago it last spoke.
#[derive(Serialize)]
struct MemberJson {
    #[serde(flatten)]
    worker: WorkerJson,
    last_seen_ms: u64,
}

impl MemberJson {
    fn new(status: WorkerStatus) -> Self {
        Self {
            worker: WorkerJson::new((status.worker, status.load)),
            last_seen_ms: u64::try_from(status.last_seen.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

async fn workers(
    State(state): State<ApiState>,
    NameInPath(name): NameInPath,
) -> ApiResult<Response> {
    let view = running_view(&state, &name)?;
    let scheduler = view.scheduler().clone();
    // Do not hold the view (the manager) while waiting for the scheduler.
    drop(view);
    let stopped = |err: String| {
        ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the scheduler of deployment {name} did not answer: {err}"),
        )
    };
    let query = async {
        Ok::<_, crate::scheduler::QuerySchedulerError>((
            scheduler.workers().await?,
            scheduler.least_loaded().await?,
        ))
    };
    let (loads, least) = tokio::time::timeout(SCHEDULER_QUERY_TIMEOUT, query)
        .await
        .map_err(|_| stopped(format!("no answer within {SCHEDULER_QUERY_TIMEOUT:?}")))?
        .map_err(|err| stopped(err.to_string()))?;
    let body = json!({
        "deployment": name,
        "workers": loads.into_iter().map(MemberJson::new).collect::<Vec<_>>(),
        "least_loaded": least.map(WorkerJson::new),
    });
    Ok(Json(body).into_response())
}

async fn cancel_route(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
) -> ApiResult<Response> {
    let (name, request_id) = name_and(path, "request id")?;
    let view = running_view(&state, &name)?;
    let released = view.manager().cancel_route_of(&request_id);
    Ok(Json(json!({ "request_id": request_id, "released": released })).into_response())
}

/// A `/v1/deployments/{name}/.../{what}` path: the deployment and the last segment.
fn name_and(
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
    what: &str,
) -> Result<(DeploymentName, String), ApiError> {
    let Path((raw, last)) = path.map_err(|err| {
        ApiError(
            err.status(),
            format!(
                "invalid deployment name or {what} in the path: {}",
                err.body_text()
            ),
        )
    })?;
    Ok((parse_name(&raw)?, last))
}

/// What the deployment's prefix index holds of one worker, rank by rank: to check it
/// against an engine's cache (every hash, sorted).
async fn worker_prefix(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
) -> ApiResult<Response> {
    let (name, worker) = name_and(path, "worker id")?;
    let worker_id: u64 = worker.parse().map_err(|_| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("worker id {worker:?} is not an unsigned 64-bit integer"),
        )
    })?;
    let view = running_view(&state, &name)?;
    let scheduler = view.scheduler().clone();
    drop(view);
    let ranks = scheduler.prefix_view(worker_id);
    Ok(Json(json!({ "worker_id": worker_id, "ranks": ranks })).into_response())
}

/// Prompt text becomes token ids, with the host's tokenizer, on a blocking thread (a long
/// prompt takes milliseconds); without a tokenizer the request is left as it is, and refused
/// by its validation.
#[cfg(feature = "tokenizer")]
async fn tokenize(state: &ApiState, mut request: RouteRequest) -> Result<RouteRequest, ApiError> {
    let Some(tokenizer) = state.host.settings().tokenizer.clone() else {
        return Ok(request);
    };
    if request.token_ids.is_some() || request.block_hashes.is_some() {
        return Ok(request);
    }
    let Some(text) = request.prompt.take() else {
        return Ok(request);
    };
    let ids = tokio::task::spawn_blocking(move || tokenizer.token_ids(&text))
        .await
        .map_err(|err| ApiError(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))?
        .map_err(|err| ApiError(StatusCode::BAD_REQUEST, err.to_string()))?;
    request.token_ids = Some(ids);
    Ok(request)
}

async fn route(
    State(state): State<ApiState>,
    NameInPath(name): NameInPath,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let view = running_view(&state, &name)?;
    let scheduler = view.scheduler().clone();
    // Do not hold the view (the manager) while waiting for the scheduler.
    drop(view);
    let parsed = body
        .map_err(unread_body)
        .and_then(|body| serde_json::from_slice(&body).map_err(bad_body));
    let request: RouteRequest = match parsed {
        Ok(request) => request,
        Err(err) => {
            scheduler.count_invalid_request().await;
            return Err(err);
        }
    };
    #[cfg(feature = "tokenizer")]
    let request = match tokenize(&state, request).await {
        Ok(request) => request,
        Err(err) => {
            scheduler.count_invalid_request().await;
            return Err(err);
        }
    };
    // A request may wait for admission, at most the deployment's longest wait. A caller
    // that goes away drops this future and with it the answer's receiver, which takes the
    // request out of the queue.
    let waits = Duration::from_millis(scheduler.admission().queue().max_wait_ms());
    let bound = SCHEDULER_QUERY_TIMEOUT + waits;
    let decided = tokio::time::timeout(bound, scheduler.route(request))
        .await
        .map_err(|_| {
            ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the scheduler of deployment {name} did not answer within {bound:?}"),
            )
        })?;
    match decided {
        Ok(decision) => Ok(Json(json!({
            "request_id": decision.booking.request_id,
            "worker_id": decision.worker().worker_id,
            "dp_rank": decision.worker().dp_rank,
            "policy": decision.policy,
            "candidates": decision.candidates,
        }))
        .into_response()),
        Err(RouteRequestError::Overloaded { why, retry_after }) => {
            let mut response = ApiError(
                StatusCode::TOO_MANY_REQUESTS,
                format!("deployment {name} is saturated: {why}"),
            )
            .into_response();
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(retry_after.as_secs().max(1)),
            );
            Ok(response)
        }
        Err(err) => {
            let status = match err {
                RouteRequestError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
                RouteRequestError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
                RouteRequestError::NoWorkers => StatusCode::CONFLICT,
                RouteRequestError::LeasesFull
                | RouteRequestError::ManagerGone
                | RouteRequestError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
            };
            Err(ApiError(status, err.to_string()))
        }
    }
}
