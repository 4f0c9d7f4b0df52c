//! The durable side of [`crate::publisher::LeasePublisher`]: JetStream publishes with
//! acknowledgements, a bounded number in flight.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishAckFuture};
use async_nats::{Client, HeaderMap, Subject};
use bytes::Bytes;
use parking_lot::Mutex;
use tracing::warn;

use super::task::EnvelopeSink;
use super::{LeasePublisher, PublisherConfig};
use crate::retry::{Attempt, RetryPolicy};
use crate::subject::Subjects;

impl LeasePublisher {
    /// A durable publisher: events go to the JetStream lease stream (which must exist, see
    /// [`crate::ensure_stream`]) with `Nats-Msg-Id` = publisher id and sequence, so
    /// a retried publish is stored once; up to `max_in_flight` acknowledgements are awaited
    /// at a time, and [`flush`](LeasePublisher::flush) waits for all of them.
    pub fn start_durable(
        client: Client,
        subjects: Subjects,
        config: PublisherConfig,
        max_in_flight: usize,
    ) -> LeasePublisher {
        let sink = JetStreamSink::new(client, max_in_flight);
        Self::start_with_sink(sink, subjects, config)
    }
}

/// How long one acknowledgement may take before the event is re-sent.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Re-sends of one event whose acknowledgement failed, before it is given up.
const MAX_RESENDS: usize = 10;

/// A published event whose acknowledgement is outstanding, with what it takes to re-send it.
struct InFlight {
    subject: Subject,
    payload: Bytes,
    msg_id: String,
    ack: Option<PublishAckFuture>,
}

pub(crate) struct JetStreamSink {
    js: jetstream::Context,
    client: Client,
    in_flight: Arc<Mutex<VecDeque<InFlight>>>,
    max_in_flight: usize,
}

impl JetStreamSink {
    pub(crate) fn new(client: Client, max_in_flight: usize) -> Self {
        Self {
            js: jetstream::new(client.clone()),
            client,
            in_flight: Arc::default(),
            max_in_flight: max_in_flight.max(1),
        }
    }
}

fn headers(msg_id: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    headers
}

/// Waits for one acknowledgement; re-sends the event (same `Nats-Msg-Id`, so the stream
/// keeps one copy) with backoff until it is stored or the re-sends run out.
async fn settle(js: &jetstream::Context, mut entry: InFlight) -> Result<(), String> {
    let mut backoff = RetryPolicy::default()
        .with_initial(Duration::from_millis(50))
        .with_max_interval(Duration::from_secs(2))
        .backoff();
    let mut last_error = String::from("not sent");
    for attempt in 0..=MAX_RESENDS {
        if let Some(ack) = entry.ack.take() {
            match tokio::time::timeout(ACK_TIMEOUT, ack).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last_error = e.to_string(),
                Err(_) => last_error = "acknowledgement timed out".into(),
            }
        }
        if attempt > 0 {
            tokio::time::sleep(backoff.next_delay()).await;
        }
        entry.ack = match js
            .publish_with_headers(
                entry.subject.clone(),
                headers(&entry.msg_id),
                entry.payload.clone(),
            )
            .await
        {
            Ok(ack) => Some(ack),
            Err(e) => {
                last_error = e.to_string();
                None
            }
        };
    }
    warn!(msg_id = %entry.msg_id, error = %last_error, "durable publish never acknowledged; giving up");
    Err(last_error)
}

impl EnvelopeSink for JetStreamSink {
    fn send(
        &mut self,
        subject: &Subject,
        payload: Bytes,
        msg_id: &str,
    ) -> impl Future<Output = Result<(), Attempt<String>>> + Send {
        let js = self.js.clone();
        let in_flight = self.in_flight.clone();
        let max = self.max_in_flight;
        let subject = subject.clone();
        let msg_id = msg_id.to_string();
        async move {
            let ack = js
                .publish_with_headers(subject.clone(), headers(&msg_id), payload.clone())
                .await
                .map_err(|e| Attempt::Transient(e.to_string()))?;
            let oldest = {
                let mut queue = in_flight.lock();
                queue.push_back(InFlight {
                    subject,
                    payload,
                    msg_id,
                    ack: Some(ack),
                });
                if queue.len() > max {
                    queue.pop_front()
                } else {
                    None
                }
            };
            if let Some(oldest) = oldest {
                // A window of acknowledgements: the oldest must be stored before more go out.
                // Its failure is logged in `settle`; this event itself was sent.
                let _ = settle(&js, oldest).await;
            }
            Ok(())
        }
    }

    fn flush(&self) -> impl Future<Output = Result<(), String>> + Send + 'static {
        let pending: Vec<InFlight> = self.in_flight.lock().drain(..).collect();
        let js = self.js.clone();
        let client = self.client.clone();
        async move {
            let mut failed = 0usize;
            for entry in pending {
                if settle(&js, entry).await.is_err() {
                    failed += 1;
                }
            }
            client.flush().await.map_err(|e| e.to_string())?;
            if failed > 0 {
                return Err(format!(
                    "{failed} durable publishes were never acknowledged"
                ));
            }
            Ok(())
        }
    }
}
