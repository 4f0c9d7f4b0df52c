//! `lease-router relay`: a sidecar beside one engine (one data-parallel rank of it) that
//! turns the engine's ZeroMQ KV cache events into wire 1.3 KV events on the worker's subject
//! (`crate::relay` has the engine's layout and the sequence handling), with `/healthz` and
//! `/metrics` on its own HTTP port.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use clap::{Args, ValueEnum};
use lease_router::{Batching, DeploymentName, LeasePublisher, NatsConnection};
use lease_router::{PublisherConfig, Subjects};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::config::LogFormat;
use crate::layering::Sourced;
use crate::nats_args::NatsArgs;
use crate::relay::metrics::{Metrics, Outside};
use crate::relay::{self, PublisherSink, RelaySettings};

use super::serve::bind;
use super::{connect_or_cancel, duration_arg, init_logging, CliError, Signals};

/// How long the last events may take to reach NATS at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Acknowledgements awaited at a time with --durable.
const DURABLE_IN_FLIGHT: usize = 256;

#[derive(Debug, Args)]
pub struct RelayArgs {
    /// The NATS servers, subject prefix, authentication and TLS, as for `serve`.
    #[command(flatten)]
    nats: Sourced<NatsArgs>,
    /// The deployment the engine's worker belongs to.
    #[arg(long, value_name = "NAME", env = "LEASE_ROUTER_RELAY_DEPLOYMENT")]
    deployment: DeploymentName,
    /// The worker id the engine serves as (the one its `admitted` events carry).
    #[arg(long, value_name = "ID", env = "LEASE_ROUTER_RELAY_WORKER_ID")]
    worker_id: u64,
    /// The engine's data-parallel rank (one relay per rank: vLLM offsets each rank's ports
    /// by its rank).
    #[arg(
        long,
        value_name = "N",
        env = "LEASE_ROUTER_RELAY_DP_RANK",
        default_value_t = 0
    )]
    dp_rank: u32,
    /// The engine's KV events PUB socket, such as tcp://127.0.0.1:5557 (vLLM's
    /// `--kv-events-config` `endpoint`, with the engine's host for `*`).
    #[arg(long, value_name = "ZMQ_ENDPOINT", env = "LEASE_ROUTER_RELAY_ENDPOINT")]
    endpoint: String,
    /// The engine's replay (ROUTER) socket, such as tcp://127.0.0.1:5558 (`replay_endpoint`).
    /// Without it a lost message cannot be recovered: every gap becomes `kv_cleared`.
    #[arg(
        long,
        value_name = "ZMQ_ENDPOINT",
        env = "LEASE_ROUTER_RELAY_REPLAY_ENDPOINT"
    )]
    replay_endpoint: Option<String>,
    /// The topic to subscribe to (the engine's `topic`; a prefix filter, "" for all).
    #[arg(
        long,
        value_name = "TOPIC",
        env = "LEASE_ROUTER_RELAY_TOPIC",
        default_value = ""
    )]
    topic: String,
    /// Tokens per KV block: the engine's `--block-size`, and the routers' `--block-size`.
    /// A `BlockStored` of another block size is counted and skipped.
    #[arg(long, value_name = "TOKENS", env = "LEASE_ROUTER_RELAY_BLOCK_SIZE", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    block_size: u32,
    /// Blocks the engine-hash map holds at most (about 100 bytes each); past it the oldest
    /// leave and are published as removed. Set it at or above the engine's GPU block count.
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_RELAY_MAX_BLOCKS", default_value_t = 262_144,
          value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    max_blocks: u64,
    /// How long a replay request may wait for the engine's connection and each reply.
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_RELAY_REPLAY_TIMEOUT",
          default_value = "2s", value_parser = duration_arg)]
    replay_timeout: Duration,
    /// Publish to the JetStream lease stream with acknowledgements (a `serve --durable`
    /// router creates the stream).
    #[arg(long, env = "LEASE_ROUTER_RELAY_DURABLE")]
    durable: bool,
    /// Where `/healthz` and `/metrics` listen (port 0 picks a free one).
    #[arg(
        long,
        value_name = "ADDR",
        env = "LEASE_ROUTER_RELAY_HTTP_ADDR",
        default_value = "127.0.0.1:9465"
    )]
    http_addr: SocketAddr,
    /// How long to keep trying to reach NATS at startup.
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_RELAY_CONNECT_DEADLINE",
          default_value = "30s", value_parser = duration_arg)]
    connect_deadline: Duration,
    /// Log lines for people (text) or one JSON object per line (json).
    #[arg(long, value_enum, env = "LEASE_ROUTER_RELAY_LOG_FORMAT", default_value_t = LogArg::Text)]
    log_format: LogArg,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogArg {
    Text,
    Json,
}

/// What the HTTP handlers read.
#[derive(Clone)]
struct HttpState {
    metrics: Arc<Metrics>,
    connection: NatsConnection,
    publisher: LeasePublisher,
}

pub async fn run(args: RelayArgs, signals: &Signals) -> Result<(), CliError> {
    let format = match args.log_format {
        LogArg::Text => LogFormat::Text,
        LogArg::Json => LogFormat::Json,
    };
    init_logging(format, "info");
    let settings = RelaySettings {
        endpoint: args.endpoint.clone(),
        replay_endpoint: args.replay_endpoint.clone(),
        topic: args.topic.clone(),
        block_size: args.block_size as usize,
        max_blocks: args.max_blocks as usize,
        dp_rank: args.dp_rank,
        replay_timeout: args.replay_timeout,
    };
    for endpoint in std::iter::once(&settings.endpoint).chain(&settings.replay_endpoint) {
        if let Err(error) = endpoint.parse::<zeromq::Endpoint>() {
            return Err(CliError::usage(format!(
                "invalid ZeroMQ endpoint {endpoint:?}: {error} (expected tcp://HOST:PORT)"
            )));
        }
    }
    let (nats, prefix) = args.nats.resolve().map_err(CliError::usage)?;
    let nats = nats.with_connect_deadline(args.connect_deadline);
    let subjects = Subjects::new(prefix, args.deployment.clone());
    // Bind first: a taken port is reported before anything else happens.
    let listener = bind(args.http_addr).await?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::failed(format!("the HTTP listener has no address: {e}")))?;
    let name = format!("lease-router relay {}/{}", args.worker_id, args.dp_rank);
    let Some(connection) = connect_or_cancel(nats, &name, &signals.first).await? else {
        info!("stopped before NATS answered");
        return Ok(());
    };
    let config = PublisherConfig::default().with_batching(Batching::default());
    let publisher = if args.durable {
        super::require_lease_stream(&connection, &subjects).await?;
        let client = connection.client().clone();
        LeasePublisher::start_durable(client, subjects.clone(), config, DURABLE_IN_FLIGHT)
    } else {
        LeasePublisher::start(connection.client().clone(), subjects.clone(), config)
    };
    let metrics = Arc::new(Metrics::default());
    let state = HttpState {
        metrics: metrics.clone(),
        connection: connection.clone(),
        publisher: publisher.clone(),
    };
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(prometheus))
        .with_state(state);
    let http_stop = CancellationToken::new();
    let stop = http_stop.clone();
    let mut http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    });

    let sink = PublisherSink::new(
        publisher.clone(),
        args.worker_id,
        args.dp_rank,
        metrics.clone(),
    );
    let engine_stop = CancellationToken::new();
    let mut engine = tokio::spawn(relay::run(
        settings,
        sink,
        metrics.clone(),
        engine_stop.clone(),
    ));
    info!(
        %addr,
        subject = %subjects.worker_subject(args.worker_id),
        dp_rank = args.dp_rank,
        endpoint = %args.endpoint,
        replay_endpoint = args.replay_endpoint.as_deref().unwrap_or("none"),
        durable = args.durable,
        "relaying"
    );
    println!("listening on http://{addr}");
    let _ = std::io::stdout().flush();

    let mut failure = None;
    let mut engine_done = None;
    tokio::select! {
        _ = signals.first.cancelled() => {}
        result = &mut http => {
            failure = Some(CliError::failed(match result {
                Ok(Ok(())) => "the HTTP server stopped".to_owned(),
                Ok(Err(error)) => format!("the HTTP server failed: {error}"),
                Err(error) => format!("the HTTP server task failed: {error}"),
            }));
        }
        result = &mut engine => engine_done = Some(result),
    }
    info!("stopping: kv_cleared, then the publisher is flushed");
    engine_stop.cancel();
    let result = match engine_done {
        Some(result) => result,
        None => engine.await,
    };
    match result {
        Ok(Ok(_sink)) => {}
        Ok(Err(message)) => failure = failure.or(Some(CliError::failed(message))),
        Err(error) => {
            failure = failure.or(Some(CliError::failed(format!("the relay failed: {error}"))))
        }
    }
    match tokio::time::timeout(CLOSE_TIMEOUT, publisher.close()).await {
        Ok(Ok(figures)) => info!(
            published = figures.published,
            failed = figures.failed,
            dropped = figures.dropped_queue_full,
            "publisher closed"
        ),
        Ok(Err(error)) => error!(%error, "the publisher did not close"),
        Err(_) => error!("the publisher did not deliver its events within {CLOSE_TIMEOUT:?}"),
    }
    http_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), http).await;
    if let Some(error) = failure {
        return Err(error);
    }
    info!("stopped");
    Ok(())
}

/// 200 while NATS is connected and the SUB socket holds a connection to the engine (an idle
/// engine sends nothing, so silence is healthy); 503 otherwise, saying which.
async fn healthz(State(state): State<HttpState>) -> Response {
    let m = &state.metrics;
    let nats = state.connection.stats().is_connected();
    let engine = m.engine_connected.load(Relaxed);
    let healthy = nats && engine;
    let body = json!({
        "status": if healthy { "ok" } else { "unavailable" },
        "nats_connected": nats,
        "engine_connected": engine,
        "last_sequence": m.last_seq(),
        "batches": m.batches.load(Relaxed),
        "lag_seconds": m.lag(),
        "map_blocks": m.map_blocks.load(Relaxed),
    });
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn prometheus(State(state): State<HttpState>) -> Response {
    let p = state.publisher.stats();
    let outside = Outside {
        queued: p.queued,
        published: p.published,
        failed: p.failed,
        nats_connected: state.connection.stats().is_connected(),
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(&outside),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// README's relay settings table lists exactly the relay's own flags (the NATS ones are
    /// `serve`'s), each with its environment variable, in their order.
    #[test]
    fn readme_documents_exactly_the_relay_flags() {
        let code = |cell: &'static str| {
            let inner = cell.split('`').nth(1).unwrap_or_default();
            inner.split_whitespace().next().unwrap_or_default()
        };
        let readme: Vec<Vec<&str>> = include_str!("../../../README.md")
            .lines()
            .skip_while(|line| !line.starts_with("| flag | environment | default |"))
            .skip(2)
            .take_while(|line| line.starts_with('|'))
            .map(|row| row.split('|').skip(1).take(2).map(code).collect())
            .collect();
        let nats = NatsArgs::augment_args(clap::Command::new("nats"));
        let nats: Vec<String> = nats
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        let relay = RelayArgs::augment_args(clap::Command::new("relay"));
        let declared: Vec<Vec<String>> = relay
            .get_arguments()
            .filter(|arg| !nats.contains(&arg.get_id().to_string()))
            .map(|arg| {
                let env = arg.get_env().expect("every relay flag has a variable");
                let long = format!("--{}", arg.get_long().unwrap());
                vec![long, env.to_str().unwrap().to_owned()]
            })
            .collect();
        assert_eq!(declared.len(), 13);
        assert_eq!(
            readme, declared,
            "README's relay settings table and RelayArgs differ"
        );
    }
}
