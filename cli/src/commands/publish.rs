//! `lease-router publish`: one event from the command line.

use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use lease_router::wire::{
    Admitted, Completed, LeaseEvent, Outcome, ProgressStage, Progressed, WorkerReset,
};
use lease_router::{DeploymentName, Subjects};
use lease_router::{LeasePublisher, PublisherConfig};

use crate::layering::Sourced;
use crate::nats_args::NatsArgs;

use super::{connect_or_cancel, duration_arg, init_logging, CliError, Signals};

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// The NATS servers, subject prefix, authentication and TLS, as for `serve`.
    #[command(flatten)]
    nats: Sourced<NatsArgs>,
    /// The deployment: ASCII letters, digits, '-' and '_'.
    #[arg(long, value_name = "NAME")]
    deployment: DeploymentName,
    /// The worker id (an unsigned integer).
    #[arg(long, value_name = "ID")]
    worker: u64,
    /// The data-parallel rank [default: 0; for `reset`, every rank of the worker].
    #[arg(long, value_name = "N")]
    dp_rank: Option<u32>,
    /// How long to wait for NATS, to connect and then to deliver the event.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration_arg)]
    timeout: Duration,
    /// Publish to the JetStream lease stream and wait for its acknowledgement (a
    /// `serve --durable` router creates the stream).
    #[arg(long, env = "LEASE_ROUTER_DURABLE")]
    durable: bool,
    #[command(subcommand)]
    event: EventArgs,
}

#[derive(Debug, Subcommand)]
enum EventArgs {
    /// The worker accepted a request.
    Admitted {
        #[arg(long, value_name = "ID", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        request_id: String,
        /// Tokens of the prompt.
        #[arg(long, value_name = "N", default_value_t = 0)]
        prompt_tokens: u32,
        /// Tokens the answer is expected to have, if known.
        #[arg(long, value_name = "N")]
        expected_output_tokens: Option<u32>,
        /// Prompt tokens already in the worker's prefix cache (wire 1.1 `ctok`).
        #[arg(long, value_name = "N")]
        cached_tokens: Option<u32>,
    },
    /// The request is alive and moving: renews its lease.
    Progressed {
        #[arg(long, value_name = "ID", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        request_id: String,
        #[arg(long, value_enum, default_value_t = StageArg::Decoding)]
        stage: StageArg,
        /// Output tokens so far.
        #[arg(long, value_name = "N", default_value_t = 0)]
        output_tokens: u32,
    },
    /// The request ended: its lease and load are released.
    Completed {
        #[arg(long, value_name = "ID", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        request_id: String,
        #[arg(long, value_enum, default_value_t = OutcomeArg::Finished)]
        outcome: OutcomeArg,
    },
    /// The worker restarted or left: every lease of it (or of --dp-rank) is dropped.
    Reset {
        /// The worker is leaving (wire 1.1 `leaving`), not restarting: routers stop
        /// choosing it until it publishes again.
        #[arg(long)]
        leaving: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum StageArg {
    PrefillDone,
    Decoding,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OutcomeArg {
    Finished,
    Cancelled,
    Failed,
}

impl PublishArgs {
    fn event(&self) -> LeaseEvent {
        let worker_id = self.worker;
        let dp_rank = self.dp_rank.unwrap_or(0);
        match &self.event {
            EventArgs::Admitted {
                request_id,
                prompt_tokens,
                expected_output_tokens,
                cached_tokens,
            } => Admitted {
                block_hashes: Vec::new(),
                block_capacity: None,
                class: None,
                request_id: request_id.clone(),
                worker_id,
                dp_rank,
                prompt_tokens: *prompt_tokens,
                expected_output_tokens: *expected_output_tokens,
                cached_tokens: *cached_tokens,
            }
            .into(),
            EventArgs::Progressed {
                request_id,
                stage,
                output_tokens,
            } => Progressed {
                request_id: request_id.clone(),
                worker_id,
                dp_rank,
                stage: match stage {
                    StageArg::PrefillDone => ProgressStage::PrefillDone,
                    StageArg::Decoding => ProgressStage::Decoding,
                },
                output_tokens: *output_tokens,
            }
            .into(),
            EventArgs::Completed {
                request_id,
                outcome,
            } => Completed {
                request_id: request_id.clone(),
                worker_id,
                dp_rank,
                outcome: match outcome {
                    OutcomeArg::Finished => Outcome::Finished,
                    OutcomeArg::Cancelled => Outcome::Cancelled,
                    OutcomeArg::Failed => Outcome::Failed,
                },
            }
            .into(),
            EventArgs::Reset { leaving } => WorkerReset {
                worker_id,
                dp_rank: self.dp_rank,
                leaving: *leaving,
            }
            .into(),
        }
    }
}

pub async fn run(args: PublishArgs, signals: &Signals) -> Result<(), CliError> {
    init_logging(Default::default(), "warn");
    let event = args.event();
    let (config, prefix) = args.nats.resolve().map_err(CliError::usage)?;
    let config = config.with_connect_deadline(args.timeout);
    let subjects = Subjects::new(prefix, args.deployment.clone());
    let subject = subjects.worker_subject(args.worker);
    let Some(connection) =
        connect_or_cancel(config, "lease-router publish", &signals.first).await?
    else {
        return Err(CliError::failed("interrupted before NATS answered"));
    };
    let publisher = if args.durable {
        super::require_lease_stream(&connection, &subjects).await?;
        LeasePublisher::start_durable(
            connection.client().clone(),
            subjects,
            PublisherConfig::default(),
            1,
        )
    } else {
        LeasePublisher::start(
            connection.client().clone(),
            subjects,
            PublisherConfig::default(),
        )
    };
    let publisher_id = publisher.publisher_id();
    publisher
        .publish(event.clone())
        .map_err(|e| CliError::failed(format!("the event was not queued: {e}")))?;
    // `close` delivers the queue and flushes: once it returns, the server has the message.
    let stats = tokio::time::timeout(args.timeout, publisher.close())
        .await
        .map_err(|_| {
            CliError::failed(format!(
                "the NATS server did not take the event within {:?}",
                args.timeout
            ))
        })?
        .map_err(CliError::failed)?;
    if stats.published != 1 || stats.failed != 0 {
        return Err(CliError::failed(format!(
            "the event could not be sent to {subject} (see the log above)"
        )));
    }
    println!(
        "published {} on {subject} ({}; publisher {publisher_id:016x}, sequence 1)",
        event.kind(),
        describe(&event)
    );
    Ok(())
}

fn describe(event: &LeaseEvent) -> String {
    match event {
        LeaseEvent::Admitted(e) => format!(
            "request {:?}, worker {} rank {}, {} prompt tokens, expected output {}",
            e.request_id,
            e.worker_id,
            e.dp_rank,
            e.prompt_tokens,
            e.expected_output_tokens
                .map_or_else(|| "unknown".to_owned(), |n| format!("{n} tokens"))
        ),
        LeaseEvent::Progressed(e) => format!(
            "request {:?}, worker {} rank {}, {}, {} output tokens",
            e.request_id, e.worker_id, e.dp_rank, e.stage, e.output_tokens
        ),
        LeaseEvent::Completed(e) => format!(
            "request {:?}, worker {} rank {}, {}",
            e.request_id, e.worker_id, e.dp_rank, e.outcome
        ),
        LeaseEvent::WorkerReset(e) => match e.dp_rank {
            Some(rank) => format!("worker {} rank {rank}", e.worker_id),
            None => format!("worker {}, every rank", e.worker_id),
        },
        LeaseEvent::KvStored(e) => format!(
            "worker {} rank {}, {} blocks stored",
            e.worker_id,
            e.dp_rank,
            e.block_hashes.len()
        ),
        LeaseEvent::KvRemoved(e) => format!(
            "worker {} rank {}, {} blocks removed",
            e.worker_id,
            e.dp_rank,
            e.block_hashes.len()
        ),
        LeaseEvent::KvCleared(e) => match e.dp_rank {
            Some(rank) => format!("worker {} rank {rank}, cache cleared", e.worker_id),
            None => format!("worker {}, every rank's cache cleared", e.worker_id),
        },
    }
}
