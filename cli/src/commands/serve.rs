//! `lease-router serve`, and [`Service`], which `demo` runs too.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use lease_router::service::{serve, ApiAuth, ApiState, DeploymentHost, HostSettings};
use lease_router::DeploymentName;
use lease_router::NatsConnection;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::config::{resolve, ServeArgs};
use crate::layering::Sourced;

use super::{connect_or_cancel, init_logging, CliError, Signals};

/// How long the HTTP server may take to finish its requests in progress at shutdown.
const HTTP_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A running service: the deployment host and its HTTP API.
pub struct Service {
    host: DeploymentHost,
    http_addr: SocketAddr,
    http_shutdown: CancellationToken,
    http: JoinHandle<std::io::Result<()>>,
}

impl Service {
    /// Hosts `deployments` over `connection` and serves the API on `listener`.
    /// Started means subscribed: events published from now on are seen.
    pub async fn start(
        settings: HostSettings,
        deployments: &[DeploymentName],
        connection: NatsConnection,
        listener: TcpListener,
    ) -> Result<Service, CliError> {
        Self::start_with_auth(settings, deployments, connection, listener, None).await
    }

    /// [`Service::start`], with the API behind `auth`'s bearer token if given.
    pub async fn start_with_auth(
        settings: HostSettings,
        deployments: &[DeploymentName],
        connection: NatsConnection,
        listener: TcpListener,
        auth: Option<ApiAuth>,
    ) -> Result<Service, CliError> {
        let http_addr = listener
            .local_addr()
            .map_err(|e| CliError::failed(format!("the HTTP listener has no address: {e}")))?;
        let host = DeploymentHost::new(connection, settings);
        for name in deployments {
            if let Err(error) = host.add(name).await {
                let _ = host.shutdown_all().await;
                return Err(CliError::failed(error));
            }
            info!(deployment = %name, "deployment hosted");
        }
        let http_shutdown = CancellationToken::new();
        let mut api = ApiState::new(host.clone());
        if let Some(auth) = auth {
            api = api.with_auth(auth);
        }
        let http = tokio::spawn(serve(listener, api, http_shutdown.clone()));
        Ok(Service {
            host,
            http_addr,
            http_shutdown,
            http,
        })
    }

    pub fn host(&self) -> &DeploymentHost {
        &self.host
    }

    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// Resolves if the HTTP server stops on its own (an I/O error).
    pub async fn http_failed(&mut self) -> CliError {
        match (&mut self.http).await {
            Ok(Ok(())) => CliError::failed("the HTTP server stopped"),
            Ok(Err(error)) => CliError::failed(format!("the HTTP server failed: {error}")),
            Err(error) => CliError::failed(format!("the HTTP server task failed: {error}")),
        }
    }

    /// Stops taking events (every router drains its subscription and shuts down; `/readyz`
    /// says so meanwhile), then stops the HTTP server.
    pub async fn stop(self) -> Result<(), CliError> {
        let routers = self.host.shutdown_all().await;
        self.http_shutdown.cancel();
        match tokio::time::timeout(HTTP_STOP_TIMEOUT, self.http).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => error!(%error, "the HTTP server failed"),
            Ok(Err(error)) => error!(%error, "the HTTP server task failed"),
            Err(_) => error!("the HTTP server did not stop within {HTTP_STOP_TIMEOUT:?}"),
        }
        routers.map_err(CliError::failed)
    }
}

/// Binds the HTTP listener, with an error that names the setting.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, CliError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::failed(format!("cannot listen on http_addr {addr}: {e}")))
}

pub async fn run(args: Sourced<ServeArgs>, signals: &Signals) -> Result<(), CliError> {
    let settings = resolve(&args).map_err(CliError::usage)?;
    init_logging(settings.log_format, "info");
    // Bind first: a taken port is reported before anything else happens.
    let listener = bind(settings.http_addr).await?;
    let Some(connection) =
        connect_or_cancel(settings.nats.clone(), "lease-router serve", &signals.first).await?
    else {
        info!("stopped before NATS answered");
        return Ok(());
    };
    let mut service = Service::start_with_auth(
        settings.host.clone(),
        &settings.deployments,
        connection,
        listener,
        settings.http_auth.clone(),
    )
    .await?;
    let addr = service.http_addr();
    // What the token guards, never the token.
    let http_auth = match &settings.http_auth {
        None => "off: the API is open",
        Some(auth) if auth.reads_protected() => "every route but the probes",
        Some(_) => "PUT and DELETE",
    };
    info!(%addr, deployments = settings.deployments.len(), http_auth, "serving");
    // The one line on stdout, for people and scripts (port 0 picks a free port).
    println!("listening on http://{addr}");
    let _ = std::io::stdout().flush();

    let failure = tokio::select! {
        _ = signals.first.cancelled() => None,
        error = service.http_failed() => Some(error),
    };
    info!("stopping: no more events are taken, every router shuts down");
    let stopped = service.stop().await;
    if let Some(error) = failure {
        return Err(error);
    }
    stopped?;
    info!("stopped");
    Ok(())
}
