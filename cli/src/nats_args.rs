//! The arguments every subcommand reaches NATS with ([`NatsArgs`]): the servers, the subject
//! prefix, authentication, TLS and the ping interval. `serve` holds them among its settings
//! (from flags, environment or its config file); `publish`, `simulate` and `demo` take flags
//! and environment alone.
//!
//! At most one authentication method: user and password (both), a token, an NKey seed file or
//! a credentials file. Any TLS setting makes TLS required; the client certificate and key go
//! together. Files are checked to be readable when the settings are parsed, read when
//! connecting. Secrets never appear in `Debug` output, logs or errors: a bad password or token
//! shows as `<redacted>`, a file by its path only. Prefer files or the environment over flags
//! for secrets (flags show in the process list).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::ServerAddr;
use lease_router::{NatsAuth, NatsConnectConfig, NatsTls, SubjectPrefix};
use lease_router::{DEFAULT_NATS_URL, DEFAULT_SUBJECT_PREFIX};

use crate::layering::{duration, get, secret, setting, ConfigError, Origins, Parsed, Refused};
use crate::layering::{Sourced, REDACTED};

/// Four times async-nats' default: a router takes bursts from many workers at once.
pub const DEFAULT_SUBSCRIPTION_CAPACITY: usize = 262_144;

/// Below this, PINGs would be most of an idle connection's traffic.
const MIN_PING_INTERVAL: Duration = Duration::from_millis(100);
/// Above this, a silent partition goes unseen for hours.
const MAX_PING_INTERVAL: Duration = Duration::from_secs(3600);

/// How every subcommand reaches NATS (flatten `Sourced<NatsArgs>` into it). `Debug` shows
/// whether a password or token was given, never which.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL, or several separated by commas [default: nats://127.0.0.1:4222].
    #[arg(long, value_name = "URLS", env = "NATS_URL", value_parser = setting(parse_nats_urls))]
    pub nats_url: Option<Parsed<NatsUrls>>,
    /// First token(s) of every lease subject: {prefix}.{deployment}.{worker_id}
    /// [default: leases].
    #[arg(long, value_name = "PREFIX", env = "LEASE_ROUTER_SUBJECT_PREFIX",
          value_parser = setting(|s: &str| SubjectPrefix::new(s.trim()).map_err(|err| format!(
              "one or more tokens separated by '.', each of ASCII letters, digits, '-' and '_' \
               (1 to 128 characters), such as {DEFAULT_SUBJECT_PREFIX} or acme.leases ({})",
              err.setting()))))]
    pub subject_prefix: Option<Parsed<SubjectPrefix>>,
    /// NATS user name; needs --nats-password.
    #[arg(long, value_name = "USER", env = "NATS_USER", value_parser = setting(non_empty))]
    pub nats_user: Option<Parsed<String>>,
    /// NATS password (prefer the environment or the config file: flags show in the process
    /// list).
    #[arg(long, value_name = "PASSWORD", env = "NATS_PASSWORD", hide_env_values = true,
          value_parser = secret(|s: &str| non_empty(s).map(Secret)))]
    pub nats_password: Option<Parsed<Secret>>,
    /// NATS authentication token (prefer the environment or the config file).
    #[arg(long, value_name = "TOKEN", env = "NATS_TOKEN", hide_env_values = true,
          value_parser = secret(|s: &str| non_empty(s).map(Secret)))]
    pub nats_token: Option<Parsed<Secret>>,
    /// File holding the NKey seed to authenticate with.
    #[arg(long, value_name = "FILE", env = "NATS_NKEY", value_parser = setting(readable_file))]
    pub nats_nkey: Option<Parsed<PathBuf>>,
    /// NATS credentials file (user JWT and NKey seed, .creds).
    #[arg(long, value_name = "FILE", env = "NATS_CREDS", value_parser = setting(readable_file))]
    pub nats_creds: Option<Parsed<PathBuf>>,
    /// PEM file of the CAs that sign the NATS server's certificate; makes TLS required.
    #[arg(long, value_name = "FILE", env = "NATS_TLS_CA", value_parser = setting(readable_file))]
    pub nats_tls_ca: Option<Parsed<PathBuf>>,
    /// PEM file of a TLS client certificate (with --nats-tls-key); makes TLS required.
    #[arg(long, value_name = "FILE", env = "NATS_TLS_CERT", value_parser = setting(readable_file))]
    pub nats_tls_cert: Option<Parsed<PathBuf>>,
    /// PEM file of the TLS client certificate's key (with --nats-tls-cert).
    #[arg(long, value_name = "FILE", env = "NATS_TLS_KEY", value_parser = setting(readable_file))]
    pub nats_tls_key: Option<Parsed<PathBuf>>,
    /// How often the client PINGs a silent server; a dead connection (a silent partition) is
    /// given up after three intervals without a word, and `/healthz` turns 503
    /// [default: 4s, so within 12s].
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_NATS_PING_INTERVAL",
          value_parser = setting(duration(MIN_PING_INTERVAL..=MAX_PING_INTERVAL, 4, "500ms")))]
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
    /// [`NatsArgs::resolve`] with the origins of the values given.
    pub fn resolve(&self) -> Result<(NatsConnectConfig, SubjectPrefix), ConfigError> {
        self.args.resolve(&self.origins)
    }
}

impl NatsArgs {
    /// How to connect to NATS (the servers, authentication, TLS, the ping interval) and the
    /// subject prefix, the defaults for what is not given; else the [`ConfigError`] naming the
    /// first setting that is wrong (secret values never enter an error).
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

        let (user, password) = (get!(o, nats_user), get!(o, nats_password));
        let hidden = password.as_ref().map(|_| REDACTED.to_owned());
        let user_alone = ("nats_user", user.clone(), "a user needs a password");
        let password_alone = ("nats_password", hidden, "a password needs a user");
        together(o, user_alone, password_alone)?;
        let mut methods: Vec<(&str, NatsAuth, String)> = Vec::new();
        if let (Some(user), Some(Secret(password))) = (user, password) {
            let auth = NatsAuth::UserPassword { user, password };
            methods.push(("nats_user", auth, REDACTED.into()));
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
            let one = "give only one way to authenticate (user and password, token, nkey or creds)";
            let given = format!("{one}; {first} is given too");
            return Err(o.invalid(second, shown, &given));
        }
        if let Some((_, auth, _)) = methods.pop() {
            nats = nats.with_auth(auth);
        }

        let ca_file = get!(o, nats_tls_ca);
        let (cert_file, key_file) = (get!(o, nats_tls_cert), get!(o, nats_tls_key));
        let shown = |path: &Option<PathBuf>| path.as_ref().map(|p| p.display().to_string());
        let (cert, key) = (shown(&cert_file), shown(&key_file));
        let cert_alone = ("nats_tls_cert", cert, "a client certificate needs its key");
        let key_alone = ("nats_tls_key", key, "a client key needs its certificate");
        together(o, cert_alone, key_alone)?;
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

/// A setting of a pair: its name, its value as shown if given, and what it needs.
type Alone<'a> = (&'a str, Option<String>, &'a str);

/// Two settings that go together: one given without the other is refused.
fn together(o: &Origins, a: Alone, b: Alone) -> Result<(), ConfigError> {
    match (a, b) {
        ((setting, Some(shown), needs), (other, None, _))
        | ((other, None, _), (setting, Some(shown), needs)) => {
            Err(o.invalid(setting, shown, &format!("{needs}: give {other} too")))
        }
        _ => Ok(()),
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

/// Server URLs; a bad one is shown without its password.
fn parse_nats_urls(value: &str) -> Result<NatsUrls, Refused> {
    let urls = value.split(|c: char| c == ',' || c.is_whitespace());
    let urls: Vec<String> = urls.filter(|s| !s.is_empty()).map(str::to_owned).collect();
    let bad = urls.iter().find(|url| url.parse::<ServerAddr>().is_err());
    let Some(bad) = bad.map(String::as_str).or(urls.is_empty().then_some(value)) else {
        return Ok(NatsUrls(urls));
    };
    let expected = "expected nats://HOST:PORT, or several separated by commas, such as \
                    nats://10.0.0.1:4222,nats://10.0.0.2:4222";
    let (value, expected) = (Some(lease_router::redact_url(bad)), expected.to_owned());
    Err(Refused { value, expected })
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches, Parser};

    use super::*;
    use crate::config::resolve;
    use crate::config::tests::{args, assert_no_secret, file, message, path};
    use crate::config::tests::{refused, settings, with_file, SECRETS};

    #[test]
    fn ping_interval_and_the_other_subcommands() {
        for bad in ["0s", "10ms", "2h", "often"] {
            let from = format!("nats_ping_interval = {bad:?} from --nats-ping-interval");
            let want = format!("invalid setting {from}: expected a duration from 100ms to 1h");
            refused(&[(&["--nats-ping-interval", bad], want)]);
        }
        let s = settings("--nats-ping-interval 1500ms").unwrap();
        assert_eq!(s.nats.ping_interval(), Some(Duration::from_millis(1500)));

        // publish, simulate and demo connect with the same arguments.
        #[derive(Parser)]
        struct Publish {
            #[command(flatten)]
            nats: Sourced<NatsArgs>,
        }
        let argv = "publish --nats-url nats://h:1 --nats-ping-interval 2s".split(' ');
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
        let [seed, ca, cert, key] = [&seed, &ca, &cert, &key].map(|f| f.path().to_owned());
        let toml = format!(
            "nats_nkey = {seed:?}\nnats_tls_ca = {ca:?}\nnats_tls_cert = {cert:?}\n\
             nats_tls_key = {key:?}\n"
        );
        let s = with_file(&toml, "").unwrap();
        assert_eq!(s.nats.auth(), &NatsAuth::NKeySeedFile(seed));
        let tls = s.nats.tls().expect("TLS");
        let files = (&tls.ca_file, &tls.cert_file, &tls.key_file);
        assert_eq!(files, (&Some(ca), &Some(cert), &Some(key)));

        // A flag beats the file: the token replaces nothing, it conflicts with the nkey.
        let m = with_file(&toml, &format!("--nats-token {}", SECRETS[1]));
        let m = m.unwrap_err().to_string();
        assert!(m.contains("give only one way to authenticate"), "{m}");
        assert_no_secret(&m);
    }

    #[test]
    fn credential_errors_name_the_setting_never_the_secret() {
        let (password, token) = (SECRETS[0], SECRETS[1]);
        refused(&[
            (&["--nats-password", password], "invalid setting nats_password = \"<redacted>\" from --nats-password: a password needs a user"),
            (&["--nats-user", "router"], "invalid setting nats_user = \"router\" from --nats-user: a user needs a password"),
            (&["--nats-user", "router", "--nats-password", password, "--nats-token", token], "invalid setting nats_token = \"<redacted>\" from --nats-token: give only one way"),
            (&["--nats-token", ""], "invalid setting nats_token = \"\" from --nats-token: expected a non-empty value"),
            (&["--nats-creds", "/nonexistent/router.creds"], "invalid setting nats_creds = \"/nonexistent/router.creds\" from --nats-creds: expected a readable file"),
            (&["--nats-tls-cert", "/nonexistent/cert.pem"], "invalid setting nats_tls_cert = \"/nonexistent/cert.pem\" from --nats-tls-cert: expected a readable"),
        ]);
        let cert = file("x");
        let m = message(&format!("--nats-tls-cert {}", path(&cert)));
        assert!(m.contains("a client certificate needs its key"), "{m}");
    }
}
