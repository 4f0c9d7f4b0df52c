//! The relay's counters, its rate-limited warnings, and their Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Why an engine event was not relayed, beside the block-size mismatches, unknown parents
/// and malformed events that have counters of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// Another medium than the GPU (an offloaded tier's blocks).
    Medium,
    /// Another KV cache group than the first (a hybrid model's sliding-window layers).
    KvGroup,
    /// A LoRA's blocks, or blocks hashed with extra keys (multimodal inputs, a cache salt).
    ExtraKeys,
    /// An event kind of a later engine.
    UnknownKind,
}

impl Skip {
    const ALL: [Skip; 4] = [
        Skip::Medium,
        Skip::KvGroup,
        Skip::ExtraKeys,
        Skip::UnknownKind,
    ];

    fn label(self) -> &'static str {
        match self {
            Skip::Medium => "medium",
            Skip::KvGroup => "kv_group",
            Skip::ExtraKeys => "extra_keys",
            Skip::UnknownKind => "unknown_kind",
        }
    }
}

/// At most one warning of a kind per interval; the ones held back are counted and said with
/// the next.
#[derive(Debug)]
pub struct WarnLimit {
    interval: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl WarnLimit {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(suppressed since the last one)` when a warning may be logged now.
    pub fn check(&self) -> Option<u64> {
        let mut state = self.state.lock();
        let now = Instant::now();
        match state.0 {
            Some(last) if now.duration_since(last) < self.interval => {
                state.1 += 1;
                None
            }
            _ => {
                let suppressed = state.1;
                *state = (Some(now), 0);
                Some(suppressed)
            }
        }
    }
}

impl Default for WarnLimit {
    fn default() -> Self {
        Self::new(Duration::from_secs(10))
    }
}

/// What `/metrics` shows beside the relay's own counters: its publisher's and its NATS
/// connection's.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outside {
    pub queued: u64,
    pub published: u64,
    pub failed: u64,
    pub nats_connected: bool,
}

/// Every counter of the relay. All counters are monotonic; the gauges say so.
#[derive(Debug, Default)]
pub struct Metrics {
    pub batches: AtomicU64,
    pub replayed_batches: AtomicU64,
    pub events_stored: AtomicU64,
    pub events_removed: AtomicU64,
    pub events_cleared: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_removed: AtomicU64,
    pub clears_start: AtomicU64,
    pub clears_engine: AtomicU64,
    pub clears_gap: AtomicU64,
    pub clears_restart: AtomicU64,
    pub clears_malformed: AtomicU64,
    pub clears_publish: AtomicU64,
    pub clears_shutdown: AtomicU64,
    pub replay_requests: AtomicU64,
    pub replay_failures: AtomicU64,
    pub engine_disconnects: AtomicU64,
    pub dp_rank_mismatches: AtomicU64,
    pub gaps_repaired: AtomicU64,
    pub gaps_cleared: AtomicU64,
    pub engine_restarts: AtomicU64,
    pub duplicates: AtomicU64,
    pub malformed_frames: AtomicU64,
    pub malformed_events: AtomicU64,
    pub block_size_mismatches: AtomicU64,
    pub unknown_parents: AtomicU64,
    pub unknown_removed: AtomicU64,
    pub map_evictions: AtomicU64,
    pub publish_drops: AtomicU64,
    pub publish_waits: AtomicU64,
    skipped: [AtomicU64; 4],
    /// Gauge: blocks in the engine-hash map.
    pub map_blocks: AtomicU64,
    /// Gauge: the engine's last sequence number relayed.
    pub last_seq: AtomicU64,
    pub has_seq: AtomicBool,
    /// Gauge: f64 bits, seconds from the engine's `ts` to its batch being relayed (last batch).
    pub lag_seconds_bits: AtomicU64,
    /// Gauge: whether the SUB socket holds a connection to the engine.
    pub engine_connected: AtomicBool,
    warn_frames: WarnLimit,
    warn_events: WarnLimit,
    warn_block_size: WarnLimit,
    warn_parent: WarnLimit,
    warn_skip: WarnLimit,
    warn_replay: WarnLimit,
    warn_sequence: WarnLimit,
    warn_publish: WarnLimit,
    warn_dp: WarnLimit,
}

impl Metrics {
    pub fn skip(&self, why: Skip, what: &str) {
        let n = self.skipped[why as usize].fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_skip.check() {
            tracing::info!(
                reason = why.label(),
                what,
                skipped = n,
                suppressed,
                "engine event not relayed"
            );
        }
    }

    pub fn skipped(&self, why: Skip) -> u64 {
        self.skipped[why as usize].load(Relaxed)
    }

    pub fn malformed_frame(&self, why: &str) {
        let n = self.malformed_frames.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_frames.check() {
            tracing::warn!(
                why,
                malformed_frames = n,
                suppressed,
                "malformed engine message dropped"
            );
        }
    }

    pub fn malformed_event(&self, why: &str) {
        let n = self.malformed_events.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_events.check() {
            tracing::warn!(
                why,
                malformed_events = n,
                suppressed,
                "malformed engine event dropped"
            );
        }
    }

    pub fn block_size_mismatch(&self, engine: u64, ours: usize) {
        let n = self.block_size_mismatches.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_block_size.check() {
            tracing::warn!(
                engine_block_size = engine,
                block_size = ours,
                block_size_mismatches = n,
                suppressed,
                "a BlockStored of another block size than --block-size: skipped (set \
                 --block-size to the engine's)"
            );
        }
    }

    pub fn unknown_parent(&self) {
        let n = self.unknown_parents.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_parent.check() {
            tracing::info!(
                unknown_parents = n,
                suppressed,
                "a BlockStored whose parent block this relay does not know: skipped"
            );
        }
    }

    pub fn replay_failed(&self, why: &str) {
        let n = self.replay_failures.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_replay.check() {
            tracing::warn!(
                why,
                replay_failures = n,
                suppressed,
                "the engine's replay failed"
            );
        }
    }

    /// `seq`: the first of the new engine, if a message showed the restart (`None`: a
    /// reconnect found another engine's replay buffer).
    pub fn engine_restart(&self, last: u64, seq: Option<u64>) {
        let n = self.engine_restarts.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_sequence.check() {
            let how = match seq {
                Some(_) => "its sequence started over",
                None => "after a reconnect, its replay buffer is not the one relayed",
            };
            tracing::warn!(
                last,
                seq,
                how,
                engine_restarts = n,
                suppressed,
                "the engine restarted: kv_cleared and a fresh start"
            );
        }
    }

    pub fn gap_cleared(&self, from: u64, to: u64) {
        let n = self.gaps_cleared.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_sequence.check() {
            tracing::warn!(
                missing_from = from,
                missing_to = to.saturating_sub(1),
                gaps_cleared = n,
                suppressed,
                "engine messages lost and not in its replay buffer: kv_cleared and a fresh start"
            );
        }
    }

    pub fn publish_dropped(&self, events: u64, why: &str) {
        let n = self.publish_drops.fetch_add(events, Relaxed) + events;
        if let Some(suppressed) = self.warn_publish.check() {
            tracing::warn!(
                why,
                publish_dropped = n,
                suppressed,
                "a KV event was not queued: kv_cleared follows"
            );
        }
    }

    pub fn dp_rank_mismatch(&self, engine: i64, ours: u32) {
        let n = self.dp_rank_mismatches.fetch_add(1, Relaxed) + 1;
        if let Some(suppressed) = self.warn_dp.check() {
            tracing::warn!(
                engine_dp_rank = engine,
                dp_rank = ours,
                dp_rank_mismatches = n,
                suppressed,
                "a batch of another data-parallel rank than --dp-rank (relayed as --dp-rank; \
                 one relay per rank, each on its rank's port)"
            );
        }
    }

    pub fn set_lag(&self, seconds: f64) {
        self.lag_seconds_bits.store(seconds.to_bits(), Relaxed);
    }

    pub fn lag(&self) -> f64 {
        f64::from_bits(self.lag_seconds_bits.load(Relaxed))
    }

    pub fn last_seq(&self) -> Option<u64> {
        self.has_seq
            .load(Relaxed)
            .then(|| self.last_seq.load(Relaxed))
    }

    /// The Prometheus text exposition of every counter and gauge.
    pub fn render(&self, outside: &Outside) -> String {
        let mut out = String::with_capacity(4096);
        let mut family = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP lease_router_relay_{name} {help}");
            let _ = writeln!(out, "# TYPE lease_router_relay_{name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "lease_router_relay_{name}{labels} {value}");
            }
        };
        let c = |a: &AtomicU64| a.load(Relaxed) as f64;
        family(
            "batches_total",
            "counter",
            "Engine event batches relayed (live and replayed).",
            &[("", c(&self.batches))],
        );
        family(
            "replayed_batches_total",
            "counter",
            "Engine event batches taken from the replay socket.",
            &[("", c(&self.replayed_batches))],
        );
        family(
            "events_total",
            "counter",
            "Engine events relayed, by kind.",
            &[
                ("{kind=\"stored\"}", c(&self.events_stored)),
                ("{kind=\"removed\"}", c(&self.events_removed)),
                ("{kind=\"cleared\"}", c(&self.events_cleared)),
            ],
        );
        family(
            "blocks_stored_total",
            "counter",
            "Blocks published as stored.",
            &[("", c(&self.blocks_stored))],
        );
        family(
            "blocks_removed_total",
            "counter",
            "Blocks published as removed (engine removals and map evictions).",
            &[("", c(&self.blocks_removed))],
        );
        family(
            "clears_total",
            "counter",
            "kv_cleared published, by reason.",
            &[
                ("{reason=\"start\"}", c(&self.clears_start)),
                ("{reason=\"engine\"}", c(&self.clears_engine)),
                ("{reason=\"gap\"}", c(&self.clears_gap)),
                ("{reason=\"engine_restart\"}", c(&self.clears_restart)),
                ("{reason=\"malformed\"}", c(&self.clears_malformed)),
                ("{reason=\"publish_lost\"}", c(&self.clears_publish)),
                ("{reason=\"shutdown\"}", c(&self.clears_shutdown)),
            ],
        );
        family(
            "gaps_repaired_total",
            "counter",
            "Gaps in the engine's sequence filled from its replay socket.",
            &[("", c(&self.gaps_repaired))],
        );
        family(
            "gaps_cleared_total",
            "counter",
            "Gaps the replay socket could not fill: kv_cleared and a fresh start.",
            &[("", c(&self.gaps_cleared))],
        );
        family(
            "engine_restarts_total",
            "counter",
            "Engine restarts seen (its sequence started over).",
            &[("", c(&self.engine_restarts))],
        );
        family(
            "replay_requests_total",
            "counter",
            "Requests to the engine's replay socket (start, gaps, reconnects).",
            &[("", c(&self.replay_requests))],
        );
        family(
            "replay_failures_total",
            "counter",
            "Replay requests that got no end marker (no connection, a timeout).",
            &[("", c(&self.replay_failures))],
        );
        family(
            "engine_disconnects_total",
            "counter",
            "Times the SUB socket lost its connection to the engine.",
            &[("", c(&self.engine_disconnects))],
        );
        family(
            "dp_rank_mismatches_total",
            "counter",
            "Batches whose data_parallel_rank is not --dp-rank (relayed as --dp-rank).",
            &[("", c(&self.dp_rank_mismatches))],
        );
        family(
            "duplicates_total",
            "counter",
            "Engine batches seen twice (live after replay) and dropped.",
            &[("", c(&self.duplicates))],
        );
        family(
            "malformed_frames_total",
            "counter",
            "Engine messages dropped as malformed (frames or payload).",
            &[("", c(&self.malformed_frames))],
        );
        family(
            "malformed_events_total",
            "counter",
            "Engine events of a good batch dropped as malformed.",
            &[("", c(&self.malformed_events))],
        );
        family(
            "block_size_mismatches_total",
            "counter",
            "BlockStored events of another block size than --block-size, skipped.",
            &[("", c(&self.block_size_mismatches))],
        );
        family(
            "unknown_parents_total",
            "counter",
            "BlockStored events whose parent block the relay does not know, skipped.",
            &[("", c(&self.unknown_parents))],
        );
        family(
            "unknown_removed_blocks_total",
            "counter",
            "Removed blocks the relay does not know (never stored, or skipped).",
            &[("", c(&self.unknown_removed))],
        );
        let skipped: Vec<(String, f64)> = Skip::ALL
            .iter()
            .map(|&why| {
                (
                    format!("{{reason=\"{}\"}}", why.label()),
                    self.skipped(why) as f64,
                )
            })
            .collect();
        let skipped: Vec<(&str, f64)> = skipped.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        family(
            "skipped_events_total",
            "counter",
            "Engine events not relayed, by reason.",
            &skipped,
        );
        family(
            "map_evictions_total",
            "counter",
            "Blocks that left the engine-hash map at its bound (published as removed).",
            &[("", c(&self.map_evictions))],
        );
        family(
            "publish_dropped_total",
            "counter",
            "KV events lost on the way to the publisher (its queue full for 5 s, or closed).",
            &[("", c(&self.publish_drops))],
        );
        family(
            "publish_waits_total",
            "counter",
            "Times the relay waited for its publisher's full queue (a burst: it holds back).",
            &[("", c(&self.publish_waits))],
        );
        family(
            "map_blocks",
            "gauge",
            "Blocks in the engine-hash map.",
            &[("", c(&self.map_blocks))],
        );
        family(
            "last_sequence",
            "gauge",
            "The engine's last sequence number relayed (-1: none yet).",
            &[("", self.last_seq().map_or(-1.0, |s| s as f64))],
        );
        family(
            "lag_seconds",
            "gauge",
            "Seconds from the engine's batch timestamp to the batch being relayed (last batch).",
            &[("", self.lag())],
        );
        family(
            "engine_connected",
            "gauge",
            "1 while the SUB socket is connected to the engine.",
            &[("", f64::from(u8::from(self.engine_connected.load(Relaxed))))],
        );
        family(
            "publisher_queued_total",
            "counter",
            "KV events queued by the relay's publisher.",
            &[("", outside.queued as f64)],
        );
        family(
            "publisher_published_total",
            "counter",
            "KV events handed to NATS.",
            &[("", outside.published as f64)],
        );
        family(
            "publisher_failed_total",
            "counter",
            "KV events given up after their last publish attempt.",
            &[("", outside.failed as f64)],
        );
        family(
            "nats_connected",
            "gauge",
            "1 while the NATS connection is up.",
            &[("", f64::from(u8::from(outside.nats_connected)))],
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_text_has_each_family_once_with_help_and_type() {
        let m = Metrics::default();
        m.skip(Skip::Medium, "CPU");
        m.gaps_repaired.fetch_add(2, Relaxed);
        let outside = Outside {
            published: 3,
            ..Outside::default()
        };
        let text = m.render(&outside);
        assert!(
            text.contains("lease_router_relay_gaps_repaired_total 2\n"),
            "{text}"
        );
        assert!(text.contains("lease_router_relay_skipped_events_total{reason=\"medium\"} 1\n"));
        assert!(text.contains("lease_router_relay_last_sequence -1\n"));
        assert!(text.contains("lease_router_relay_publisher_published_total 3\n"));
        let types = text.lines().filter(|l| l.starts_with("# TYPE")).count();
        let helps = text.lines().filter(|l| l.starts_with("# HELP")).count();
        assert_eq!(types, helps);
    }

    /// The relay's metrics README.md describes (its "Prefix-aware routing with vLLM"
    /// section's table), by name and type, are exactly those rendered.
    #[test]
    fn readme_documents_exactly_the_relay_metrics() {
        let readme = include_str!("../../../README.md");
        let section = readme
            .split("\n## Prefix-aware routing with vLLM\n")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("README.md has a section Prefix-aware routing with vLLM");
        let mut documented = std::collections::BTreeMap::new();
        for row in section.lines().filter(|l| l.starts_with("| `relay_")) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            for name in cells[1].split(',').map(|n| n.trim().trim_matches('`')) {
                let previous = documented.insert(name.to_owned(), cells[2].to_owned());
                assert!(previous.is_none(), "{name} documented twice");
            }
        }
        let text = Metrics::default().render(&Outside::default());
        let rendered: std::collections::BTreeMap<String, String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE lease_router_"))
            .map(|l| {
                let (name, kind) = l.split_once(' ').expect("name and type");
                (name.to_owned(), kind.to_owned())
            })
            .collect();
        assert_eq!(
            documented, rendered,
            "README.md's relay metrics and /metrics differ"
        );
    }

    #[test]
    fn warnings_are_rate_limited() {
        let limit = WarnLimit::new(Duration::from_secs(3600));
        assert_eq!(limit.check(), Some(0));
        assert_eq!(limit.check(), None);
        assert_eq!(limit.check(), None);
    }
}
