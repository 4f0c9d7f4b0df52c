//! TLS to NATS end to end: a server with a certificate from a CA made here, a router that
//! trusts that CA gets in; one that does not is refused with an error that says why.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use lease_router::{connect, NatsConnectConfig, NatsTls};
use lease_router_testkit::NatsServerBuilder;

fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl is installed (.ci/run installs it)");
    assert!(status.success(), "openssl {args:?}");
}

/// A CA, and a server certificate for 127.0.0.1 signed by it.
/// A CA key and self-signed certificate, valid for two days.
fn self_signed_ca(dir: &Path, key: &str, pem: &str, subject: &str) {
    openssl(
        dir,
        &[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", pem, "-days",
            "2", "-subj", subject,
        ],
    );
}

fn make_certificates(dir: &Path) {
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    self_signed_ca(dir, "ca.key", "ca.pem", "/CN=lease-router test CA");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ],
    );
    self_signed_ca(dir, "other.key", "other-ca.pem", "/CN=some other CA");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_server_accepts_a_router_that_trusts_its_ca_and_refuses_one_that_does_not() {
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    make_certificates(dir.path());
    let conf = dir.path().join("tls.conf");
    std::fs::write(
        &conf,
        format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n}}\n",
            dir.path().join("server.pem").display(),
            dir.path().join("server.key").display()
        ),
    )
    .unwrap();
    let server = NatsServerBuilder::new()
        .config_file(&conf)
        .spawn()
        .await
        .expect("nats-server with TLS");
    let url = format!("tls://127.0.0.1:{}", server.port());
    let tls = |ca: &str| NatsTls {
        ca_file: Some(dir.path().join(ca)),
        ..NatsTls::default()
    };

    let trusted = NatsConnectConfig::new([url.clone()])
        .with_connect_deadline(Duration::from_secs(5))
        .with_tls(tls("ca.pem"));
    let conn = connect(&trusted).await.expect("the server's CA is trusted");
    conn.client()
        .publish("leases.tls.1", "x".into())
        .await
        .unwrap();
    conn.client().flush().await.unwrap();

    let untrusted = NatsConnectConfig::new([url])
        .with_connect_deadline(Duration::from_secs(2))
        .with_tls(tls("other-ca.pem"));
    let err = connect(&untrusted)
        .await
        .expect_err("another CA signed the server");
    let message = err.to_string();
    assert!(
        message.to_lowercase().contains("tls") || message.contains("certificate"),
        "{message}"
    );
}
