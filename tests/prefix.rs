//! Where each prompt's prefix is cached. The block hashes against their test vectors
//! (`schemas/fixtures/block_hashes.json`): the Rust function and the Python reference
//! (`schemas/examples/block_hashes.py`, written apart from it) must both reproduce every
//! case. Then the prefix index against a real nats-server: learned from `admitted` events on
//! the bus, forgotten on resets, bounded by a worker's capacity, the same in two replicas,
//! and used by the route decision.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use lease_router::wire::{Admitted, WorkerReset, MAX_BLOCK_HASHES};
use lease_router::{block_hashes, DEFAULT_BLOCK_SIZE};
use lease_router::{
    ApplyConfig, DropReason, IngressStats, NatsConnection, NatsIngress, PrefixIndexConfig,
    RouteDecision, RouteRequest, RouteRequestError, Router, RouterConfig, WorkerWithDpRank,
};
use tokio_util::task::TaskTracker;

fn fixture() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/fixtures/block_hashes.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_rust_function_reproduces_every_test_vector() {
    let fixture = fixture();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 8, "{} cases", cases.len());
    let mut blocks = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let size = case["block_size"].as_u64().unwrap() as usize;
        let tokens: Vec<u32> = case["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let expected: Vec<u64> = case["block_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| u64::from_str_radix(h.as_str().unwrap(), 16).unwrap())
            .collect();
        assert_eq!(block_hashes(&tokens, size), expected, "{name}");
        blocks += expected.len();
    }
    assert!(blocks >= 10, "the vectors hash {blocks} blocks");
    assert_eq!(DEFAULT_BLOCK_SIZE, 16);
}

#[test]
fn the_python_reference_reproduces_every_test_vector() {
    let output = Command::new("python3")
        .args(["schemas/examples/block_hashes.py", "--check"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 runs (README's test command provides it)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("No module named 'xxhash'"),
        "the xxhash package is missing: scripts/test installs it into .tools/venv \
         (or: python3 -m pip install xxhash)"
    );
    assert!(output.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("cases reproduced"));
}

const NO_EXPIRY: Duration = Duration::from_secs(3600);

fn w(worker: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(worker, 0)
}

/// A router on `deployment`'s subjects with the default prefix settings.
async fn prefix_router(conn: &NatsConnection, deployment: &str) -> (Router, Arc<IngressStats>) {
    let stats = Arc::new(IngressStats::new());
    let ingress = NatsIngress::new(
        conn.client().clone(),
        subjects(deployment),
        ApplyConfig::default(),
        stats.clone(),
    );
    let config = RouterConfig::new(deployment)
        .with_scan_interval(NO_EXPIRY)
        .with_prefix(PrefixIndexConfig::new().with_block_size(16));
    let router = Router::start_tracked(config, ingress, TaskTracker::new())
        .await
        .expect("router starts");
    (router, stats)
}

/// A prompt of `len` tokens: `shared` tokens of one conversation, then tokens of its own.
fn prompt(conversation: u32, shared: usize, own: u32, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| {
            if i < shared {
                conversation * 100_000 + i as u32
            } else {
                own * 1_000_000 + i as u32
            }
        })
        .collect()
}

/// An `admitted` that says its worker holds `tokens`' blocks (the first 256).
fn admitted_with(request_id: &str, worker: u64, tokens: &[u32]) -> Admitted {
    let mut hashes = block_hashes(tokens, 16);
    hashes.truncate(MAX_BLOCK_HASHES);
    Admitted {
        block_hashes: hashes,
        ..admitted(request_id, worker, tokens.len() as u32)
    }
}

fn overlap_of(decision: &RouteDecision, worker: WorkerWithDpRank) -> Option<u32> {
    decision
        .candidates
        .iter()
        .find(|c| c.worker == worker)
        .map(|c| c.overlap_blocks)
}

/// Waits until the router has learned `n` admissions' blocks.
async fn learned(router: &Router, n: u64) {
    let scheduler = router.scheduler().clone();
    assert!(
        eventually(BOUND, || async {
            scheduler.prefix_figures().learned_admissions >= n
        })
        .await,
        "{:?}",
        scheduler.prefix_figures()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_goes_where_the_bus_says_the_prefix_is_cached_until_that_worker_resets() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let (router, stats) = prefix_router(&conn, "affinity").await;
    let scheduler = router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "affinity", 1);

    // Worker 1 holds conversation 7's first 1,024 tokens (64 blocks) and carries more load
    // than worker 2, which holds another conversation.
    let held = prompt(7, 1024, 1, 1024);
    let admission = admitted_with("turn-1", 1, &held);
    publisher.send(admission.clone()).await;
    publisher
        .send(admitted_with("other", 2, &prompt(8, 512, 2, 512)))
        .await;
    // The same admission again (another publisher: not a duplicate on the wire) only
    // refreshes what worker 1 holds.
    let mut again = RawPublisher::new(conn.client().clone(), "affinity", 2);
    again.send(admission).await;
    publisher.flush().await;
    again.flush().await;
    learned(&router, 3).await;
    assert_eq!(scheduler.prefix_figures().entries, 64 + 32);

    // The next turn: the conversation so far, then 512 new tokens.
    let next_turn = prompt(7, 1024, 3, 1536);
    let aware = scheduler
        .route(RouteRequest::new("turn-2", 0).with_token_ids(next_turn.clone()))
        .await
        .unwrap();
    assert_eq!(aware.worker(), w(1), "{aware:?}");
    assert_eq!(overlap_of(&aware, w(1)), Some(64));
    assert_eq!(overlap_of(&aware, w(2)), Some(0));
    let chosen = &aware.candidates[0];
    assert_eq!(chosen.cached_tokens, 1024);
    // Without the prompt, the same request goes by load alone: to the idler worker 2.
    let blind = scheduler
        .route(RouteRequest::new("blind", 1536))
        .await
        .unwrap();
    assert_eq!(blind.worker(), w(2), "{blind:?}");
    assert!(blind.candidates.iter().all(|c| c.overlap_blocks == 0));

    // The decision's own booking entered the index at once: all 96 blocks of turn 2.
    let hashes = block_hashes(&next_turn, 16);
    let third = scheduler
        .route(RouteRequest::new("turn-2-retry", 1536).with_block_hashes(hashes.clone()))
        .await
        .unwrap();
    assert_eq!(overlap_of(&third, w(1)), Some(96), "{third:?}");

    // Worker 1 restarts: its engine's cache is empty, and so is what the index holds of it.
    publisher
        .send(WorkerReset {
            worker_id: 1,
            dp_rank: None,
            leaving: false,
        })
        .await;
    publisher.flush().await;
    assert!(
        eventually(BOUND, || async {
            scheduler.prefix_figures().forgotten_entries >= 96
        })
        .await,
        "{:?}",
        scheduler.prefix_figures()
    );
    let after = scheduler
        .route(RouteRequest::new("turn-2-after-reset", 1536).with_block_hashes(hashes))
        .await
        .unwrap();
    assert_eq!(overlap_of(&after, w(1)), Some(0), "{after:?}");
    assert_eq!(stats.snapshot().dropped_total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_holds_its_announced_capacity_and_a_leaving_worker_holds_nothing() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let (router, _stats) = prefix_router(&conn, "capacity").await;
    let scheduler = router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "capacity", 1);
    let tokens = prompt(1, 256, 1, 256);
    publisher
        .send(Admitted {
            block_capacity: Some(4),
            class: None,
            ..admitted_with("small", 5, &tokens)
        })
        .await;
    publisher.send(admitted_with("big", 6, &tokens)).await;
    publisher.flush().await;
    learned(&router, 2).await;
    let figures = scheduler.prefix_figures();
    assert_eq!(
        (figures.entries, figures.evicted),
        (4 + 16, 12),
        "{figures:?}"
    );
    // The 4 it keeps are the prompt's first: its tail went first, as an engine evicts.
    let hashes = block_hashes(&tokens, 16);
    let decision = scheduler
        .route(RouteRequest::new("probe", 256).with_block_hashes(hashes.clone()))
        .await
        .unwrap();
    assert_eq!(overlap_of(&decision, w(5)), Some(4), "{decision:?}");
    assert_eq!(overlap_of(&decision, w(6)), Some(16));

    publisher
        .send(WorkerReset {
            worker_id: 6,
            dp_rank: None,
            leaving: true,
        })
        .await;
    publisher.flush().await;
    assert!(
        eventually(BOUND, || async {
            scheduler.prefix_figures().forgotten_entries >= 16
        })
        .await
    );
    let decision = scheduler
        .route(RouteRequest::new("probe-2", 256).with_block_hashes(hashes))
        .await
        .unwrap();
    assert_eq!(overlap_of(&decision, w(6)), None, "left: not a candidate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_fed_the_same_events_give_the_same_overlaps() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let (a, _) = prefix_router(&conn, "replicas").await;
    let (b, _) = prefix_router(&conn, "replicas").await;
    let mut publisher = RawPublisher::new(conn.client().clone(), "replicas", 1);
    for worker in 0..6u64 {
        for turn in 0..4u32 {
            let shared = 64 * (turn as usize + 1);
            let tokens = prompt(worker as u32 % 3, shared, turn, shared + 40);
            publisher
                .send(admitted_with(
                    &format!("w{worker}-t{turn}"),
                    worker,
                    &tokens,
                ))
                .await;
        }
    }
    publisher.flush().await;
    learned(&a, 24).await;
    learned(&b, 24).await;
    for conversation in 0..3 {
        let tokens = prompt(conversation, 300, 9, 400);
        let request = |id: &str| RouteRequest::new(id, 0).with_token_ids(tokens.clone());
        let da = a.scheduler().route(request("probe-a")).await.unwrap();
        let db = b.scheduler().route(request("probe-b")).await.unwrap();
        assert_eq!(overlaps(&da), overlaps(&db), "conversation {conversation}");
        assert!(da.candidates.iter().any(|c| c.overlap_blocks > 0));
        assert_eq!(da.worker(), db.worker());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prediction_is_compared_with_what_the_engine_reports() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let (router, _) = prefix_router(&conn, "accuracy").await;
    let scheduler = router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "accuracy", 1);
    let tokens = prompt(3, 512, 1, 512);
    publisher.send(admitted_with("first", 4, &tokens)).await;
    publisher.flush().await;
    learned(&router, 1).await;
    let next = prompt(3, 512, 2, 800);
    let decision = scheduler
        .route(RouteRequest::new("second", 0).with_token_ids(next.clone()))
        .await
        .unwrap();
    assert_eq!(
        (decision.worker(), decision.candidates[0].cached_tokens),
        (w(4), 512)
    );
    // The engine found 480 of them (it evicted a block meanwhile, say).
    publisher
        .send(Admitted {
            cached_tokens: Some(480),
            ..admitted_with("second", 4, &next)
        })
        .await;
    publisher.flush().await;
    assert!(
        eventually(BOUND, || async {
            scheduler.prefix_figures().compared_admissions == 1
        })
        .await
    );
    let f = scheduler.prefix_figures();
    let compared = (f.predicted_cached_tokens, f.reported_cached_tokens);
    assert_eq!(compared, (512, 480), "{f:?}");
    assert_eq!((f.overpredicted_tokens, f.underpredicted_tokens), (32, 0));
    // An admission no decision of this replica made is not compared.
    publisher
        .send(Admitted {
            cached_tokens: Some(100),
            ..admitted_with("elsewhere", 4, &tokens)
        })
        .await;
    publisher.flush().await;
    learned(&router, 4).await;
    assert_eq!(scheduler.prefix_figures().compared_admissions, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_prefix_input_is_refused_or_dropped_and_counted() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let (router, stats) = prefix_router(&conn, "bad-prefix").await;
    let scheduler = router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "bad-prefix", 1);
    publisher.send(admitted("live", 1, 100)).await;
    // Too many hashes, and hashes of the wrong type: each event dropped as undecodable.
    let too_many = Admitted {
        block_hashes: (0..MAX_BLOCK_HASHES as u64 + 1).collect(),
        ..admitted("too-many", 1, 8192)
    };
    publisher.send(too_many).await;
    let wrong_type = Mp::default()
        .map(10)
        .str("v")
        .uint(1)
        .str("pub")
        .uint(1)
        .str("seq")
        .uint(publisher.next_seq)
        .str("ts")
        .uint(1)
        .str("kind")
        .str("admitted")
        .str("rid")
        .str("strings")
        .str("wid")
        .uint(1)
        .str("dp")
        .uint(0)
        .str("ptok")
        .uint(8)
        .str("blk")
        .bytes(&[0x91, 0xa1, b'x']);
    publisher.next_seq += 1;
    publisher
        .send_bytes(publisher.subjects.worker_subject(1), wrong_type.0)
        .await;
    publisher.flush().await;
    assert!(
        eventually(BOUND, || async {
            stats.snapshot().dropped(DropReason::Decode) == 2
        })
        .await,
        "{:?}",
        stats.snapshot()
    );
    assert_eq!(scheduler.prefix_figures().entries, 0);
    assert_eq!(live_ids(&router).len(), 1, "the consumer goes on");

    let invalid = |request: RouteRequest| {
        let scheduler = scheduler.clone();
        async move {
            match scheduler.route(request).await {
                Err(RouteRequestError::InvalidRequest(why)) => why,
                other => panic!("{other:?}"),
            }
        }
    };
    let both = RouteRequest::new("both", 0)
        .with_token_ids(vec![1; 32])
        .with_block_hashes(vec![1, 2]);
    assert!(invalid(both).await.contains("not both"));
    let longer = RouteRequest::new("longer", 16).with_block_hashes(vec![1, 2]);
    assert!(invalid(longer).await.contains("full blocks"));
    let mut mismatched = RouteRequest::new("mismatch", 0).with_token_ids(vec![1; 32]);
    mismatched.prompt_tokens = 31;
    assert!(invalid(mismatched).await.contains("token_ids holds 32"));
    let many = RouteRequest::new("many", u32::MAX).with_block_hashes(vec![
        7;
        lease_router::MAX_ROUTE_BLOCK_HASHES
            + 1
    ]);
    assert!(invalid(many).await.contains("at most"));
    assert!(
        invalid(RouteRequest::new("empty", 0).with_token_ids(Vec::new()))
            .await
            .contains("at least 1")
    );
}

/// A worker whose engine's KV events are relayed (wire 1.3) is exact: its first KV event
/// replaces what `admitted` taught, decisions no longer teach it, an eviction shortens its
/// overlap from the evicted block on, and a clear empties it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_kv_events_are_the_truth_for_the_workers_that_send_them() {
    use lease_router::wire::{KvCleared, KvRemoved, KvStored};
    let server = server().await;
    let conn = client(&server.url()).await;
    let (router, stats) = prefix_router(&conn, "exact").await;
    let scheduler = router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "exact", 1);

    let learned_prompt = prompt(1, 512, 1, 512);
    publisher.send(admitted_with("a", 1, &learned_prompt)).await;
    publisher.flush().await;
    learned(&router, 1).await;
    assert_eq!(scheduler.prefix_figures().entries, 32);

    // The engine stored another prompt's 8 blocks, in two chains (the second's parent the
    // first's last block).
    let engine_prompt = prompt(2, 128, 2, 128);
    let hashes = block_hashes(&engine_prompt, 16);
    publisher
        .send(KvStored {
            worker_id: 1,
            dp_rank: 0,
            parent_hash: None,
            block_hashes: hashes[..5].to_vec(),
        })
        .await;
    publisher
        .send(KvStored {
            worker_id: 1,
            dp_rank: 0,
            parent_hash: Some(hashes[4]),
            block_hashes: hashes[5..].to_vec(),
        })
        .await;
    publisher.flush().await;
    assert!(
        eventually(BOUND, || async {
            scheduler.prefix_figures().kv_stored_blocks == 8
        })
        .await
    );
    let figures = scheduler.prefix_figures();
    assert_eq!(
        (figures.entries, figures.exact_workers),
        (8, 1),
        "{figures:?}"
    );
    let overlap = |id: &'static str, hashes: Vec<u64>| {
        let scheduler = scheduler.clone();
        async move {
            let decision = scheduler
                .route(RouteRequest::new(id, 16 * hashes.len() as u32).with_block_hashes(hashes))
                .await
                .unwrap();
            overlap_of(&decision, w(1))
        }
    };
    assert_eq!(
        overlap("x1", block_hashes(&learned_prompt, 16)).await,
        Some(0)
    );
    assert_eq!(overlap("x2", hashes.clone()).await, Some(8));
    // That decision booked a longer prompt on worker 1: not learned for an exact rank.
    let longer = block_hashes(&prompt(2, 128, 9, 256), 16);
    assert_eq!(overlap("x3", longer.clone()).await, Some(8));
    assert_eq!(overlap("x4", longer).await, Some(8));

    // The engine evicted block 3: the overlap ends before it.
    publisher
        .send(KvRemoved {
            worker_id: 1,
            dp_rank: 0,
            block_hashes: vec![hashes[3]],
        })
        .await;
    publisher.flush().await;
    assert!(
        eventually(BOUND, || async {
            scheduler.prefix_figures().kv_removed_blocks == 1
        })
        .await
    );
    assert_eq!(overlap("x5", hashes.clone()).await, Some(3));

    // An `admitted` of an exact rank teaches nothing; a clear empties the rank.
    publisher.send(admitted_with("b", 1, &learned_prompt)).await;
    publisher
        .send(KvCleared {
            worker_id: 1,
            dp_rank: None,
        })
        .await;
    publisher.flush().await;
    assert!(
        eventually(BOUND, || async {
            scheduler.prefix_figures().kv_clears == 1
        })
        .await
    );
    assert_eq!(overlap("x6", hashes).await, Some(0));
    assert_eq!(
        overlap("x7", block_hashes(&learned_prompt, 16)).await,
        Some(0)
    );
    let figures = scheduler.prefix_figures();
    assert_eq!(
        (figures.entries, figures.exact_workers),
        (0, 1),
        "{figures:?}"
    );
    assert_eq!(stats.snapshot().dropped_total(), 0);
}
