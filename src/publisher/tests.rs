use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::future::Future;

use async_nats::Subject;
use bytes::Bytes;

use super::task::*;
use super::*;
use crate::retry::Attempt;
use crate::subject::{DeploymentName, SubjectPrefix};
use crate::wire::{self, Envelope};
use std::collections::VecDeque;
use tokio::sync::Semaphore;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

/// A sink that records what it is sent; fails on script; can be held shut.
#[derive(Clone, Default)]
struct MockSink {
    sent: Arc<Mutex<Vec<(String, Bytes)>>>,
    /// The message id of each send that succeeded, in order.
    msg_ids: Arc<Mutex<Vec<String>>>,
    /// Results of the next sends (then Ok).
    script: Arc<Mutex<VecDeque<Attempt<String>>>>,
    /// Each send takes a permit when set (none: the sink stalls).
    gate: Option<Arc<Semaphore>>,
    flushes: Arc<AtomicU64>,
    dropped: Option<Arc<AtomicBool>>,
}

struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

struct Sink {
    mock: MockSink,
    _flag: Option<DropFlag>,
}

impl EnvelopeSink for Sink {
    fn send(
        &mut self,
        subject: &Subject,
        payload: Bytes,
        msg_id: &str,
    ) -> impl Future<Output = Result<(), Attempt<String>>> + Send {
        let mock = self.mock.clone();
        let subject = subject.to_string();
        let msg_id = msg_id.to_string();
        async move {
            if let Some(gate) = &mock.gate {
                gate.acquire().await.unwrap().forget();
            }
            if let Some(failure) = mock.script.lock().pop_front() {
                return Err(failure);
            }
            mock.sent.lock().push((subject, payload));
            mock.msg_ids.lock().push(msg_id);
            Ok(())
        }
    }

    fn flush(&self) -> impl Future<Output = Result<(), String>> + Send + 'static {
        let flushes = self.mock.flushes.clone();
        async move {
            flushes.fetch_add(1, Ordering::AcqRel);
            Ok(())
        }
    }
}

fn subjects() -> Subjects {
    Subjects::new(
        SubjectPrefix::new("t").unwrap(),
        DeploymentName::new("dep").unwrap(),
    )
}

fn start(mock: &MockSink, config: PublisherConfig) -> LeasePublisher {
    let sink = Sink {
        mock: mock.clone(),
        _flag: mock.dropped.clone().map(DropFlag),
    };
    LeasePublisher::start_with_sink(sink, subjects(), config)
}

fn fast_retry() -> PublisherConfig {
    PublisherConfig::default().with_retry(
        RetryPolicy::new()
            .with_initial(Duration::from_millis(10))
            .with_max_interval(Duration::from_millis(40))
            .with_randomization(0.0),
    )
}

fn decoded(sent: &[(String, Bytes)]) -> Vec<(String, Envelope)> {
    sent.iter()
        .map(|(s, p)| (s.clone(), wire::decode(p, 4096).unwrap()))
        .collect()
}

/// Each sent message as its events: one for a plain message, several for a batch.
fn messages(sent: &[(String, Bytes)]) -> Vec<(String, Vec<Envelope>)> {
    sent.iter()
        .map(|(subject, payload)| {
            let events = match wire::decode_message(payload, wire::MessageLimits::default()) {
                wire::Message::Event(event) => vec![event.unwrap()],
                wire::Message::Batch(events) => events.map(Result::unwrap).collect(),
                wire::Message::Refused { error, .. } => panic!("{error}"),
            };
            (subject.clone(), events)
        })
        .collect()
}

fn batching(linger: Duration, max_events: usize, max_bytes: usize) -> PublisherConfig {
    PublisherConfig::default().with_batching(Batching {
        linger,
        max_events,
        max_bytes,
    })
}

const LONG: Duration = Duration::from_secs(3600);

#[tokio::test]
async fn batches_hold_one_subjects_events_up_to_the_event_bound() {
    let mock = MockSink::default();
    let publisher = start(&mock, batching(LONG, 4, 64 * 1024));
    for i in 0..10u32 {
        publisher.admitted(format!("r{i}"), 1, 0, i, None).unwrap();
        if i < 3 {
            publisher
                .completed(format!("r{i}"), 2, 0, Outcome::Finished)
                .unwrap();
        }
    }
    timeout(WAIT, publisher.flush()).await.unwrap().unwrap();
    let sent = messages(&mock.sent.lock());
    let sizes: Vec<_> = sent.iter().map(|(s, e)| (s.as_str(), e.len())).collect();
    // Full batches as they fill, the rest at the flush, oldest first.
    assert_eq!(
        sizes,
        [
            ("t.dep.1", 4),
            ("t.dep.1", 4),
            ("t.dep.2", 3),
            ("t.dep.1", 2)
        ]
    );
    let mut sequences = Vec::new();
    for ((subject, events), msg_id) in sent.iter().zip(mock.msg_ids.lock().iter()) {
        for event in events {
            assert_eq!(*subject, format!("t.dep.{}", event.event.worker_id()));
            assert_eq!(event.publisher_id, publisher.publisher_id());
        }
        let (first, last) = (events[0].sequence, events.last().unwrap().sequence);
        assert!(events.windows(2).all(|w| w[0].sequence < w[1].sequence));
        assert_eq!(
            *msg_id,
            format!("{}-{first}-{last}", publisher.publisher_id())
        );
        sequences.extend(events.iter().map(|e| e.sequence));
    }
    sequences.sort_unstable();
    assert_eq!(sequences, (1..=13).collect::<Vec<_>>(), "each number once");
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!(
        (stats.published, stats.batches, stats.pending()),
        (13, 4, 0)
    );
}

#[tokio::test]
async fn batches_stay_within_the_byte_bound() {
    let mock = MockSink::default();
    let publisher = start(&mock, batching(LONG, 256, 400));
    for i in 0..50u32 {
        publisher
            .admitted(format!("request-{i}"), 1, 0, i, None)
            .unwrap();
    }
    timeout(WAIT, publisher.flush()).await.unwrap().unwrap();
    let sent = mock.sent.lock().clone();
    assert!(sent.len() > 1);
    assert!(
        sent.iter().all(|(_, payload)| payload.len() <= 400),
        "{sent:?}"
    );
    assert!(
        sent.iter().any(|(_, payload)| payload.len() > 300),
        "batches fill up"
    );
    let events: usize = messages(&sent).iter().map(|(_, e)| e.len()).sum();
    assert_eq!(events, 50);
}

#[tokio::test(start_paused = true)]
async fn the_linger_sends_what_waits_and_one_event_goes_plain() {
    let mock = MockSink::default();
    let publisher = start(&mock, batching(Duration::from_millis(5), 256, 64 * 1024));
    publisher.admitted("a", 1, 0, 1, None).unwrap();
    publisher.admitted("b", 1, 0, 1, None).unwrap();
    publisher.admitted("c", 2, 0, 1, None).unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await;
    assert!(mock.sent.lock().is_empty(), "the linger is not over");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let sent = mock.sent.lock().clone();
    let sizes: Vec<_> = messages(&sent)
        .iter()
        .map(|(s, e)| (s.clone(), e.len()))
        .collect();
    assert_eq!(
        sizes,
        [("t.dep.1".to_string(), 2), ("t.dep.2".to_string(), 1)]
    );
    // The lone event is a plain 1.0 message, under a single event's id.
    assert!(matches!(
        wire::decode_message(&sent[1].1, wire::MessageLimits::default()),
        wire::Message::Event(Ok(_))
    ));
    assert_eq!(
        mock.msg_ids.lock()[1],
        format!("{}-3", publisher.publisher_id())
    );
    assert_eq!(
        mock.flushes.load(Ordering::Acquire),
        0,
        "no flush was asked"
    );
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!((stats.published, stats.batches), (3, 1));
}

#[tokio::test]
async fn too_many_open_events_send_every_batch() {
    let mock = MockSink::default();
    let publisher = start(&mock, batching(LONG, 256, 64 * 1024));
    let workers = MAX_OPEN_BATCH_EVENTS as u64 / 2;
    for i in 0..2 * workers {
        publisher
            .admitted(format!("r{i}"), i % workers, 0, 1, None)
            .unwrap();
    }
    // No flush, and the linger is an hour: only the bound on open events sends them.
    let all_sent = async {
        while mock.sent.lock().len() < workers as usize {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    timeout(WAIT, all_sent).await.expect("sent without a flush");
    let sent = messages(&mock.sent.lock());
    assert!(sent.iter().all(|(_, events)| events.len() == 2));
    let first: Vec<_> = sent.iter().map(|(_, e)| e[0].sequence).collect();
    assert!(first.windows(2).all(|w| w[0] < w[1]), "oldest batch first");
    publisher.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_batch_fails_each_of_its_events() {
    let mock = MockSink::default();
    mock.script
        .lock()
        .push_back(Attempt::Permanent("too big".to_string()));
    let publisher = start(&mock, batching(LONG, 3, 64 * 1024));
    for i in 0..5u32 {
        publisher.admitted(format!("r{i}"), 1, 0, i, None).unwrap();
    }
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!((stats.failed, stats.published, stats.batches), (3, 2, 1));
    assert_eq!(stats.pending(), 0);
}

#[tokio::test]
async fn stamps_in_order_on_the_worker_subject() {
    let mock = MockSink::default();
    let publisher = start(&mock, PublisherConfig::default());
    for i in 0..100u32 {
        let worker = u64::from(i % 3);
        publisher
            .admitted(format!("r{i}"), worker, 1, i, None)
            .unwrap();
    }
    publisher.worker_reset(7, None).unwrap();
    timeout(WAIT, publisher.flush()).await.unwrap().unwrap();
    let sent = decoded(&mock.sent.lock());
    assert_eq!(sent.len(), 101);
    for (i, (subject, env)) in sent.iter().enumerate() {
        assert_eq!(env.sequence, i as u64 + 1);
        assert_eq!(env.publisher_id, publisher.publisher_id());
        assert_eq!(*subject, format!("t.dep.{}", env.event.worker_id()));
    }
    assert_eq!(mock.flushes.load(Ordering::Acquire), 1);
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!(stats.queued, 101);
    assert_eq!(stats.published, 101);
    assert_eq!(stats.pending(), 0);
    assert_eq!(mock.flushes.load(Ordering::Acquire), 2);
}

#[tokio::test(start_paused = true)]
async fn transient_failures_are_retried() {
    let mock = MockSink::default();
    mock.script.lock().extend([
        Attempt::Transient("down".to_string()),
        Attempt::Transient("down".to_string()),
    ]);
    let publisher = start(&mock, fast_retry().with_max_publish_attempts(3));
    let started = tokio::time::Instant::now();
    publisher.completed("r1", 1, 0, Outcome::Finished).unwrap();
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!(stats.published, 1);
    assert_eq!(stats.retries, 2);
    assert_eq!(stats.failed, 0);
    // 10 ms then 20 ms of backoff.
    assert_eq!(started.elapsed(), Duration::from_millis(30));
    assert_eq!(mock.sent.lock().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn gives_up_after_max_attempts_and_leaves_a_gap() {
    let mock = MockSink::default();
    mock.script
        .lock()
        .extend((0..3).map(|_| Attempt::Transient("down".to_string())));
    let publisher = start(&mock, fast_retry().with_max_publish_attempts(3));
    publisher.admitted("lost", 1, 0, 10, Some(5)).unwrap();
    publisher.admitted("kept", 1, 0, 10, Some(5)).unwrap();
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!(stats.failed, 1);
    assert_eq!(stats.retries, 2);
    assert_eq!(stats.published, 1);
    assert_eq!(stats.queued, 2);
    let sent = decoded(&mock.sent.lock());
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].1.event.request_id(), Some("kept"));
    assert_eq!(sent[0].1.sequence, 2, "the lost event's sequence is a gap");
}

#[tokio::test(start_paused = true)]
async fn permanent_failures_are_not_retried() {
    let mock = MockSink::default();
    mock.script
        .lock()
        .push_back(Attempt::Permanent("too big".to_string()));
    let publisher = start(&mock, fast_retry());
    publisher.worker_reset(3, Some(1)).unwrap();
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!((stats.failed, stats.retries, stats.published), (1, 0, 0));
}

#[tokio::test]
async fn full_queue_drops_the_newest_and_counts() {
    let gate = Arc::new(Semaphore::new(0));
    let mock = MockSink {
        gate: Some(gate.clone()),
        ..MockSink::default()
    };
    let publisher = start(&mock, PublisherConfig::default().with_queue_capacity(4));
    let mut full = 0u64;
    for i in 0..1_000u32 {
        match publisher.progressed(format!("r{i}"), 1, 0, ProgressStage::Decoding, i) {
            Ok(()) => {}
            Err(PublishEventError::QueueFull) => full += 1,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert!(full >= 1_000 - 4 - 256, "{full} dropped");
    let before = publisher.stats();
    assert_eq!(before.dropped_queue_full, full);
    assert_eq!(before.queued + full, 1_000);
    gate.add_permits(10_000);
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!(stats.published + stats.dropped_queue_full, 1_000);
    assert_eq!(stats.pending(), 0);
    // The survivors are the oldest ones, in order.
    let sent = decoded(&mock.sent.lock());
    for (i, (_, env)) in sent.iter().enumerate() {
        assert_eq!(env.event.request_id(), Some(format!("r{i}").as_str()));
    }
}

#[tokio::test]
async fn flush_waits_for_events_before_it() {
    let gate = Arc::new(Semaphore::new(0));
    let mock = MockSink {
        gate: Some(gate.clone()),
        ..MockSink::default()
    };
    let publisher = start(&mock, PublisherConfig::default());
    for i in 0..10 {
        publisher.admitted(format!("r{i}"), 1, 0, 1, None).unwrap();
    }
    let flush = publisher.flush();
    tokio::pin!(flush);
    assert!(timeout(Duration::from_millis(50), &mut flush)
        .await
        .is_err());
    assert!(mock.sent.lock().len() < 10);
    gate.add_permits(10);
    timeout(WAIT, flush).await.unwrap().unwrap();
    assert_eq!(mock.sent.lock().len(), 10);
}

#[tokio::test]
async fn close_stops_every_handle() {
    let mock = MockSink::default();
    let publisher = start(&mock, PublisherConfig::default());
    let other = publisher.clone();
    other.worker_reset(1, None).unwrap();
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!(stats.published, 1);
    assert_eq!(other.worker_reset(1, None), Err(PublishEventError::Closed));
    assert_eq!(
        timeout(WAIT, other.flush()).await.unwrap(),
        Err(FlushPublisherError::Closed)
    );
    assert_eq!(
        timeout(WAIT, other.close()).await.unwrap(),
        Err(FlushPublisherError::Closed)
    );
}

#[tokio::test]
async fn empty_request_id_is_refused() {
    let mock = MockSink::default();
    let publisher = start(&mock, PublisherConfig::default());
    assert_eq!(
        publisher.admitted("", 1, 0, 1, None),
        Err(PublishEventError::EmptyRequestId)
    );
    let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
    assert_eq!(stats.rejected_invalid, 1);
    assert_eq!(stats.attempted(), 1);
    assert_eq!(stats.queued, 0);
}

#[tokio::test]
async fn dropped_publisher_drains_and_ends() {
    let gate = Arc::new(Semaphore::new(0));
    let ended = Arc::new(AtomicBool::new(false));
    let mock = MockSink {
        gate: Some(gate.clone()),
        dropped: Some(ended.clone()),
        ..MockSink::default()
    };
    let publisher = start(&mock, PublisherConfig::default());
    for i in 0..20 {
        publisher.admitted(format!("r{i}"), 1, 0, 1, None).unwrap();
    }
    let stats = publisher.shared.stats.clone();
    drop(publisher);
    assert!(!ended.load(Ordering::Acquire));
    gate.add_permits(20);
    timeout(WAIT, async {
        while !ended.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the task ends once the queue is drained");
    assert_eq!(mock.sent.lock().len(), 20);
    assert_eq!(stats.snapshot().published, 20);
    assert_eq!(mock.flushes.load(Ordering::Acquire), 1);
}
