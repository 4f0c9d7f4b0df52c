//! The `lease-router` command. The router lives in the library (`lease_router::service`,
//! `lease_router::publisher`); this package holds what only the command needs: the
//! subcommands and what connects them to the terminal, the signals and the exit codes
//! (`commands`), the `serve` settings (`config`), the NATS arguments every subcommand shares
//! (`nats_args`), where each setting's value comes from, flag, environment or TOML
//! (`layering`), the simulated workers of `simulate` and `demo` (`sim_workers`) and the
//! allocator setting (`allocator`, which the benches include too).
//!
//! Exit codes: 0 success (also after a first SIGINT/SIGTERM), 1 failure at run time, 2
//! invalid arguments or configuration, 130 a second signal (exit at once).

mod allocator;
mod commands;
mod config;
mod layering;
mod nats_args;
mod relay;
mod sim_workers;

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use commands::{CliError, Signals};

/// Mirror LLM request leases published on NATS into one router per deployment.
#[derive(Debug, Parser)]
#[command(name = "lease-router", version, propagate_version = true)]
#[command(
    long_about = "Mirror LLM request leases published on NATS into one router per deployment.\n\n\
    Workers publish admitted / progressed / completed / worker-reset events on \
    {prefix}.{deployment}.{worker_id}; `serve` keeps every deployment's leases and per-worker \
    load and exposes them over HTTP with Prometheus metrics. `demo` shows it all at once."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Host one router per deployment, with the HTTP API and /metrics, until SIGINT/SIGTERM.
    ///
    /// Prints `listening on http://ADDR` on stdout once every deployment is subscribed.
    /// Settings: flags, then environment, then the --config file, then defaults. A first
    /// SIGINT/SIGTERM stops taking events, shuts every router down and exits 0; a second one
    /// exits at once (130). Invalid settings exit 2.
    Serve(Box<layering::Sourced<config::ServeArgs>>),
    /// Publish one lease event and wait until the NATS server has it.
    Publish(commands::publish::PublishArgs),
    /// Simulated workers publishing realistic request lifecycles at a target rate.
    Simulate(commands::simulate::SimulateArgs),
    /// A router, simulated workers and a live view in one process (starts nats-server if
    /// none answers).
    ///
    /// Connects to --nats-url or NATS_URL (default nats://127.0.0.1:4222); if nothing answers within a
    /// second, starts `nats-server` from PATH on a free port (JetStream on, in a temporary
    /// directory, stopped on exit). Then hosts deployment `demo` with the HTTP API, runs
    /// simulated workers against it, and shows a live view (a plain line per second when
    /// stdout is not a terminal) until Ctrl-C or --duration, then a summary.
    Demo(commands::demo::DemoArgs),
    /// Relay one engine's KV cache events (vLLM's ZeroMQ publisher) to the routers as wire
    /// 1.3 KV events, until SIGINT/SIGTERM.
    ///
    /// Subscribes to the engine's PUB socket (--endpoint), fills gaps from its replay socket
    /// (--replay-endpoint), computes our block hashes from the token ids, and publishes
    /// kv_stored / kv_removed / kv_cleared on the worker's subject. Prints `listening on
    /// http://ADDR` (/healthz, /metrics) on stdout once connected to NATS. A first
    /// SIGINT/SIGTERM publishes kv_cleared, flushes and exits 0.
    Relay(commands::relay::RelayArgs),
}

fn main() -> ExitCode {
    allocator::tune_for_latency();
    let cli = parse_command_line();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::from(1);
        }
    };
    let code = runtime.block_on(async {
        let signals = match Signals::install() {
            Ok(signals) => signals,
            Err(error) => {
                eprintln!("error: cannot listen for signals: {error}");
                return 1;
            }
        };
        let force = signals.force.clone();
        let run = async {
            match cli.command {
                Command::Serve(args) => commands::serve::run(*args, &signals).await,
                Command::Publish(args) => commands::publish::run(args, &signals).await,
                Command::Simulate(args) => commands::simulate::run(args, &signals).await,
                Command::Demo(args) => commands::demo::run(args, &signals).await,
                Command::Relay(args) => commands::relay::run(args, &signals).await,
            }
        };
        // A second signal drops whatever is running (children such as a demo's nats-server
        // are killed on drop) and exits at once.
        tokio::select! {
            result = run => report(result),
            _ = force.cancelled() => {
                eprintln!("second signal: exiting at once");
                130
            }
        }
    });
    // Do not wait for tasks that ignore the shutdown (a stuck flush, say).
    runtime.shutdown_timeout(Duration::from_millis(500));
    ExitCode::from(code)
}

/// The command line, with the `--config` help listing the file keys of the declaration and
/// the file's values beneath the flags and the environment.
fn parse_command_line() -> Cli {
    let command = Cli::command().mut_subcommand("serve", config::document_file_keys);
    let argv: Vec<_> = std::env::args_os().collect();
    let matches =
        layering::parse_layered(command, &argv, config::DEPLOYMENT_NAMES).unwrap_or_else(|error| {
            eprintln!("error: {error}");
            std::process::exit(2)
        });
    Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit())
}

fn report(result: Result<(), CliError>) -> u8 {
    match result {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("error: {error}");
            error.exit_code()
        }
    }
}
