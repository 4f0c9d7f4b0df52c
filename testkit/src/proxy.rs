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

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(5);

    /// An upstream that hands each accepted connection to the test.
    async fn upstream() -> (SocketAddr, mpsc::Receiver<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                if tx.send(stream).await.is_err() {
                    return;
                }
            }
        });
        (addr, rx)
    }

    async fn read_exact(stream: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        tokio::time::timeout(BOUND, stream.read_exact(&mut buf))
            .await
            .expect("in time")
            .expect("read");
        buf
    }

    #[tokio::test]
    async fn forwards_holds_while_partitioned_and_closes_on_drop() {
        let (addr, mut accepted) = upstream().await;
        let proxy = TcpProxy::start(addr).await.unwrap();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut server = tokio::time::timeout(BOUND, accepted.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read_exact(&mut server, 4).await, b"ping");
        server.write_all(b"pong").await.unwrap();
        assert_eq!(read_exact(&mut client, 4).await, b"pong");

        // Partitioned: what is sent waits, in order, and arrives once healed.
        proxy.set_partitioned(true);
        client.write_all(b"held").await.unwrap();
        let mut byte = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(200), server.read(&mut byte)).await;
        assert!(early.is_err(), "nothing passes a partition: {early:?}");
        proxy.set_partitioned(false);
        assert_eq!(read_exact(&mut server, 4).await, b"held");

        // A delay shifts the stream, it does not lose or reorder it.
        proxy.set_upstream_delay(Duration::from_millis(50));
        client.write_all(b"late").await.unwrap();
        assert_eq!(read_exact(&mut server, 4).await, b"late");

        // Dropping the proxy ends its tasks: both ends see the connection close.
        drop(proxy);
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(BOUND, client.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
        let closed = tokio::time::timeout(BOUND, server.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    }
}
