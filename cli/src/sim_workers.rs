//! Simulated workers: realistic request lifecycles published on NATS, for the `simulate` and
//! `demo` commands, load tests and end-to-end tests.
//!
//! [`run_simulation`] starts [`SimulationConfig::workers`] workers, each with its own
//! [`LeasePublisher`] (so its own publisher id and sequence), and a pacer that starts request
//! lifecycles at [`SimulationConfig::rate`] per second overall, handing each to a worker:
//!
//! - `admitted` (prompt 100 to 4,000 tokens; the expected output is sometimes unknown),
//! - `progressed` when prefill is done, then every [`SimulationConfig::progress_every`] while
//!   the request lives (`decoding`, with a growing output token count): by default every 2 s,
//!   as the wire contract (`schemas/README.md`) asks of workers; a few milliseconds only for a
//!   load test,
//! - `completed`, mostly `finished`, some `cancelled` or `failed`.
//!
//! What a real bus does to the router is simulated too:
//! - **crashes** ([`SimulationConfig::crash_share`]): the request is never completed; its
//!   lease must expire on its own;
//! - **duplicates** ([`SimulationConfig::duplicate_share`]): the `admitted` or the `completed`
//!   is sent twice through the publisher (same content, a new sequence number), as a retry
//!   would; the router must count it as a touch or as stale, never twice;
//! - **reorders** ([`SimulationConfig::reorder_share`]): a `progressed` sent before its
//!   `admitted` (the router holds it), or a very short request whose `completed` is sent
//!   before its `admitted` (the router keeps a tombstone and ignores the late admit).
//!
//! Every decision comes from one random generator in the pacer, so a run with
//! [`SimulationConfig::seed`] set publishes the same requests with the same contents (the
//! timing, of course, differs). Each worker first says it restarted (`worker_reset`), so
//! leases left by an earlier run of the same worker ids are dropped at once.
//!
//! When the duration is over (or `cancel` fires) no request is started any more; the live
//! ones that were not going to crash are completed as `cancelled`, and every publisher is
//! closed, which flushes it: when [`run_simulation`] returns, the server has every event.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use lease_router::wire::{
    Admitted, Completed, LeaseEvent, Outcome, ProgressStage, Progressed, WorkerReset,
};
use lease_router::Subjects;
use lease_router::{LeasePublisher, PublisherConfig};

/// How often a live request renews its lease by default: "every few seconds while decoding",
/// as `schemas/README.md` tells workers (not one event per token).
pub const DEFAULT_PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// The clock of a simulated worker: request lifetimes are counted in these steps, whatever
/// the progress interval (unless that is shorter).
const STEP: Duration = Duration::from_millis(10);

/// The smallest accepted [`SimulationConfig::progress_every`].
pub const MIN_PROGRESS_EVERY: Duration = Duration::from_millis(1);

/// Acknowledgements each durable simulated worker keeps outstanding.
const DURABLE_ACKS_IN_FLIGHT: usize = 256;

/// What a [`Placer`] is asked to place: a new request, before any worker has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSizes {
    /// The id the chosen worker will admit it with.
    pub request_id: String,
    pub prompt_tokens: u32,
    pub expected_output_tokens: Option<u32>,
}

/// What a [`Placer`] answers: the worker id and data-parallel rank that take the request, or
/// `None` to leave it to random placement.
pub type Placement = Pin<Box<dyn Future<Output = Option<(u64, u32)>> + Send>>;

/// Chooses the worker of each new request (a router's route call, say), given the request's
/// index (0, 1, 2, ... in start order) and sizes. Without one, workers are picked at random.
pub type Placer = Arc<dyn Fn(u64, &RequestSizes) -> Placement + Send + Sync>;

/// How a simulation runs. [`Default`] gives a modest, realistic load.

#[derive(Clone, Debug, PartialEq)]
pub struct SimulationConfig {
    /// Number of simulated workers, each with its own publisher. Default 8.
    pub workers: usize,
    /// The id of the first worker; the others follow (`first_worker_id + i`). Default 1.
    pub first_worker_id: u64,
    /// Data-parallel ranks per worker; each request picks one. Default 2.
    pub dp_ranks: u32,
    /// Request lifecycles started per second, all workers together. Default 200.
    pub rate: f64,
    /// How long requests are started. Default 30 s.
    pub duration: Duration,
    /// How often a live request publishes `progressed`. Default 10 ms.
    pub progress_every: Duration,
    /// The mean lifetime of a request (exponentially distributed, at least one progress
    /// interval, at most ten times the mean). Default 1 s.
    pub mean_request_time: Duration,
    /// The share of requests that are never completed: their worker "crashes" them, and the
    /// router's lease must expire. Default 0.02.
    pub crash_share: f64,
    /// The share of requests whose `admitted` or `completed` is sent twice. Default 0.02.
    pub duplicate_share: f64,
    /// The share of requests sent out of order: `progressed` before `admitted`, or (for a
    /// request that ends at once) `completed` before `admitted`. Default 0.02.
    pub reorder_share: f64,
    /// At most this many live requests at once, all workers together; past it the pacer
    /// skips starts (counted as throttled). Default 10,000.
    pub max_live_requests: usize,
    /// Seed of the generator that decides every request. `None`: random.
    pub seed: Option<u64>,
    /// Whether each worker publishes a `worker_reset` first. Default true.
    pub reset_workers_on_start: bool,
    /// How often `progress` is called. Default 250 ms.
    pub report_every: Duration,
    /// The publishers' settings.
    pub publisher: PublisherConfig,
    /// How long each publisher may take to deliver its queue at the end; what is left then
    /// is counted as dropped. Default 10 s.
    pub close_timeout: Duration,
    /// Publish to the JetStream lease stream with acknowledgements (durable mode); the
    /// stream must exist (a `serve --durable` router creates it). Default off.
    pub durable: bool,
}

impl Default for SimulationConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            first_worker_id: 1,
            dp_ranks: 2,
            rate: 200.0,
            duration: Duration::from_secs(30),
            progress_every: DEFAULT_PROGRESS_EVERY,
            mean_request_time: Duration::from_secs(1),
            crash_share: 0.02,
            duplicate_share: 0.02,
            reorder_share: 0.02,
            max_live_requests: 10_000,
            seed: None,
            reset_workers_on_start: true,
            report_every: Duration::from_millis(250),
            publisher: PublisherConfig::default(),
            close_timeout: Duration::from_secs(10),
            durable: false,
        }
    }
}

impl SimulationConfig {
    /// One step of a worker's clock: [`STEP`], or the progress interval if that is shorter.
    fn step(&self) -> Duration {
        self.progress_every.min(STEP)
    }

    /// Steps between two `progressed` of one request (at least 1).
    fn steps_per_progress(&self) -> u32 {
        let steps = self.progress_every.as_secs_f64() / self.step().as_secs_f64();
        steps.round().clamp(1.0, f64::from(u32::MAX)) as u32
    }

    /// Checks every setting; the error names the setting and what is accepted.
    pub fn validate(&self) -> Result<(), SimulateError> {
        let invalid = |setting: &'static str, accepted: &'static str, value: String| {
            Err(SimulateError::InvalidConfig {
                setting,
                accepted,
                value,
            })
        };
        if self.workers == 0 || self.workers > 10_000 {
            return invalid("workers", "1 to 10000", self.workers.to_string());
        }
        if self
            .first_worker_id
            .checked_add(self.workers as u64)
            .is_none()
        {
            return invalid(
                "first worker id",
                "an id that leaves room for every worker below 2^64",
                self.first_worker_id.to_string(),
            );
        }
        if self.dp_ranks == 0 || self.dp_ranks > 1024 {
            return invalid("dp ranks", "1 to 1024", self.dp_ranks.to_string());
        }
        if !(self.rate.is_finite() && self.rate > 0.0 && self.rate <= 1_000_000.0) {
            return invalid(
                "rate",
                "a number of requests per second above 0 and at most 1000000",
                self.rate.to_string(),
            );
        }
        if self.progress_every < MIN_PROGRESS_EVERY {
            return invalid(
                "progress interval",
                "1ms or more",
                format_duration(self.progress_every),
            );
        }
        if self.mean_request_time.is_zero() {
            return invalid(
                "mean request time",
                "more than 0",
                format_duration(self.mean_request_time),
            );
        }
        for (setting, share) in [
            ("crash share", self.crash_share),
            ("duplicate share", self.duplicate_share),
            ("reorder share", self.reorder_share),
        ] {
            if !(0.0..=1.0).contains(&share) {
                return invalid(setting, "a number from 0 to 1", share.to_string());
            }
        }
        if self.max_live_requests == 0 {
            return invalid("max live requests", "1 or more", "0".to_owned());
        }
        if self.report_every.is_zero() {
            return invalid("report interval", "more than 0", "0s".to_owned());
        }
        Ok(())
    }

    fn worker_ids(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.workers as u64).map(|i| self.first_worker_id + i)
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("invalid simulation setting {setting} = {value}: accepted values are {accepted}")]
    InvalidConfig {
        setting: &'static str,
        accepted: &'static str,
        value: String,
    },
    #[error("simulated worker {worker_id} stopped unexpectedly: {message}")]
    Worker { worker_id: u64, message: String },
}

/// What a simulation did so far, passed to the progress callback.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimulationProgress {
    pub elapsed: Duration,
    /// The configured duration.
    pub duration: Duration,
    pub requests_started: u64,
    pub requests_completed: u64,
    pub requests_crashed: u64,
    /// Starts skipped because [`SimulationConfig::max_live_requests`] were live.
    pub requests_throttled: u64,
    pub live_requests: u64,
    /// Live requests per worker: `(worker_id, live)`.
    pub live_by_worker: Vec<(u64, u64)>,
    /// Requests started per worker: `(worker_id, started)`.
    pub started_by_worker: Vec<(u64, u64)>,
    /// Requests the placer placed (with a placer only).
    pub requests_placed: u64,
    /// Requests the placer left to random placement (with a placer only).
    pub requests_unplaced: u64,
    /// Events handed to the publishers.
    pub events_published: u64,
    /// Events the publishers refused (their queue was full, or they were closed).
    pub events_dropped: u64,
}

impl SimulationProgress {
    /// Elapsed share of the duration, 0 to 1.
    pub fn fraction(&self) -> f64 {
        if self.duration.is_zero() {
            1.0
        } else {
            (self.elapsed.as_secs_f64() / self.duration.as_secs_f64()).clamp(0.0, 1.0)
        }
    }
}

/// What a simulation did, once it is over.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimulationSummary {
    pub workers: usize,
    /// From the start to the last publisher closed (flushed).
    pub duration: Duration,
    pub requests_started: u64,
    /// Requests whose `completed` was sent (including those cut short at the end).
    pub requests_completed: u64,
    /// Of `requests_completed`, live at the end and completed as `cancelled` then.
    pub requests_cut_short: u64,
    /// Requests never completed: their leases must expire in the router.
    pub requests_crashed: u64,
    pub requests_throttled: u64,
    /// Requests the placer placed (with a placer only).
    pub requests_placed: u64,
    /// Requests the placer left to random placement (with a placer only).
    pub requests_unplaced: u64,
    /// Requests started per worker: `(worker_id, started)`.
    pub started_by_worker: Vec<(u64, u64)>,
    pub outcomes_finished: u64,
    pub outcomes_cancelled: u64,
    pub outcomes_failed: u64,
    /// Extra copies of `admitted` or `completed` sent.
    pub duplicates_sent: u64,
    /// Requests sent out of order (`progressed` or `completed` before `admitted`).
    pub reorders_sent: u64,
    pub worker_resets_sent: u64,
    /// Events accepted by the publishers, by kind.
    pub admitted_sent: u64,
    pub progressed_sent: u64,
    pub completed_sent: u64,
    /// Events accepted by the publishers, all kinds.
    pub events_published: u64,
    /// Of those, events the publishers handed to the NATS client (and flushed, unless the
    /// server was unreachable at the end).
    pub events_delivered: u64,
    /// Batch messages (wire 1.2, two events or more) among the messages that carried them:
    /// 0 unless the publishers batch.
    pub batches_delivered: u64,
    /// Events the publishers refused (queue full), or accepted but could not send (or not
    /// before [`SimulationConfig::close_timeout`] at the end).
    pub events_dropped: u64,
    /// `requests_started` per second of the configured duration actually run.
    pub achieved_rate: f64,
    /// `events_published` per second.
    pub events_per_second: f64,
}

impl fmt::Display for SimulationSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simulation: {} workers, {} in {}",
            self.workers,
            plural(self.requests_started, "request"),
            format_duration(self.duration)
        )?;
        writeln!(
            f,
            "  requests: {} started ({:.1}/s), {} throttled",
            self.requests_started, self.achieved_rate, self.requests_throttled
        )?;
        writeln!(
            f,
            "            {} completed: {} finished, {} cancelled ({} cut short at the end), {} \
             failed",
            self.requests_completed,
            self.outcomes_finished,
            self.outcomes_cancelled,
            self.requests_cut_short,
            self.outcomes_failed
        )?;
        writeln!(
            f,
            "            {} crashed (never completed: their leases must expire)",
            self.requests_crashed
        )?;
        writeln!(
            f,
            "  events:   {} published ({:.0}/s), {} delivered, {} dropped at the publishers",
            self.events_published,
            self.events_per_second,
            self.events_delivered,
            self.events_dropped
        )?;
        if self.batches_delivered > 0 {
            writeln!(
                f,
                "            batched: {} messages of two events or more",
                self.batches_delivered
            )?;
        }
        writeln!(
            f,
            "            {} admitted, {} progressed, {} completed, {} worker resets",
            self.admitted_sent, self.progressed_sent, self.completed_sent, self.worker_resets_sent
        )?;
        write!(
            f,
            "  faults:   {} duplicates, {} reorders, {} crashes",
            self.duplicates_sent, self.reorders_sent, self.requests_crashed
        )
    }
}

fn plural(n: u64, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

// ---------------------------------------------------------------------------------------
// Durations, for people. (Parsing is `crate::layering::parse_duration`.)
// ---------------------------------------------------------------------------------------

/// Writes a duration the way [`crate::layering::parse_duration`] reads it, rounded for
/// people: `250ms`,
/// `1.5s`, `5m`, `1h2m`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs_f64();
    if secs < 60.0 {
        let text = format!("{secs:.1}");
        let text = text.strip_suffix(".0").unwrap_or(&text);
        return format!("{text}s");
    }
    let total = d.as_secs();
    let (h, m, s) = (total / 3600, (total / 60) % 60, total % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 {
        out.push_str(&format!("{s}s"));
    }
    out
}

// ---------------------------------------------------------------------------------------
// The plan of one request, decided by the pacer.
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Complete(Outcome),
    Crash,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Duplicate {
    Admitted,
    Completed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reorder {
    /// One `progressed` before the `admitted`.
    ProgressFirst,
    /// A request that ends at once: `completed` before `admitted`.
    CompleteFirst,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct RequestPlan {
    request_id: String,
    dp_rank: u32,
    prompt_tokens: u32,
    expected_output_tokens: Option<u32>,
    /// Steps of the worker's clock the request lives (at least 1).
    ticks: u32,
    /// Output tokens added per step.
    tokens_per_tick: u32,
    fate: Fate,
    duplicate: Option<Duplicate>,
    reorder: Option<Reorder>,
}

struct Planner {
    rng: StdRng,
    run_id: u32,
    next: u64,
    config: SimulationConfig,
}

impl Planner {
    fn new(config: &SimulationConfig) -> Self {
        let mut rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let run_id = rng.random();
        Self {
            rng,
            run_id,
            next: 0,
            config: config.clone(),
        }
    }

    fn pick_worker(&mut self) -> usize {
        self.rng.random_range(0..self.config.workers)
    }

    /// The next request; its worker is chosen afterwards (the id does not name it).
    fn plan(&mut self) -> RequestPlan {
        let c = &self.config;
        let rng = &mut self.rng;
        self.next += 1;
        let request_id = format!("sim-{:08x}-{}", self.run_id, self.next);
        let dp_rank = rng.random_range(0..c.dp_ranks);
        let prompt_tokens = rng.random_range(100..=4000);
        let expected_output_tokens = rng.random_bool(0.8).then(|| rng.random_range(16..=2048));
        // Exponential lifetime, clamped to [one interval, ten means].
        let u: f64 = rng.random();
        let mean = c.mean_request_time.as_secs_f64();
        let life = (-(1.0 - u).ln() * mean).clamp(0.0, 10.0 * mean);
        let ticks = (life / c.step().as_secs_f64()).round().max(1.0);
        let ticks = ticks.min(f64::from(u32::MAX)) as u32;
        let tokens_per_tick = rng.random_range(1..=4);
        let fate = if rng.random_bool(c.crash_share) {
            Fate::Crash
        } else {
            let roll: f64 = rng.random();
            Fate::Complete(if roll < 0.90 {
                Outcome::Finished
            } else if roll < 0.96 {
                Outcome::Cancelled
            } else {
                Outcome::Failed
            })
        };
        let duplicate = rng.random_bool(c.duplicate_share).then(|| {
            if matches!(fate, Fate::Crash) || rng.random_bool(0.5) {
                Duplicate::Admitted
            } else {
                Duplicate::Completed
            }
        });
        let reorder = rng.random_bool(c.reorder_share).then(|| {
            if matches!(fate, Fate::Complete(_)) && rng.random_bool(0.5) {
                Reorder::CompleteFirst
            } else {
                Reorder::ProgressFirst
            }
        });
        RequestPlan {
            request_id,
            dp_rank,
            prompt_tokens,
            expected_output_tokens,
            ticks,
            tokens_per_tick,
            fate,
            duplicate,
            reorder,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shared counters.
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Counters {
    started: AtomicU64,
    completed: AtomicU64,
    cut_short: AtomicU64,
    crashed: AtomicU64,
    throttled: AtomicU64,
    placed: AtomicU64,
    unplaced: AtomicU64,
    finished: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    duplicates: AtomicU64,
    reorders: AtomicU64,
    resets: AtomicU64,
    admitted: AtomicU64,
    progressed: AtomicU64,
    completed_events: AtomicU64,
    published: AtomicU64,
    dropped: AtomicU64,
    /// Accepted, then failed to send (from the publishers' stats at close).
    send_failed: AtomicU64,
    /// Handed to the NATS client (from the publishers' stats at close).
    delivered: AtomicU64,
    /// Batch messages that carried them (from the publishers' stats at close).
    batches: AtomicU64,
    live: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------
// One simulated worker.
// ---------------------------------------------------------------------------------------

struct LiveRequest {
    plan: RequestPlan,
    ticks_left: u32,
    /// Steps until the next `progressed`.
    ticks_to_progress: u32,
    output_tokens: u32,
    progressed_once: bool,
}

struct Worker {
    worker_id: u64,
    publisher: LeasePublisher,
    counters: Arc<Counters>,
    live_here: Arc<AtomicU64>,
    live: Vec<LiveRequest>,
    /// Events sent at the next step (delayed duplicates and late admits).
    deferred: VecDeque<LeaseEvent>,
    /// Steps between two `progressed` of one request.
    steps_per_progress: u32,
}

impl Worker {
    fn send(&self, event: impl Into<LeaseEvent>) {
        let event = event.into();
        // Simulated workers send no KV events (their caches are not modelled).
        let counter = match &event {
            LeaseEvent::Admitted(_) => Some(&self.counters.admitted),
            LeaseEvent::Progressed(_) => Some(&self.counters.progressed),
            LeaseEvent::Completed(_) => Some(&self.counters.completed_events),
            LeaseEvent::WorkerReset(_) => Some(&self.counters.resets),
            LeaseEvent::KvStored(_) | LeaseEvent::KvRemoved(_) | LeaseEvent::KvCleared(_) => None,
        };
        match self.publisher.publish(event) {
            Ok(()) => {
                counter.into_iter().for_each(bump);
                bump(&self.counters.published);
            }
            Err(error) => {
                bump(&self.counters.dropped);
                tracing::trace!(worker_id = self.worker_id, %error, "event dropped");
            }
        }
    }

    fn admitted(&self, plan: &RequestPlan) -> Admitted {
        Admitted {
            block_hashes: Vec::new(),
            block_capacity: None,
            class: None,
            request_id: plan.request_id.clone(),
            worker_id: self.worker_id,
            dp_rank: plan.dp_rank,
            prompt_tokens: plan.prompt_tokens,
            expected_output_tokens: plan.expected_output_tokens,
            cached_tokens: None,
        }
    }

    fn completed(&self, plan: &RequestPlan, outcome: Outcome) -> Completed {
        Completed {
            request_id: plan.request_id.clone(),
            worker_id: self.worker_id,
            dp_rank: plan.dp_rank,
            outcome,
        }
    }

    fn progressed(&self, request: &LiveRequest) -> Progressed {
        Progressed {
            request_id: request.plan.request_id.clone(),
            worker_id: self.worker_id,
            dp_rank: request.plan.dp_rank,
            stage: if request.progressed_once {
                ProgressStage::Decoding
            } else {
                ProgressStage::PrefillDone
            },
            output_tokens: request.output_tokens,
        }
    }

    fn count_outcome(&self, outcome: Outcome) {
        bump(&self.counters.completed);
        bump(match outcome {
            Outcome::Finished => &self.counters.finished,
            Outcome::Cancelled => &self.counters.cancelled,
            Outcome::Failed => &self.counters.failed,
        });
    }

    fn start(&mut self, plan: RequestPlan) {
        match plan.reorder {
            Some(Reorder::CompleteFirst) => {
                // A request that ends at once, its completion overtaking its admission.
                let outcome = match plan.fate {
                    Fate::Complete(outcome) => outcome,
                    Fate::Crash => Outcome::Failed,
                };
                bump(&self.counters.reorders);
                self.send(self.completed(&plan, outcome));
                self.deferred.push_back(self.admitted(&plan).into());
                self.count_outcome(outcome);
                return;
            }
            Some(Reorder::ProgressFirst) => {
                bump(&self.counters.reorders);
                let mut request = LiveRequest {
                    plan,
                    ticks_left: 0,
                    ticks_to_progress: self.steps_per_progress,
                    output_tokens: 0,
                    progressed_once: false,
                };
                self.send(self.progressed(&request));
                request.progressed_once = true;
                self.send(self.admitted(&request.plan));
                request.ticks_left = request.plan.ticks;
                self.add_live(request);
            }
            None => {
                self.send(self.admitted(&plan));
                let ticks = plan.ticks;
                self.add_live(LiveRequest {
                    plan,
                    ticks_left: ticks,
                    ticks_to_progress: 0,
                    output_tokens: 0,
                    progressed_once: false,
                });
            }
        }
        let request = self.live.last().expect("just added");
        if request.plan.duplicate == Some(Duplicate::Admitted) {
            bump(&self.counters.duplicates);
            let again = self.admitted(&request.plan);
            self.deferred.push_back(again.into());
        }
    }

    fn add_live(&mut self, request: LiveRequest) {
        self.live.push(request);
        self.live_here.fetch_add(1, Ordering::Relaxed);
        self.counters.live.fetch_add(1, Ordering::Relaxed);
    }

    fn remove_live(&mut self, index: usize) -> LiveRequest {
        self.live_here.fetch_sub(1, Ordering::Relaxed);
        self.counters.live.fetch_sub(1, Ordering::Relaxed);
        self.live.swap_remove(index)
    }

    /// One step: the deferred events, then every live request moves on (renewing its lease
    /// when its progress interval is up) or ends.
    fn tick(&mut self) {
        while let Some(event) = self.deferred.pop_front() {
            self.send(event);
        }
        let mut i = 0;
        while i < self.live.len() {
            if self.live[i].ticks_left == 0 {
                let request = self.remove_live(i);
                self.end(request);
                continue;
            }
            let request = &mut self.live[i];
            request.ticks_left -= 1;
            if request.progressed_once {
                request.output_tokens = request
                    .output_tokens
                    .saturating_add(request.plan.tokens_per_tick);
            }
            // The first step: prefill is done; then one `progressed` per progress interval.
            if request.ticks_to_progress == 0 {
                request.ticks_to_progress = self.steps_per_progress;
                let event = self.progressed(&self.live[i]);
                self.live[i].progressed_once = true;
                self.send(event);
            }
            self.live[i].ticks_to_progress -= 1;
            i += 1;
        }
    }

    fn end(&mut self, request: LiveRequest) {
        match request.plan.fate {
            Fate::Crash => bump(&self.counters.crashed),
            Fate::Complete(outcome) => {
                let completed = self.completed(&request.plan, outcome);
                if request.plan.duplicate == Some(Duplicate::Completed) {
                    bump(&self.counters.duplicates);
                    self.deferred.push_back(completed.clone().into());
                }
                self.send(completed);
                self.count_outcome(outcome);
            }
        }
    }

    /// The end of the run: what was going to complete is completed now, as cancelled.
    fn finish(&mut self) {
        while let Some(event) = self.deferred.pop_front() {
            self.send(event);
        }
        while !self.live.is_empty() {
            let request = self.remove_live(self.live.len() - 1);
            match request.plan.fate {
                Fate::Crash => bump(&self.counters.crashed),
                Fate::Complete(_) => {
                    self.send(self.completed(&request.plan, Outcome::Cancelled));
                    bump(&self.counters.cut_short);
                    self.count_outcome(Outcome::Cancelled);
                }
            }
        }
    }

    async fn run(
        mut self,
        mut requests: mpsc::Receiver<RequestPlan>,
        step: Duration,
        reset: bool,
        close_timeout: Duration,
    ) -> Result<(), String> {
        if reset {
            self.send(WorkerReset {
                worker_id: self.worker_id,
                dp_rank: None,
                leaving: false,
            });
        }
        let mut ticker = tokio::time::interval(step);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                plan = requests.recv() => match plan {
                    Some(plan) => self.start(plan),
                    // The pacer is done: the run is over.
                    None => break,
                },
                _ = ticker.tick() => self.tick(),
            }
        }
        self.finish();
        let counters = self.counters.clone();
        let live_stats = self.publisher.clone();
        let worker_id = self.worker_id;
        let closed = tokio::time::timeout(close_timeout, self.publisher.close()).await;
        let stats = match closed {
            Ok(Ok(stats)) => stats,
            Ok(Err(error)) => {
                tracing::warn!(worker_id, %error, "closing a simulated worker's publisher failed");
                live_stats.stats()
            }
            Err(_) => {
                tracing::warn!(
                    worker_id,
                    "a simulated worker's publisher could not deliver its events within {}",
                    format_duration(close_timeout)
                );
                live_stats.stats()
            }
        };
        // Accepted events that the publisher failed to send, or could not send before the
        // end, are drops too.
        counters
            .send_failed
            .fetch_add(stats.failed + stats.pending(), Ordering::Relaxed);
        counters
            .delivered
            .fetch_add(stats.published, Ordering::Relaxed);
        counters.batches.fetch_add(stats.batches, Ordering::Relaxed);
        tracing::debug!(
            worker_id = self.worker_id,
            ?stats,
            "simulated worker closed"
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The run.
// ---------------------------------------------------------------------------------------

/// Runs a simulation: see the [module documentation](self). `progress` is called every
/// [`SimulationConfig::report_every`] and once at the end. Returns when the duration is over
/// or `cancel` fires, after every publisher is flushed and closed.
pub async fn run_simulation(
    client: async_nats::Client,
    subjects: Subjects,
    config: SimulationConfig,
    cancel: CancellationToken,
    progress: impl FnMut(&SimulationProgress),
) -> Result<SimulationSummary, SimulateError> {
    run_placed_simulation(client, subjects, config, None, cancel, progress).await
}

/// [`run_simulation`], with each new request placed by `placer` when there is one: on the
/// worker and rank it answers (an answer that names no simulated worker or rank, or none,
/// falls back to random placement and is counted as unplaced). The pacer awaits each
/// placement, so a placer must be quick (an in-process route call is).
pub async fn run_placed_simulation(
    client: async_nats::Client,
    subjects: Subjects,
    config: SimulationConfig,
    placer: Option<Placer>,
    cancel: CancellationToken,
    mut progress: impl FnMut(&SimulationProgress),
) -> Result<SimulationSummary, SimulateError> {
    config.validate()?;
    let counters = Arc::new(Counters::default());
    let mut planner = Planner::new(&config);

    let mut senders = Vec::with_capacity(config.workers);
    let mut live_by_worker = Vec::with_capacity(config.workers);
    let started_by_worker: Vec<AtomicU64> =
        (0..config.workers).map(|_| AtomicU64::new(0)).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for worker_id in config.worker_ids() {
        let publisher = if config.durable {
            LeasePublisher::start_durable(
                client.clone(),
                subjects.clone(),
                config.publisher.clone(),
                DURABLE_ACKS_IN_FLIGHT,
            )
        } else {
            LeasePublisher::start(client.clone(), subjects.clone(), config.publisher.clone())
        };
        let (tx, rx) = mpsc::channel(1024);
        let live_here = Arc::new(AtomicU64::new(0));
        let worker = Worker {
            worker_id,
            publisher,
            counters: counters.clone(),
            live_here: live_here.clone(),
            live: Vec::new(),
            deferred: VecDeque::new(),
            steps_per_progress: config.steps_per_progress(),
        };
        let step = config.step();
        let reset = config.reset_workers_on_start;
        let close_timeout = config.close_timeout;
        tasks.spawn(async move {
            let result = worker.run(rx, step, reset, close_timeout).await;
            (worker_id, result)
        });
        senders.push(tx);
        live_by_worker.push((worker_id, live_here));
    }

    let snapshot = |elapsed: Duration| SimulationProgress {
        elapsed,
        duration: config.duration,
        requests_started: load(&counters.started),
        requests_completed: load(&counters.completed),
        requests_crashed: load(&counters.crashed),
        requests_throttled: load(&counters.throttled),
        live_requests: load(&counters.live),
        live_by_worker: live_by_worker
            .iter()
            .map(|(id, live)| (*id, load(live)))
            .collect(),
        started_by_worker: started_by(config.first_worker_id, &started_by_worker),
        requests_placed: load(&counters.placed),
        requests_unplaced: load(&counters.unplaced),
        events_published: load(&counters.published),
        events_dropped: load(&counters.dropped),
    };

    // The pacer: a tick every millisecond or every start interval, whichever is longer;
    // each tick starts what the rate owes so far, so the rate holds whatever the timer's
    // granularity.
    let start = Instant::now();
    let deadline = start + config.duration;
    let pace = Duration::from_secs_f64(1.0 / config.rate).max(Duration::from_millis(1));
    let mut pacer = tokio::time::interval(pace);
    pacer.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut report = tokio::time::interval(config.report_every);
    report.set_missed_tick_behavior(MissedTickBehavior::Delay);
    report.tick().await;
    let mut owed_started = 0u64;
    let mut worker_failure = None;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep_until(deadline) => break,
            Some(joined) = tasks.join_next() => {
                // A worker ended before the run did: that is a failure.
                worker_failure = Some(match joined {
                    Ok((worker_id, Ok(()))) => SimulateError::Worker {
                        worker_id,
                        message: "it ended before the run did".to_owned(),
                    },
                    other => match worker_error(other) {
                        Err(error) => error,
                        Ok(()) => unreachable!("handled above"),
                    },
                });
                break;
            }
            _ = report.tick() => progress(&snapshot(start.elapsed())),
            _ = pacer.tick() => {
                let due = (start.elapsed().as_secs_f64() * config.rate) as u64;
                while owed_started < due {
                    owed_started += 1;
                    if load(&counters.live) >= config.max_live_requests as u64 {
                        bump(&counters.throttled);
                        continue;
                    }
                    // Drawn whether or not a placer decides: a seed gives the same requests
                    // either way.
                    let mut index = planner.pick_worker();
                    let mut plan = planner.plan();
                    if let Some(placer) = &placer {
                        let sizes = RequestSizes {
                            request_id: plan.request_id.clone(),
                            prompt_tokens: plan.prompt_tokens,
                            expected_output_tokens: plan.expected_output_tokens,
                        };
                        let placed = placer(owed_started - 1, &sizes).await.and_then(
                            |(worker_id, rank)| {
                                let i = worker_id.checked_sub(config.first_worker_id)?;
                                (i < config.workers as u64 && rank < config.dp_ranks)
                                    .then_some((i as usize, rank))
                            },
                        );
                        match placed {
                            Some((i, rank)) => {
                                index = i;
                                plan.dp_rank = rank;
                                bump(&counters.placed);
                            }
                            None => bump(&counters.unplaced),
                        }
                    }
                    match senders[index].try_send(plan) {
                        Ok(()) => {
                            bump(&counters.started);
                            bump(&started_by_worker[index]);
                        }
                        Err(_) => bump(&counters.throttled),
                    }
                }
            }
        }
    }
    let ran_for = start.elapsed().min(config.duration);
    // Closing the channels tells the workers to finish.
    drop(senders);
    while let Some(joined) = tasks.join_next().await {
        if let Err(error) = worker_error(joined) {
            worker_failure.get_or_insert(error);
        }
    }
    if let Some(error) = worker_failure {
        return Err(error);
    }
    let elapsed = start.elapsed();
    progress(&snapshot(elapsed));

    let c = &counters;
    let published = load(&c.published);
    let started = load(&c.started);
    let per_second = |n: u64, over: Duration| {
        if over.is_zero() {
            0.0
        } else {
            n as f64 / over.as_secs_f64()
        }
    };
    Ok(SimulationSummary {
        workers: config.workers,
        duration: elapsed,
        requests_started: started,
        requests_completed: load(&c.completed),
        requests_cut_short: load(&c.cut_short),
        requests_crashed: load(&c.crashed),
        requests_throttled: load(&c.throttled),
        requests_placed: load(&c.placed),
        requests_unplaced: load(&c.unplaced),
        started_by_worker: started_by(config.first_worker_id, &started_by_worker),
        outcomes_finished: load(&c.finished),
        outcomes_cancelled: load(&c.cancelled),
        outcomes_failed: load(&c.failed),
        duplicates_sent: load(&c.duplicates),
        reorders_sent: load(&c.reorders),
        worker_resets_sent: load(&c.resets),
        admitted_sent: load(&c.admitted),
        progressed_sent: load(&c.progressed),
        completed_sent: load(&c.completed_events),
        events_published: published,
        events_delivered: load(&c.delivered),
        batches_delivered: load(&c.batches),
        events_dropped: load(&c.dropped) + load(&c.send_failed),
        achieved_rate: per_second(started, ran_for),
        events_per_second: per_second(published, elapsed),
    })
}

/// `(worker_id, started)` for each worker, from the per-worker counters (in id order).
fn started_by(first_worker_id: u64, counters: &[AtomicU64]) -> Vec<(u64, u64)> {
    counters
        .iter()
        .enumerate()
        .map(|(i, n)| (first_worker_id + i as u64, load(n)))
        .collect()
}

fn worker_error(
    joined: Result<(u64, Result<(), String>), tokio::task::JoinError>,
) -> Result<(), SimulateError> {
    match joined {
        Ok((_, Ok(()))) => Ok(()),
        Ok((worker_id, Err(message))) => Err(SimulateError::Worker { worker_id, message }),
        Err(join) => Err(SimulateError::Worker {
            worker_id: 0,
            message: join.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use futures::StreamExt;

    use super::*;
    use lease_router::wire::{self, EventKind};
    use lease_router::DeploymentName;
    use lease_router_testkit::NatsServerBuilder;

    fn small(seed: u64) -> SimulationConfig {
        SimulationConfig {
            workers: 3,
            rate: 400.0,
            duration: Duration::from_millis(1500),
            progress_every: Duration::from_millis(20),
            mean_request_time: Duration::from_millis(200),
            crash_share: 0.1,
            duplicate_share: 0.1,
            reorder_share: 0.1,
            seed: Some(seed),
            report_every: Duration::from_millis(100),
            ..SimulationConfig::default()
        }
    }

    #[test]
    fn defaults_are_valid_and_mistakes_name_the_setting() {
        SimulationConfig::default().validate().unwrap();
        let check = |f: fn(&mut SimulationConfig), setting: &str| {
            let mut config = SimulationConfig::default();
            f(&mut config);
            let message = config.validate().unwrap_err().to_string();
            assert!(
                message.starts_with(&format!("invalid simulation setting {setting} = ")),
                "{message}"
            );
            assert!(message.contains("accepted values are"), "{message}");
        };
        check(|c| c.workers = 0, "workers");
        check(|c| c.dp_ranks = 0, "dp ranks");
        check(|c| c.rate = 0.0, "rate");
        check(|c| c.rate = f64::NAN, "rate");
        check(|c| c.crash_share = 1.5, "crash share");
        check(|c| c.duplicate_share = -0.1, "duplicate share");
        check(|c| c.reorder_share = 2.0, "reorder share");
        check(|c| c.progress_every = Duration::ZERO, "progress interval");
        check(
            |c| c.mean_request_time = Duration::ZERO,
            "mean request time",
        );
        check(|c| c.first_worker_id = u64::MAX, "first worker id");
        check(|c| c.max_live_requests = 0, "max live requests");
    }

    #[test]
    fn a_seed_decides_every_request() {
        let plans = |seed| {
            let mut planner = Planner::new(&small(seed));
            (0..500)
                .map(|_| {
                    let worker = planner.pick_worker();
                    (worker, planner.plan())
                })
                .collect::<Vec<_>>()
        };
        let a = plans(42);
        assert_eq!(a, plans(42));
        assert_ne!(a, plans(43));
        let a: Vec<RequestPlan> = a.into_iter().map(|(_, plan)| plan).collect();
        let ids: std::collections::HashSet<_> = a.iter().map(|p| &p.request_id).collect();
        assert_eq!(ids.len(), a.len(), "request ids are unique");
        for plan in &a {
            assert!((100..=4000).contains(&plan.prompt_tokens));
            assert!(plan.dp_rank < 2);
            // At most ten mean lifetimes (200 ms) in steps of 10 ms.
            assert!(plan.ticks >= 1 && plan.ticks <= 200, "{}", plan.ticks);
            if plan.reorder == Some(Reorder::CompleteFirst) {
                assert!(matches!(plan.fate, Fate::Complete(_)));
            }
            if plan.fate == Fate::Crash {
                assert_ne!(plan.duplicate, Some(Duplicate::Completed));
            }
        }
        let share = |f: &dyn Fn(&RequestPlan) -> bool| {
            a.iter().filter(|p| f(p)).count() as f64 / a.len() as f64
        };
        assert!((0.04..0.2).contains(&share(&|p| p.fate == Fate::Crash)));
        assert!((0.04..0.2).contains(&share(&|p| p.duplicate.is_some())));
        assert!((0.04..0.2).contains(&share(&|p| p.reorder.is_some())));
        assert!((0.1..0.3).contains(&share(&|p| p.expected_output_tokens.is_none())));
    }

    #[test]
    fn durations_for_people() {
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_secs(30)), "30s");
        assert_eq!(format_duration(Duration::from_secs(300)), "5m");
        assert_eq!(format_duration(Duration::from_secs(3723)), "1h2m3s");
        for d in [250, 1500, 30_000, 300_000, 3_723_000] {
            let d = Duration::from_millis(d);
            assert_eq!(
                crate::layering::parse_duration(&format_duration(d)),
                Some(d)
            );
        }
    }

    /// The defaults follow the wire contract: `progressed` at prefill, then every few seconds,
    /// not every few milliseconds (a request of the default mean lifetime sends about one).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn default_traffic_renews_leases_every_few_seconds() {
        assert!(SimulationConfig::default().progress_every >= Duration::from_secs(1));
        let server = NatsServerBuilder::new().spawn().await.unwrap();
        let client = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::with_default_prefix(DeploymentName::new("sim").unwrap());
        let config = SimulationConfig {
            workers: 2,
            duration: Duration::from_secs(2),
            seed: Some(3),
            ..SimulationConfig::default()
        };
        let summary = run_simulation(client, subjects, config, CancellationToken::new(), |_| {})
            .await
            .unwrap();
        assert!(summary.requests_started > 100, "{summary}");
        let per_request = summary.progressed_sent as f64 / summary.requests_started as f64;
        assert!(
            (0.5..2.0).contains(&per_request),
            "{per_request} progressed per request: {summary}"
        );
    }

    /// Everything a real subscriber sees matches the summary and the lifecycle rules.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycles_on_a_real_server() {
        let server = NatsServerBuilder::new().spawn().await.unwrap();
        let client = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::with_default_prefix(DeploymentName::new("sim").unwrap());
        let mut sub = client
            .subscribe(subjects.deployment_filter())
            .await
            .unwrap();
        client.flush().await.unwrap();

        let mut reports = 0;
        let summary = run_simulation(
            client.clone(),
            subjects.clone(),
            small(7),
            CancellationToken::new(),
            |p| {
                reports += 1;
                assert!(p.live_requests <= 10_000);
                assert_eq!(p.live_by_worker.len(), 3);
            },
        )
        .await
        .unwrap();
        assert!(reports >= 5, "{reports}");

        let mut by_publisher: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut requests: BTreeMap<String, Vec<EventKind>> = BTreeMap::new();
        let mut kinds: HashMap<EventKind, u64> = HashMap::new();
        let mut received = 0u64;
        while received < summary.events_published {
            let message = tokio::time::timeout(Duration::from_secs(5), sub.next())
                .await
                .expect("every published event arrives")
                .unwrap();
            let envelope = wire::decode(&message.payload, wire::DEFAULT_MAX_EVENT_BYTES).unwrap();
            let worker = subjects.parse_worker(&message.subject).unwrap();
            assert_eq!(
                worker,
                envelope.event.worker_id(),
                "subject names the worker"
            );
            assert!((1..=3).contains(&worker));
            by_publisher
                .entry(envelope.publisher_id)
                .or_default()
                .push(envelope.sequence);
            *kinds.entry(envelope.kind()).or_default() += 1;
            if let Some(id) = envelope.event.request_id() {
                requests
                    .entry(id.to_owned())
                    .or_default()
                    .push(envelope.kind());
            }
            received += 1;
        }

        // One publisher per worker, each with its own gap-free sequence from 1.
        assert_eq!(by_publisher.len(), 3);
        for sequences in by_publisher.values() {
            let expected: Vec<u64> = (1..=sequences.len() as u64).collect();
            assert_eq!(sequences, &expected);
        }
        assert_eq!(summary.events_dropped, 0);
        assert_eq!(summary.events_delivered, summary.events_published);
        assert_eq!(kinds[&EventKind::Admitted], summary.admitted_sent);
        assert_eq!(kinds[&EventKind::Progressed], summary.progressed_sent);
        assert_eq!(kinds[&EventKind::Completed], summary.completed_sent);
        assert_eq!(kinds[&EventKind::WorkerReset], 3);
        assert_eq!(requests.len() as u64, summary.requests_started);
        assert_eq!(
            summary.requests_completed + summary.requests_crashed,
            summary.requests_started
        );
        assert_eq!(
            summary.outcomes_finished + summary.outcomes_cancelled + summary.outcomes_failed,
            summary.requests_completed
        );
        assert!(summary.requests_started >= 500, "{summary}");
        assert!(summary.requests_crashed > 0 && summary.duplicates_sent > 0);
        assert!(summary.reorders_sent > 0);

        let (mut crashed, mut completed, mut reordered, mut duplicated) = (0, 0, 0, 0);
        for (id, events) in &requests {
            let admitted = events.iter().filter(|k| **k == EventKind::Admitted).count();
            let done = events
                .iter()
                .filter(|k| **k == EventKind::Completed)
                .count();
            assert!((1..=2).contains(&admitted), "{id}: {events:?}");
            assert!(done <= 2, "{id}: {events:?}");
            if admitted == 2 || done == 2 {
                duplicated += 1;
            }
            if events[0] != EventKind::Admitted {
                reordered += 1;
            }
            if done == 0 {
                crashed += 1;
            } else {
                completed += 1;
                // Nothing follows the completion but its duplicate or a late admit.
                let last_progress = events.iter().rposition(|k| *k == EventKind::Progressed);
                let first_done = events.iter().position(|k| *k == EventKind::Completed);
                assert!(last_progress < first_done, "{id}: {events:?}");
            }
        }
        assert_eq!(crashed, summary.requests_crashed);
        assert_eq!(completed, summary.requests_completed);
        assert_eq!(reordered, summary.reorders_sent);
        assert_eq!(duplicated, summary.duplicates_sent);
    }

    #[tokio::test]
    async fn cancel_ends_the_run_early_and_completes_live_requests() {
        let server = NatsServerBuilder::new().spawn().await.unwrap();
        let client = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::with_default_prefix(DeploymentName::new("sim").unwrap());
        let cancel = CancellationToken::new();
        let config = SimulationConfig {
            duration: Duration::from_secs(600),
            mean_request_time: Duration::from_secs(60),
            crash_share: 0.0,
            ..small(1)
        };
        let stop = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            stop.cancel();
        });
        let summary = tokio::time::timeout(
            Duration::from_secs(20),
            run_simulation(client, subjects, config, cancel, |_| {}),
        )
        .await
        .expect("ends soon after the cancel")
        .unwrap();
        assert!(summary.duration < Duration::from_secs(10));
        assert!(summary.requests_started > 0);
        // A minute-long mean: almost every request was live at the cancel, and completed then.
        assert!(
            summary.requests_cut_short * 10 >= summary.requests_started * 8,
            "{summary}"
        );
        assert_eq!(summary.requests_crashed, 0);
        assert_eq!(summary.requests_completed, summary.requests_started);
    }
}
