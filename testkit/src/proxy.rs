//! [`TcpProxy`]: a loopback TCP forwarder put between a client and a `nats-server`, to make
//! the network misbehave on purpose: a delay on the way to the server (a server slow to read
//! one connection), or a silent partition (nothing passes either way, nothing is closed: the
//! client learns of it only from its own pings).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;

/// What the forwarding tasks read before each chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Faults {
    /// Each chunk from the client reaches the server this much later.
    upstream_delay: Duration,
    /// Nothing is forwarded, either way, and no new connection reaches the server.
    partitioned: bool,
}

/// A forwarder from a free loopback port to `upstream`, one pair of tasks per connection.
///
/// Dropping it ends every task (aborted, never waited for) and so closes every connection.
pub struct TcpProxy {
    addr: SocketAddr,
    faults: watch::Sender<Faults>,
    accept: AbortHandle,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl TcpProxy {
    /// Listens on `127.0.0.1:0` and forwards each connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (faults, _) = watch::channel(Faults::default());
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let watch = faults.clone();
        let conns = Arc::clone(&connections);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let faults = watch.subscribe();
                conns
                    .lock()
                    .spawn(forward_connection(client, upstream, faults));
            }
        })
        .abort_handle();
        Ok(Self {
            addr,
            faults,
            accept,
            connections,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `nats://` URL of [`TcpProxy::addr`].
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// From now on each chunk a client sends reaches the server `delay` later (in order).
    pub fn set_upstream_delay(&self, delay: Duration) {
        self.faults.send_modify(|f| f.upstream_delay = delay);
    }

    /// Starts (`true`) or heals (`false`) a silent partition: while it lasts nothing passes
    /// either way and new connections are accepted but reach nothing; nothing is closed.
    pub fn set_partitioned(&self, partitioned: bool) {
        self.faults.send_modify(|f| f.partitioned = partitioned);
    }

    /// Closes every connection made so far (as a crashed middlebox would); new ones are
    /// forwarded as before.
    pub fn cut_connections(&self) {
        self.connections.lock().abort_all();
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.connections.lock().abort_all();
    }
}

async fn forward_connection(
    client: TcpStream,
    upstream: SocketAddr,
    mut faults: watch::Receiver<Faults>,
) {
    // A partition holds a new connection before it reaches the server, as a lost SYN would.
    if faults.wait_for(|f| !f.partitioned).await.is_err() {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, faults.clone(), true);
    let down = pump(server_read, client_write, faults, false);
    // Either side closing ends both.
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// Copies `from` to `to`, holding while partitioned and, upstream, delaying each chunk.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    faults: watch::Receiver<Faults>,
    upstream: bool,
) {
    // A reader that stamps chunks and a writer that sends each at its time: the delay
    // shifts the stream without slowing it.
    let (chunks, mut due) = mpsc::channel::<(Instant, Vec<u8>)>(1024);
    let mut read_faults = faults.clone();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if read_faults.wait_for(|f| !f.partitioned).await.is_err() {
                return;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let delay = if upstream {
                read_faults.borrow().upstream_delay
            } else {
                Duration::ZERO
            };
            if chunks
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .await
                .is_err()
            {
                return;
            }
        }
    };
    let mut write_faults = faults;
    let writer = async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            // Read before the partition began, held until it heals.
            if write_faults.wait_for(|f| !f.partitioned).await.is_err() {
                return;
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    // The client's last bytes still reach the server after it closed its side.
    let mut reader = std::pin::pin!(reader);
    let mut writer = std::pin::pin!(writer);
    tokio::select! {
        _ = &mut reader => writer.await,
        _ = &mut writer => {}
    }
}
