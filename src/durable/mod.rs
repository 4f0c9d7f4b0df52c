//! Durable mode on JetStream: lease events are kept in a stream, so a router replica that
//! starts (or restarts) late first replays what it missed and then follows live events.
//!
//! - [`stream`]: the stream over the subject prefix, created or updated idempotently.
//! - `publish`: the JetStream sink behind [`crate::publisher::LeasePublisher::start_durable`].
//! - [`ingress`]: the durable ingress: one ordered consumer that replays the deployment's
//!   subjects and then keeps following them, so there is no seam between catch-up and live
//!   events; recreated from the last applied stream sequence when it is lost.

mod ingress;
pub(crate) mod publish;
mod stream;

pub use ingress::{CatchUpState, JetStreamIngress, StartDurableIngressError};
pub use stream::{
    ensure_stream, require_stream, stream_name, EnsureStreamError, LeaseStreamConfig,
};
