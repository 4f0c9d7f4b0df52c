//! The `lease-router serve` service: many deployments in one process, an HTTP API and
//! Prometheus metrics.
//!
//! # Layout
//! - `host`: [`DeploymentHost`] runs one [`crate::router::Router`] per deployment over one
//!   shared NATS connection ([`crate::connection::NatsConnection`]). Deployments are added
//!   and removed at runtime; a removal waits for the router's tasks to end. Each name's
//!   ingress counters outlive its removal, so late drops stay visible.
//! - `metrics`: [`Metrics`], a `prometheus-client` registry whose collector reads every
//!   figure from the routers' atomics at scrape time (`lease_router_*`).
//! - `http`: the axum routes (`/`, the status page; `/healthz`, `/readyz`, `/metrics`,
//!   `/v1/deployments/...`) over an [`ApiState`], optionally behind a bearer token
//!   ([`ApiAuth`]), and [`serve`] with graceful shutdown.
//!
//! The settings come in as plain structs ([`HostSettings`],
//! [`crate::connection::NatsConnectConfig`]); reading them from flags, the environment and a
//! TOML file is the `lease-router` binary's job (the `lease-router-cli` package), so an
//! embedder compiles no argument parser.
//!
//! # Putting it together
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use lease_router::{connect, NatsConnectConfig};
//! use lease_router::service::{serve, ApiState, DeploymentHost, HostSettings};
//! use lease_router::DeploymentName;
//! use tokio_util::sync::CancellationToken;
//!
//! let connection = connect(&NatsConnectConfig::new(["nats://127.0.0.1:4222"])).await?;
//! let host = DeploymentHost::new(connection, HostSettings::default());
//! host.add(&DeploymentName::new("llama-70b")?).await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9464").await?;
//! let shutdown = CancellationToken::new();
//! // Fire `shutdown` on SIGTERM; then:
//! serve(listener, ApiState::new(host.clone()), shutdown).await?;
//! host.shutdown_all().await?;
//! # Ok(())
//! # }
//! ```

mod host;
mod http;
mod metrics;

pub use host::{
    AddDeploymentError, AddOutcome, CatchUpFigures, DeploymentFigures, DeploymentHost,
    DeploymentPhase, DeploymentSummary, DeploymentView, HostFigures, HostSettings,
    RemoveDeploymentError, ShutdownAllError, StartDeploymentIngressError,
    DEFAULT_TASK_STOP_TIMEOUT,
};
pub use http::{
    router, serve, ApiAuth, ApiState, BearerToken, ParseBearerTokenError, ReadinessHook,
};
pub use metrics::{Metrics, MetricsSource};
