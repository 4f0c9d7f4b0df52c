//! What the binary's end-to-end tests share: the command without the caller's settings, a
//! child process whose output is collected (killed on drop), and a minimal HTTP client.

#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_lease-router");

/// The binary, with none of the caller's settings leaking in (every `LEASE_ROUTER_*` and
/// `NATS_*` variable removed).
pub fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("RUST_LOG", "info").stdin(Stdio::null());
    for (key, _) in std::env::vars() {
        if key.starts_with("LEASE_ROUTER_") || key.starts_with("NATS_") {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// A running child whose output is collected by threads; killed on drop.
pub struct Proc {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    status: Option<ExitStatus>,
}

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        collect(child.stdout.take().unwrap(), stdout.clone());
        collect(child.stderr.take().unwrap(), stderr.clone());
        Proc {
            child,
            stdout,
            stderr,
            status: None,
        }
    }

    /// A child whose stdout the caller reads itself (piped, taken): only its stderr (piped)
    /// is collected here.
    pub fn adopt(mut child: Child) -> Proc {
        let stderr = Arc::new(Mutex::new(String::new()));
        collect(child.stderr.take().expect("stderr piped"), stderr.clone());
        Proc {
            child,
            stdout: Arc::default(),
            stderr,
            status: None,
        }
    }

    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The exit status, waiting at most `bound`; also collects the rest of the output.
    pub fn wait(&mut self, bound: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(status) = self.status {
                return Some(status);
            }
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                self.status = Some(status);
                // Let the reader threads take the last output.
                thread::sleep(Duration::from_millis(100));
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name} failed");
    }

    /// Waits for a stdout line starting with `prefix` and returns the rest of it.
    pub fn wait_for_line(&mut self, prefix: &str, bound: Duration) -> String {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(rest) = self
                .stdout()
                .lines()
                .find_map(|line| line.strip_prefix(prefix).map(str::to_owned))
            {
                return rest;
            }
            if let Some(status) = self.wait(Duration::ZERO) {
                panic!(
                    "exited ({status}) before printing {prefix:?}\nstdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no line {prefix:?} within {bound:?}\nstdout:\n{}\nstderr:\n{}",
                self.stdout(),
                self.stderr()
            );
            thread::sleep(Duration::from_millis(25));
        }
    }

    /// SIGTERM, then exit code 0 within `bound`; returns what it wrote to stderr.
    pub fn terminate(mut self, bound: Duration) -> String {
        self.signal("TERM");
        let status = self
            .wait(bound)
            .unwrap_or_else(|| panic!("no exit within {bound:?}\n{}", self.stderr()));
        assert_eq!(status.code(), Some(0), "{}", self.stderr());
        self.stderr()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn collect(stream: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        while matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
            into.lock().unwrap().push_str(&line);
            line.clear();
        }
    });
}

/// A minimal HTTP/1.1 client: one request per connection. Returns the status and the body.
pub fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    http_with(addr, method, path, "")
}

/// [`http`] with more header lines (each ending in `\r\n`).
pub fn http_with(addr: SocketAddr, method: &str, path: &str, headers: &str) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\
         {headers}\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read the answer");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (status, body)
}

pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}
