//! The `lease-router serve` service: many deployments in one process, an HTTP API and
//! Prometheus metrics.
//!
//! # Layout
//! - [`host`]: [`DeploymentHost`] runs one [`crate::router::Router`] per deployment over one
//!   shared NATS connection ([`crate::connection::NatsConnection`]). Deployments are added
//!   and removed at runtime; a removal waits for the router's tasks to end. Each name's
//!   ingress counters outlive its removal, so late drops stay visible.
//! - [`metrics`]: [`Metrics`], a `prometheus-client` registry whose collector reads every
//!   figure from the routers' atomics at scrape time (`lease_router_*`).
//! - [`http`]: the axum routes (`/healthz`, `/readyz`, `/metrics`, `/v1/deployments/...`)
//!   over an [`ApiState`], and [`serve`] with graceful shutdown.
//! - [`config`]: [`ServeArgs`] (clap flags with environment fallbacks) and [`resolve`], which
//!   layers flags over environment over the `--config` TOML file over defaults into
//!   [`ServeSettings`].
//!
//! # Putting it together
//! ```no_run
//! # async fn run(args: lease_router::service::ServeArgs) -> anyhow::Result<()> {
//! use lease_router::service::{resolve, serve, ApiState, DeploymentHost};
//! use tokio_util::sync::CancellationToken;
//!
//! let settings = resolve(&args)?;
//! let connection = lease_router::connection::connect(&settings.nats_connect_config()).await?;
//! let host = DeploymentHost::new(connection, settings.host_settings());
//! for name in &settings.deployments {
//!     host.add(name).await?;
//! }
//! let listener = tokio::net::TcpListener::bind(settings.http_addr).await?;
//! let shutdown = CancellationToken::new();
//! // Fire `shutdown` on SIGTERM; then:
//! serve(listener, ApiState::new(host.clone()), shutdown).await?;
//! host.shutdown_all().await?;
//! # Ok(())
//! # }
//! ```

pub mod config;
pub mod host;
pub mod http;
pub mod metrics;

pub use config::{resolve, ConfigError, LogFormat, ServeArgs, ServeSettings};
pub use host::{
    AddDeploymentError, AddOutcome, DeploymentHost, DeploymentPhase, DeploymentSummary,
    DeploymentView, HostSettings, RemoveDeploymentError, ShutdownAllError,
};
pub use http::{router, serve, ApiState, ReadinessHook};
pub use metrics::Metrics;
