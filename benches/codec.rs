//! Decode and encode of each event kind (`cargo bench --bench codec`).

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lease_router::wire::{
    self, Admitted, Completed, Envelope, LeaseEvent, Outcome, ProgressStage, Progressed,
    WorkerReset, DEFAULT_MAX_EVENT_BYTES,
};

/// One realistic envelope of each kind: a 36-character request id, a 64-bit publisher id,
/// a current timestamp.
fn samples() -> Vec<(&'static str, Envelope)> {
    let rid = common::uuid_like(7, 42);
    let event = |kind: &'static str, seq: u64, event: LeaseEvent| {
        (
            kind,
            Envelope::new(0x9c3a_51f2_77e0_1d4b, seq, wire::unix_micros_now(), event),
        )
    };
    vec![
        event(
            "admitted",
            1,
            Admitted {
                block_hashes: Vec::new(),
                block_capacity: None,
                class: None,
                request_id: rid.clone(),
                worker_id: 17,
                dp_rank: 3,
                prompt_tokens: 2048,
                expected_output_tokens: Some(512),
                cached_tokens: None,
            }
            .into(),
        ),
        event(
            "progressed",
            2,
            Progressed {
                request_id: rid.clone(),
                worker_id: 17,
                dp_rank: 3,
                stage: ProgressStage::Decoding,
                output_tokens: 128,
            }
            .into(),
        ),
        event(
            "completed",
            3,
            Completed {
                request_id: rid,
                worker_id: 17,
                dp_rank: 3,
                outcome: Outcome::Finished,
            }
            .into(),
        ),
        event(
            "worker_reset",
            4,
            WorkerReset {
                worker_id: 17,
                dp_rank: None,
                leaving: false,
            }
            .into(),
        ),
    ]
}

fn codec(c: &mut Criterion) {
    let samples = samples();
    let mut decode = c.benchmark_group("decode");
    decode.throughput(Throughput::Elements(1));
    for (kind, envelope) in &samples {
        let bytes = wire::encode(envelope).expect("encodes");
        decode.bench_function(*kind, |b| {
            b.iter(|| wire::decode(black_box(&bytes), DEFAULT_MAX_EVENT_BYTES).unwrap())
        });
    }
    decode.finish();

    let mut encode = c.benchmark_group("encode");
    encode.throughput(Throughput::Elements(1));
    for (kind, envelope) in &samples {
        // encode_into a reused buffer: what a publisher's hot loop does.
        let mut buf = Vec::with_capacity(128);
        encode.bench_function(*kind, |b| {
            b.iter(|| {
                buf.clear();
                wire::encode_into(black_box(envelope), &mut buf).unwrap();
                black_box(buf.len())
            })
        });
    }
    encode.finish();

    for (kind, envelope) in &samples {
        println!(
            "event size: {kind} = {} bytes",
            wire::encode(envelope).unwrap().len()
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = codec
}
criterion_main!(benches);
