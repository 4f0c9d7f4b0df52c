//! The arguments every subcommand reaches NATS with ([`NatsArgs`]): the servers, the subject
//! prefix, authentication, TLS and the ping interval. `serve` holds them among its settings
//! (so they come from flags, environment or its config file, see [`crate::layering`]);
//! `publish`, `simulate` and `demo` flatten `Sourced<NatsArgs>` and take flags and
//! environment alone.
//!
//! # Credentials
//! At most one authentication method: user and password (both), a token, an NKey seed file
//! or a credentials file. Any TLS setting makes TLS required; the client certificate and key
//! go together. Files are checked to be readable when the settings are parsed, and read
//! when connecting. Secrets never appear in `Debug` output, in logs or in errors: a bad
//! password or token is shown as `<redacted>`, a file by its path only. Prefer files or the
//! environment over flags for secrets (flags show in the process list).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lease_router::{NatsAuth, NatsConnectConfig, NatsTls, SubjectPrefix};
use lease_router::{DEFAULT_NATS_URL, DEFAULT_SUBJECT_PREFIX};

use crate::layering::{duration, get, secret, setting, ConfigError, Origins, Parsed, Refusal};
use crate::layering::{Sourced, REDACTED};

/// Four times async-nats' default: a router takes bursts from many workers at once.
pub const DEFAULT_SUBSCRIPTION_CAPACITY: usize = 262_144;

/// Below this, PINGs would be most of an idle connection's traffic.
const MIN_PING_INTERVAL: Duration = Duration::from_millis(100);
/// Above this, a silent partition goes unseen for hours.
const MAX_PING_INTERVAL: Duration = Duration::from_secs(3600);

/// How every subcommand reaches NATS: the servers, the subject prefix, authentication, TLS
/// and the ping interval (flatten `Sourced<NatsArgs>` into a subcommand;
/// [`ServeArgs`](crate::config::ServeArgs) holds it). `Debug` shows whether a password or token was given, never which.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL, or several separated by commas [default: nats://127.0.0.1:4222].
    #[arg(long = "nats-url", value_name = "URLS", env = "NATS_URL",
          value_parser = setting(parse_nats_urls))]
    pub nats_url: Option<Parsed<NatsUrls>>,

    /// First token(s) of every lease subject: {prefix}.{deployment}.{worker_id}
    /// [default: leases].
    #[arg(long = "subject-prefix", value_name = "PREFIX", env = "LEASE_ROUTER_SUBJECT_PREFIX",
          value_parser = setting(|s: &str| SubjectPrefix::new(s.trim()).map_err(|err| format!(
              "one or more tokens separated by '.', each of ASCII letters, digits, '-' and '_' \
               (1 to 128 characters), such as {DEFAULT_SUBJECT_PREFIX} or acme.leases ({})",
              err.setting()))))]
    pub subject_prefix: Option<Parsed<SubjectPrefix>>,

    /// NATS user name; needs --nats-password.
    #[arg(long = "nats-user", value_name = "USER", env = "NATS_USER",
          value_parser = setting(non_empty))]
    pub nats_user: Option<Parsed<String>>,

    /// NATS password (prefer the environment or the config file: flags show in the process
    /// list).
    #[arg(long = "nats-password", value_name = "PASSWORD", env = "NATS_PASSWORD",
          hide_env_values = true, value_parser = secret(|s: &str| non_empty(s).map(Secret)))]
    pub nats_password: Option<Parsed<Secret>>,

    /// NATS authentication token (prefer the environment or the config file).
    #[arg(long = "nats-token", value_name = "TOKEN", env = "NATS_TOKEN", hide_env_values = true,
          value_parser = secret(|s: &str| non_empty(s).map(Secret)))]
    pub nats_token: Option<Parsed<Secret>>,

    /// File holding the NKey seed to authenticate with.
    #[arg(long = "nats-nkey", value_name = "FILE", env = "NATS_NKEY",
          value_parser = setting(readable_file))]
    pub nats_nkey: Option<Parsed<PathBuf>>,

    /// NATS credentials file (user JWT and NKey seed, .creds).
    #[arg(long = "nats-creds", value_name = "FILE", env = "NATS_CREDS",
          value_parser = setting(readable_file))]
    pub nats_creds: Option<Parsed<PathBuf>>,

    /// PEM file of the CAs that sign the NATS server's certificate; makes TLS required.
    #[arg(long = "nats-tls-ca", value_name = "FILE", env = "NATS_TLS_CA",
          value_parser = setting(readable_file))]
    pub nats_tls_ca: Option<Parsed<PathBuf>>,

    /// PEM file of a TLS client certificate (with --nats-tls-key); makes TLS required.
    #[arg(long = "nats-tls-cert", value_name = "FILE", env = "NATS_TLS_CERT",
          value_parser = setting(readable_file))]
    pub nats_tls_cert: Option<Parsed<PathBuf>>,

    /// PEM file of the TLS client certificate's key (with --nats-tls-cert).
    #[arg(long = "nats-tls-key", value_name = "FILE", env = "NATS_TLS_KEY",
          value_parser = setting(readable_file))]
    pub nats_tls_key: Option<Parsed<PathBuf>>,

    /// How often the client PINGs a silent server; a dead connection (a silent partition) is
    /// given up after three intervals without a word, and `/healthz` turns 503
    /// [default: 4s, so within 12s].
    #[arg(long = "nats-ping-interval", value_name = "DURATION",
          env = "LEASE_ROUTER_NATS_PING_INTERVAL", value_parser = setting(duration(
              MIN_PING_INTERVAL..=MAX_PING_INTERVAL,
              "expected a duration from 100ms to 1h, such as 4s (a silent partition is seen \
               within three intervals)")))]
    pub nats_ping_interval: Option<Parsed<Duration>>,
}

/// A secret string: its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

/// NATS server URLs: `Debug` shows them without `user:password@`.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsUrls(pub Vec<String>);

impl fmt::Debug for NatsUrls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let redacted = self.0.iter().map(|url| lease_router::redact_url(url));
        f.debug_list().entries(redacted).finish()
    }
}

impl Sourced<NatsArgs> {
    /// How to connect and the subject prefix, as given (see [`NatsArgs::resolve`]).
    ///
    /// # Errors
    /// [`ConfigError`] naming the URL, prefix or credential setting that is wrong.
    pub fn resolve(&self) -> Result<(NatsConnectConfig, SubjectPrefix), ConfigError> {
        self.args.resolve(&self.origins)
    }
}

impl NatsArgs {
    /// How to connect to NATS (the servers, authentication, TLS, the ping interval) and the
    /// subject prefix; the defaults for what is not given. Secret values never enter an error.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first setting that is wrong.
    pub fn resolve(&self, o: &Origins) -> Result<(NatsConnectConfig, SubjectPrefix), ConfigError> {
        let NatsArgs {
            nats_url,
            subject_prefix,
            nats_user,
            nats_password,
            nats_token,
            nats_nkey,
            nats_creds,
            nats_tls_ca,
            nats_tls_cert,
            nats_tls_key,
            nats_ping_interval,
        } = self;
        let urls = get!(o, nats_url).map_or_else(|| vec![DEFAULT_NATS_URL.to_owned()], |u| u.0);
        // Every subcommand's buffer: `serve --subscription-capacity` sets its own.
        let mut nats =
            NatsConnectConfig::new(urls).with_subscription_capacity(DEFAULT_SUBSCRIPTION_CAPACITY);
        let prefix = get!(o, subject_prefix).unwrap_or_default();

        let mut methods: Vec<(&str, NatsAuth, String)> = Vec::new();
        match (get!(o, nats_user), get!(o, nats_password)) {
            (Some(user), Some(Secret(password))) => methods.push((
                "nats_user",
                NatsAuth::UserPassword { user, password },
                REDACTED.into(),
            )),
            (Some(user), None) => {
                return Err(o.invalid(
                    "nats_user",
                    user,
                    "a user needs a password: give nats_password too",
                ))
            }
            (None, Some(_)) => {
                return Err(o.invalid(
                    "nats_password",
                    REDACTED,
                    "a password needs a user: give nats_user too",
                ))
            }
            (None, None) => {}
        }
        if let Some(Secret(token)) = get!(o, nats_token) {
            methods.push(("nats_token", NatsAuth::Token(token), REDACTED.into()));
        }
        if let Some(path) = get!(o, nats_nkey) {
            let shown = path.display().to_string();
            methods.push(("nats_nkey", NatsAuth::NKeySeedFile(path), shown));
        }
        if let Some(path) = get!(o, nats_creds) {
            let shown = path.display().to_string();
            methods.push(("nats_creds", NatsAuth::CredentialsFile(path), shown));
        }
        if let [(first, ..), (second, _, shown), ..] = methods.as_slice() {
            return Err(o.invalid(
                second,
                shown.clone(),
                format!(
                    "give only one way to authenticate (user and password, token, nkey or creds); \
                 {first} is given too"
                ),
            ));
        }
        if let Some((_, auth, _)) = methods.pop() {
            nats = nats.with_auth(auth);
        }

        let (ca_file, cert_file, key_file) = (
            get!(o, nats_tls_ca),
            get!(o, nats_tls_cert),
            get!(o, nats_tls_key),
        );
        match (&cert_file, &key_file) {
            (Some(cert), None) => {
                return Err(o.invalid(
                    "nats_tls_cert",
                    cert.display().to_string(),
                    "a client certificate needs its key: give nats_tls_key too",
                ))
            }
            (None, Some(key)) => {
                return Err(o.invalid(
                    "nats_tls_key",
                    key.display().to_string(),
                    "a client key needs its certificate: give nats_tls_cert too",
                ))
            }
            _ => {}
        }
        if ca_file.is_some() || cert_file.is_some() {
            nats = nats.with_tls(NatsTls {
                ca_file,
                cert_file,
                key_file,
            });
        }
        if let Some(interval) = get!(o, nats_ping_interval) {
            nats = nats.with_ping_interval(interval);
        }
        Ok((nats, prefix))
    }
}

fn non_empty(value: &str) -> Result<String, String> {
    match value {
        "" => Err("expected a non-empty value".to_owned()),
        value => Ok(value.to_owned()),
    }
}

/// A path naming a file that can be opened (not read: it may hold a secret).
fn readable_file(value: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(value.trim());
    match std::fs::File::open(&path) {
        Ok(_) if path.is_file() => Ok(path),
        Ok(_) => Err("expected a file, not a directory".to_owned()),
        Err(err) => Err(format!("expected a readable file ({})", err.kind())),
    }
}

fn parse_nats_urls(value: &str) -> Result<NatsUrls, Refusal> {
    let invalid = |bad: &str| Refusal {
        shown: Some(lease_router::redact_url(bad)),
        expected: "expected nats://HOST:PORT, or several separated by commas, such as \
                   nats://10.0.0.1:4222,nats://10.0.0.2:4222"
            .into(),
    };
    let urls: Vec<String> = value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if urls.is_empty() {
        return Err(invalid(value));
    }
    match urls
        .iter()
        .find(|url| url.parse::<async_nats::ServerAddr>().is_err())
    {
        Some(bad) => Err(invalid(bad)),
        None => Ok(NatsUrls(urls)),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches, Parser};

    use super::*;
    use crate::config::resolve;
    use crate::config::tests::{args, assert_no_secret, file, message, path, refused, settings};
    use crate::config::tests::{Cli, SECRETS};

    #[test]
    fn ping_interval_and_the_other_subcommands() {
        for bad in ["0s", "10ms", "2h", "often"] {
            refused(
                &["--nats-ping-interval", bad],
                &format!(
                    "invalid setting nats_ping_interval = \"{bad}\" from --nats-ping-interval: \
                     expected a duration from 100ms to 1h"
                ),
            );
        }
        let s = settings("--nats-ping-interval 1500ms").unwrap();
        assert_eq!(s.nats.ping_interval(), Some(Duration::from_millis(1500)));

        // publish, simulate and demo connect with the same arguments.
        #[derive(Parser)]
        struct Publish {
            #[command(flatten)]
            nats: Sourced<NatsArgs>,
        }
        let argv = [
            "publish",
            "--nats-url",
            "nats://h:1",
            "--nats-ping-interval",
            "2s",
        ];
        let publish = Publish::command().mut_args(|arg| arg.env(None::<&str>));
        let publish = Publish::from_arg_matches(&publish.get_matches_from(argv)).unwrap();
        let (nats, prefix) = publish.nats.resolve().unwrap();
        assert_eq!(nats.urls(), ["nats://h:1"]);
        assert_eq!(nats.ping_interval(), Some(Duration::from_secs(2)));
        assert_eq!(prefix.as_str(), "leases");
        let capacity = Some(DEFAULT_SUBSCRIPTION_CAPACITY);
        assert_eq!(nats.subscription_capacity(), capacity, "as serve's default");
    }

    #[test]
    fn credentials_from_flags_and_file() {
        let given = args(&["--nats-user", "router", "--nats-password", SECRETS[0]]).unwrap();
        assert_no_secret(&format!("{given:?}"));
        let s = resolve(&given).unwrap();
        let (user, password) = ("router".into(), SECRETS[0].into());
        assert_eq!(s.nats.auth(), &NatsAuth::UserPassword { user, password });
        assert_eq!(s.nats.tls(), None);
        assert_no_secret(&format!("{s:?}"));
        assert!(format!("{s:?}").contains("router"));

        let seed = file("SUAEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLE\n");
        let ca = file("-----BEGIN CERTIFICATE-----\n");
        let cert = file("-----BEGIN CERTIFICATE-----\n");
        let key = file("-----BEGIN PRIVATE KEY-----\n");
        let conf = file(&format!(
            "nats_nkey = {:?}\nnats_tls_ca = {:?}\nnats_tls_cert = {:?}\nnats_tls_key = {:?}\n",
            seed.path(),
            ca.path(),
            cert.path(),
            key.path()
        ));
        let s = settings(&format!("--config {}", path(&conf))).unwrap();
        assert_eq!(
            s.nats.auth(),
            &NatsAuth::NKeySeedFile(seed.path().to_owned())
        );
        let tls = NatsTls {
            ca_file: Some(ca.path().to_owned()),
            cert_file: Some(cert.path().to_owned()),
            key_file: Some(key.path().to_owned()),
        };
        assert_eq!(s.nats.tls(), Some(&tls));

        // A flag beats the file: the token replaces nothing, it conflicts with the nkey.
        let m = message(&format!(
            "--config {} --nats-token {}",
            path(&conf),
            SECRETS[1]
        ));
        assert!(m.contains("give only one way to authenticate"), "{m}");
        assert_no_secret(&m);
    }

    #[test]
    fn credential_errors_name_the_setting_never_the_secret() {
        let (password, token) = (SECRETS[0], SECRETS[1]);
        let cases: [(&[&str], &str); 6] = [
            (&["--nats-password", password], "invalid setting nats_password = \"<redacted>\" from --nats-password: a password needs a user"),
            (&["--nats-user", "router"], "invalid setting nats_user = \"router\" from --nats-user: a user needs a password"),
            (&["--nats-user", "router", "--nats-password", password, "--nats-token", token], "invalid setting nats_token = \"<redacted>\" from --nats-token: give only one way"),
            (&["--nats-token", ""], "invalid setting nats_token = \"\" from --nats-token: expected a non-empty value"),
            (&["--nats-creds", "/nonexistent/router.creds"], "invalid setting nats_creds = \"/nonexistent/router.creds\" from --nats-creds: expected a readable file"),
            (&["--nats-tls-cert", "/nonexistent/cert.pem"], "invalid setting nats_tls_cert = \"/nonexistent/cert.pem\" from --nats-tls-cert: expected a readable"),
        ];
        for (argv, start) in cases {
            refused(argv, start);
        }
        let cert = file("x");
        let m = message(&format!("--nats-tls-cert {}", path(&cert)));
        assert!(m.contains("a client certificate needs its key"), "{m}");

        // A secret of the wrong type in the file: not echoed either.
        let f = file("nats_password = 123456789\n");
        let m = message(&format!("--config {}", path(&f)));
        assert!(
            m.starts_with("invalid setting nats_password = \"<redacted>\""),
            "{m}"
        );
        assert!(!m.contains("123456789"), "{m}");
    }

    #[test]
    fn secret_env_values_are_hidden_from_help() {
        let cmd = Cli::command();
        let serve = cmd.find_subcommand("serve").unwrap();
        for id in ["nats_password", "nats_token", "http_token"] {
            let arg = serve.get_arguments().find(|a| a.get_id() == id).unwrap();
            assert!(arg.is_hide_env_values_set(), "{id}");
        }
    }
}
