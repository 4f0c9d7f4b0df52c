//! How one lease's weight on its worker moves with its progress (the phases are described
//! in [`crate::load`]).
//!
//! The lease keeps what it needs to compute its weight (the admitted sizes, and its progress
//! in one atomic word), and every change of it is handed to the scheduler as a delta (a shift
//! from the old weight to the new), so a release gives back exactly what the booking and
//! its shifts added.
//!
//! Progress is applied under the shard's **read** lock (as renewals are), while the reaper
//! claims under the read lock too. They meet on the progress word: the claimer seals it and
//! releases the weight of the state it sealed; a progress step after the seal changes
//! nothing and sends nothing. Either a shift is sent and the sealed state includes it, or
//! neither: the sums stay exact whatever the interleaving.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::load::{BookingSizes, BookingWeight, RequestLoad};

const OUTPUT_MASK: u64 = u32::MAX as u64;
/// Set by the first `progressed`: prefill is over.
const PREFILL_DONE: u64 = 1 << 32;
/// Set by whoever claims the lease: the weight is final.
const SEALED: u64 = 1 << 33;

/// A lease's weight: its admitted sizes and its progress (20 bytes).
#[derive(Debug, Default)]
pub(crate) struct LeaseWeight {
    admitted: BookingSizes,
    /// Output tokens so far (low 32 bits), [`PREFILL_DONE`], [`SEALED`].
    progress: AtomicU64,
}

impl LeaseWeight {
    pub(crate) fn new(load: RequestLoad) -> Self {
        Self {
            admitted: load.into(),
            progress: AtomicU64::new(0),
        }
    }

    fn weight_at(&self, progress: u64) -> BookingWeight {
        self.admitted.weight(
            progress & PREFILL_DONE != 0,
            (progress & OUTPUT_MASK) as u32,
        )
    }

    /// What the lease weighs now.
    pub(crate) fn weight(&self) -> BookingWeight {
        self.weight_at(self.progress.load(Ordering::Acquire))
    }

    /// A `progressed` with `output_tokens` so far: prefill is done, and the output count
    /// moves up (never down: events may arrive out of order). Returns the weight before and
    /// after when it changed, `None` when it did not or the lease is sealed.
    pub(crate) fn advance(&self, output_tokens: u32) -> Option<(BookingWeight, BookingWeight)> {
        let mut current = self.progress.load(Ordering::Acquire);
        loop {
            if current & SEALED != 0 {
                return None;
            }
            let output = (current & OUTPUT_MASK).max(u64::from(output_tokens));
            let next = PREFILL_DONE | output;
            if next == current {
                return None;
            }
            match self.progress.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some((self.weight_at(current), self.weight_at(next))),
                Err(actual) => current = actual,
            }
        }
    }

    /// The admitted sizes, and the output count once prefill is done: what a snapshot keeps
    /// to rebuild this load with an admission and a `progressed`.
    pub(crate) fn image(&self) -> (RequestLoad, Option<u32>) {
        let progress = self.progress.load(Ordering::Acquire);
        let output = (progress & PREFILL_DONE != 0).then_some((progress & OUTPUT_MASK) as u32);
        (self.admitted.into(), output)
    }

    /// Freezes the weight, for the release by whoever claimed the lease: later progress
    /// steps change nothing. Returns the final weight.
    pub(crate) fn seal(&self) -> BookingWeight {
        self.weight_at(self.progress.fetch_or(SEALED, Ordering::AcqRel))
    }

    /// Replaces the admitted sizes (an `admitted` taking over a provisional booking); needs
    /// the shard's write lock, so no claim runs meanwhile. Returns the weight before and after.
    pub(crate) fn readmit(&mut self, load: RequestLoad) -> (BookingWeight, BookingWeight) {
        let before = self.weight();
        self.admitted = load.into();
        (before, self.weight())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(prefill: u32, kv: u32, remaining: u32) -> (u32, u32, u32) {
        (prefill, kv, remaining)
    }

    fn parts(w: BookingWeight) -> (u32, u32, u32) {
        (w.prefill_tokens, w.kv_tokens, w.remaining_output_tokens)
    }

    #[test]
    fn phases_move_the_weight() {
        let load = LeaseWeight::new(RequestLoad::new(100, Some(20)).with_cached_tokens(30));
        assert_eq!(parts(load.weight()), weight(70, 100, 20), "admitted");
        let (before, after) = load.advance(0).expect("prefill done moves it");
        assert_eq!(
            (parts(before), parts(after)),
            (weight(70, 100, 20), weight(0, 100, 20))
        );
        assert_eq!(
            load.advance(0),
            None,
            "the same progress again moves nothing"
        );
        let (_, after) = load.advance(5).unwrap();
        assert_eq!(parts(after), weight(0, 105, 15));
        assert_eq!(load.advance(3), None, "output never goes backwards");
        let (_, after) = load.advance(50).unwrap();
        assert_eq!(
            parts(after),
            weight(0, 150, 0),
            "still to come never below zero"
        );
        assert_eq!(parts(load.seal()), weight(0, 150, 0));
        assert_eq!(
            load.advance(60),
            None,
            "sealed: nothing moves after the claim"
        );
        assert_eq!(parts(load.weight()), weight(0, 150, 0));
    }

    #[test]
    fn cached_beyond_the_prompt_leaves_no_prefill_and_unknown_output_counts_nothing() {
        let load = LeaseWeight::new(RequestLoad::new(10, None).with_cached_tokens(50));
        let w = load.weight();
        assert_eq!(parts(w), weight(0, 10, 0));
        assert_eq!((w.prompt_tokens, w.expected_output_tokens), (10, 0));
    }

    #[test]
    fn readmit_replaces_the_sizes_and_keeps_the_progress() {
        let mut load = LeaseWeight::new(RequestLoad::new(100, Some(10)));
        load.advance(4);
        let (before, after) = load.readmit(RequestLoad::new(80, Some(20)).with_cached_tokens(80));
        assert_eq!(parts(before), weight(0, 104, 6));
        assert_eq!(parts(after), weight(0, 84, 16));
    }
}

/// The sums property: whatever order events arrive in, the scheduler's per-worker sums equal
/// the sums over the live leases, and each live lease weighs what its events say.
#[cfg(test)]
mod property {
    use std::collections::HashMap;
    use std::sync::Arc;

    use proptest::prelude::*;
    use tokio_util::task::TaskTracker;

    use crate::ingress::{ApplyConfig, EventApplier};
    use crate::lease::{LeaseConfig, RequestLeaseManager};
    use crate::load::RequestLoad;
    use crate::load::WorkerLoad;
    use crate::scheduler::{Scheduler, SchedulerHandle};
    use crate::stats::IngressStats;
    use crate::subject::{DeploymentName, Subjects};
    use crate::types::{RequestId, SchedulerBookingDescriptor, WorkerWithDpRank};
    use crate::wire::{
        self, Admitted, Completed, Envelope, LeaseEvent, Outcome, ProgressStage, Progressed,
        WorkerReset,
    };

    #[derive(Clone, Debug)]
    enum Action {
        Admit {
            req: u8,
            worker: (u64, u32),
            ptok: u32,
            ctok: Option<u32>,
            etok: Option<u32>,
        },
        Progress {
            req: u8,
            worker: (u64, u32),
            otok: u32,
        },
        Complete {
            req: u8,
            worker: (u64, u32),
        },
        Reset {
            worker_id: u64,
            dp_rank: Option<u32>,
            leaving: bool,
        },
        /// The last message delivered again, as the bus may (same publisher, same number).
        Redeliver,
        /// One reaper pass over every shard: TOUCHED leases go QUIET, QUIET ones expire.
        Scan,
        /// A route decision's provisional booking.
        Route {
            req: u8,
            worker: (u64, u32),
            ptok: u32,
        },
    }

    fn worker() -> impl Strategy<Value = (u64, u32)> {
        (0..3u64, 0..2u32)
    }

    fn action() -> impl Strategy<Value = Action> {
        let req = 0..8u8;
        prop_oneof![
            4 => (req.clone(), worker(), 0..2000u32, proptest::option::of(0..2500u32), proptest::option::of(0..800u32))
                .prop_map(|(req, worker, ptok, ctok, etok)| Action::Admit { req, worker, ptok, ctok, etok }),
            5 => (req.clone(), worker(), 0..1000u32)
                .prop_map(|(req, worker, otok)| Action::Progress { req, worker, otok }),
            3 => (req.clone(), worker()).prop_map(|(req, worker)| Action::Complete { req, worker }),
            1 => (0..3u64, proptest::option::of(0..2u32), any::<bool>())
                .prop_map(|(worker_id, dp_rank, leaving)| Action::Reset { worker_id, dp_rank, leaving }),
            1 => Just(Action::Redeliver),
            2 => Just(Action::Scan),
            2 => (req, worker(), 0..2000u32).prop_map(|(req, worker, ptok)| Action::Route { req, worker, ptok }),
        ]
    }

    struct Harness {
        manager: RequestLeaseManager,
        scheduler: SchedulerHandle,
        applier: EventApplier,
        subjects: Subjects,
        /// Next sequence number per worker id (one publisher per worker).
        seq: HashMap<u64, u64>,
        last: Option<(String, Vec<u8>)>,
        _tracker: TaskTracker,
    }

    impl Harness {
        fn new() -> Self {
            let tracker = TaskTracker::new();
            let (scheduler, actor) = Scheduler::new("prop");
            let config = LeaseConfig {
                shards: 4,
                ..LeaseConfig::default()
            };
            let manager = RequestLeaseManager::new("prop", config, scheduler.cleanup());
            actor.spawn(Some(manager.replica_observer()), &tracker);
            let subjects = Subjects::with_default_prefix(DeploymentName::new("prop").unwrap());
            let applier = EventApplier::new(
                subjects.clone(),
                manager.downgrade(),
                Arc::new(IngressStats::new()),
                ApplyConfig::default(),
            );
            Self {
                manager,
                scheduler,
                applier,
                subjects,
                seq: HashMap::new(),
                last: None,
                _tracker: tracker,
            }
        }

        fn send(&mut self, event: impl Into<LeaseEvent>) {
            let event = event.into();
            let worker_id = event.worker_id();
            let seq = self.seq.entry(worker_id).or_insert(0);
            *seq += 1;
            let envelope = Envelope::new(worker_id + 1, *seq, wire::unix_micros_now(), event);
            let subject = self.subjects.worker_subject(worker_id);
            let bytes = wire::encode(&envelope).unwrap();
            self.applier.apply(&subject, &bytes).expect("router alive");
            self.last = Some((subject, bytes));
        }

        fn run(&mut self, action: &Action) {
            let rid = |req: &u8| format!("r{req}");
            match action.clone() {
                Action::Admit {
                    req,
                    worker,
                    ptok,
                    ctok,
                    etok,
                } => self.send(Admitted {
                    block_hashes: Vec::new(),
                    block_capacity: None,
                    class: None,
                    request_id: rid(&req),
                    worker_id: worker.0,
                    dp_rank: worker.1,
                    prompt_tokens: ptok,
                    expected_output_tokens: etok,
                    cached_tokens: ctok,
                }),
                Action::Progress { req, worker, otok } => self.send(Progressed {
                    request_id: rid(&req),
                    worker_id: worker.0,
                    dp_rank: worker.1,
                    stage: if otok == 0 {
                        ProgressStage::PrefillDone
                    } else {
                        ProgressStage::Decoding
                    },
                    output_tokens: otok,
                }),
                Action::Complete { req, worker } => self.send(Completed {
                    request_id: rid(&req),
                    worker_id: worker.0,
                    dp_rank: worker.1,
                    outcome: Outcome::Finished,
                }),
                Action::Reset {
                    worker_id,
                    dp_rank,
                    leaving,
                } => self.send(WorkerReset {
                    worker_id,
                    dp_rank,
                    leaving,
                }),
                Action::Redeliver => {
                    if let Some((subject, bytes)) = self.last.clone() {
                        self.applier.apply(&subject, &bytes).expect("router alive");
                    }
                }
                Action::Scan => {
                    for shard in 0..self.manager.shard_count() {
                        self.manager.scan_shard(shard);
                    }
                }
                Action::Route { req, worker, ptok } => {
                    let booking = SchedulerBookingDescriptor::new(
                        RequestId::from(rid(&req)),
                        WorkerWithDpRank::new(worker.0, worker.1),
                    );
                    self.manager
                        .book_provisional(booking, RequestLoad::new(ptok, Some(64)));
                }
            }
        }

        /// The scheduler's sums, without workers whose sums are all zero.
        async fn scheduler_sums(&self) -> Vec<(WorkerWithDpRank, WorkerLoad)> {
            let mut loads = self.scheduler.loads().await.unwrap();
            loads.retain(|(_, load)| *load != WorkerLoad::default());
            loads
        }
    }

    fn check(actions: Vec<Action>) -> Result<(), TestCaseError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut h = Harness::new();
            for (step, action) in actions.iter().enumerate() {
                h.run(action);
                let live = h.manager.live_loads();
                prop_assert_eq!(
                    h.scheduler_sums().await,
                    live.clone(),
                    "after step {} ({:?})",
                    step,
                    action
                );
                for (worker, load) in live {
                    // What each figure means bounds the others.
                    prop_assert!(
                        load.prefill_tokens <= load.prompt_tokens,
                        "{worker}: {load:?}"
                    );
                    prop_assert!(load.kv_tokens >= load.prompt_tokens, "{worker}: {load:?}");
                    prop_assert!(
                        load.remaining_output_tokens <= load.expected_output_tokens,
                        "{worker}: {load:?}"
                    );
                }
            }
            // Two scans expire everything left: nothing may stay counted.
            h.run(&Action::Scan);
            h.run(&Action::Scan);
            prop_assert_eq!(h.manager.active_leases(), 0);
            prop_assert_eq!(h.scheduler_sums().await, Vec::new());
            Ok(())
        })
    }

    fn load_of(h: &Harness, worker: (u64, u32)) -> WorkerLoad {
        let worker = WorkerWithDpRank::new(worker.0, worker.1);
        h.manager
            .live_loads()
            .into_iter()
            .find(|(w, _)| *w == worker)
            .map(|(_, load)| load)
            .unwrap_or_default()
    }

    fn phases(load: WorkerLoad) -> (u64, u64, u64, u64) {
        (
            load.active_bookings,
            load.prefill_tokens,
            load.kv_tokens,
            load.remaining_output_tokens,
        )
    }

    #[tokio::test]
    async fn progress_held_before_its_admission_applies_its_highest_count_at_admit() {
        let mut h = Harness::new();
        for otok in [40, 25] {
            h.run(&Action::Progress {
                req: 1,
                worker: (0, 0),
                otok,
            });
        }
        assert_eq!(
            phases(load_of(&h, (0, 0))),
            (0, 0, 0, 0),
            "held, not applied"
        );
        h.run(&Action::Admit {
            req: 1,
            worker: (0, 0),
            ptok: 100,
            ctok: Some(30),
            etok: Some(50),
        });
        assert_eq!(phases(load_of(&h, (0, 0))), (1, 0, 140, 10));
        assert_eq!(h.scheduler_sums().await, h.manager.live_loads());
    }

    #[tokio::test]
    async fn an_admission_takes_a_provisional_booking_over_and_one_elsewhere_supersedes_it() {
        let mut h = Harness::new();
        h.run(&Action::Route {
            req: 1,
            worker: (0, 0),
            ptok: 500,
        });
        assert_eq!(
            phases(load_of(&h, (0, 0))),
            (1, 500, 500, 64),
            "the estimate"
        );
        h.run(&Action::Admit {
            req: 1,
            worker: (0, 0),
            ptok: 400,
            ctok: Some(100),
            etok: Some(10),
        });
        assert_eq!(
            phases(load_of(&h, (0, 0))),
            (1, 300, 400, 10),
            "the worker's sizes, once"
        );
        let stats = h.manager.stats();
        assert_eq!(
            (stats.provisional, stats.taken_over, stats.registered),
            (1, 1, 0)
        );

        h.run(&Action::Route {
            req: 2,
            worker: (0, 0),
            ptok: 500,
        });
        h.run(&Action::Admit {
            req: 2,
            worker: (1, 0),
            ptok: 7,
            ctok: None,
            etok: None,
        });
        assert_eq!(phases(load_of(&h, (0, 0))), (1, 300, 400, 10), "released");
        assert_eq!(phases(load_of(&h, (1, 0))), (1, 7, 7, 0));
        assert_eq!(h.manager.stats().superseded, 1);
        assert_eq!(h.scheduler_sums().await, h.manager.live_loads());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        #[test]
        fn per_worker_sums_equal_the_sums_over_live_leases(
            actions in proptest::collection::vec(action(), 1..60)
        ) {
            check(actions)?;
        }
    }
}
