//! Where each setting's value comes from, and how a value that cannot be used is reported:
//! the layering that `serve`'s settings ([`crate::config`]) and every subcommand's NATS
//! arguments ([`crate::nats_args`]) share.
//!
//! A setting can be given in four places; the first one that has it wins:
//!
//! 1. a command-line flag (`--http-addr 0.0.0.0:9464`),
//! 2. an environment variable (`LEASE_ROUTER_HTTP_ADDR`, or `NATS_URL` for the NATS servers),
//!    which clap reads into the same field,
//! 3. the TOML file named by `--config FILE` (or `LEASE_ROUTER_CONFIG`),
//! 4. the default (the library's, for what the library runs).
//!
//! clap does the layering: [`parse_layered`] reads the command line once to learn the file,
//! then again with the file's values as the flags' defaults, so that clap takes a flag, else
//! its variable, else the file, and its `ArgMatches::value_source` tells which ([`Sourced`]).
//! Each value is parsed once, by its setting's `value_parser` ([`setting`]), into the
//! setting's type; a value it refuses is kept ([`Refused`]) until the settings are resolved
//! and it is known where it came from ([`Origins::get`]), so that every mistake reads the
//! same way, naming the setting, the value, its origin and what is accepted:
//!
//! ```text
//! invalid setting http_addr = "abc" from --http-addr: expected HOST:PORT such as 127.0.0.1:9464
//! ```
//!
//! A key of the file that is not a setting is an error naming the key.
//!
//! Why not figment: figment 0.10 (its last release in May 2024) records which provider gave
//! each value, but it would read the environment a second time beside clap's `env` (which the
//! flags need anyway for `--help` and precedence), could still not tell a flag from its
//! variable without clap, and words its errors in serde's terms. clap's own default layer
//! gives the same precedence and every value's origin with no crate added.
//!
//! Durations are a number of seconds (`300`) or a number with a unit, `ms`, `s`, `m` or `h`,
//! possibly several (`5m`, `1m30s`, `250ms`): [`parse_duration`], for every subcommand. A
//! flag or variable given replaces the list of the file, it does not add to it (that holds
//! for `--deployment` too).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, FromArgMatches};

/// What error messages show instead of a secret value.
pub(crate) const REDACTED: &str = "<redacted>";

/// A setting's value as clap read it: of the setting's type, or refused.
pub type Parsed<T> = Result<T, Refused>;

/// A value a setting does not take (`<redacted>` for a secret), and what it does take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    value: String,
    expected: String,
}

/// Why a parser refused a value: what is accepted, and the part of the value to show when it
/// is not all of it (one URL of a list, without its password).
pub struct Refusal {
    pub shown: Option<String>,
    pub expected: String,
}

impl From<String> for Refusal {
    fn from(expected: String) -> Self {
        Self {
            shown: None,
            expected,
        }
    }
}

/// clap's value parser for a setting: `parse` gives the setting's type; what it refuses does
/// not fail clap's parse, it waits in the value until [`Origins::get`] can name its origin.
pub(crate) fn setting<T, E: Into<Refusal>>(
    parse: impl Fn(&str) -> Result<T, E> + Clone + Send + Sync + 'static,
) -> impl Fn(&str) -> Result<Parsed<T>, std::convert::Infallible> + Clone + Send + Sync + 'static {
    move |raw| {
        Ok(parse(raw).map_err(|refusal| {
            let Refusal { shown, expected } = refusal.into();
            let value = shown.unwrap_or_else(|| raw.to_owned());
            Refused { value, expected }
        }))
    }
}

/// [`setting`] for a secret: a refused value shows as `<redacted>` (unless it is empty).
pub(crate) fn secret<T>(
    parse: impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static,
) -> impl Fn(&str) -> Result<Parsed<T>, std::convert::Infallible> + Clone + Send + Sync + 'static {
    setting(move |raw: &str| {
        parse(raw).map_err(|expected| Refusal {
            shown: Some(if raw.is_empty() { "" } else { REDACTED }.to_owned()),
            expected,
        })
    })
}

/// Arguments and where each of their values came from: a flag, a variable, or the config
/// file that [`parse_layered`] laid beneath them as clap's defaults.
#[derive(Clone, Debug)]
pub struct Sourced<T> {
    pub args: T,
    pub origins: Origins,
}

/// Where each given setting's value came from, by setting.
#[derive(Clone, Debug, Default)]
pub struct Origins(BTreeMap<String, ValueOrigin>);

impl<T: clap::Args> clap::Args for Sourced<T> {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        T::augment_args(cmd)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        T::augment_args_for_update(cmd)
    }
}

impl<T: clap::Args> FromArgMatches for Sourced<T> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let file = matches.try_get_one::<PathBuf>("config").ok().flatten();
        let declared = T::augment_args(clap::Command::new("settings"));
        let origins = declared.get_arguments().filter_map(|arg| {
            let origin = match matches.value_source(arg.get_id().as_str())? {
                ValueSource::CommandLine => ValueOrigin::Flag(format!("--{}", arg.get_long()?)),
                ValueSource::EnvVariable => {
                    ValueOrigin::Environment(arg.get_env()?.to_string_lossy().into_owned())
                }
                _ => ValueOrigin::File(file?.clone()),
            };
            Some((arg.get_id().to_string(), origin))
        });
        Ok(Self {
            origins: Origins(origins.collect()),
            args: T::from_arg_matches(matches)?,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl Origins {
    /// An error about the value of `setting`, which was given.
    pub(crate) fn invalid(
        &self,
        setting: &str,
        value: impl Into<String>,
        expected: impl Into<String>,
    ) -> ConfigError {
        ConfigError::Invalid {
            setting: setting.to_owned(),
            value: value.into(),
            origin: self
                .0
                .get(setting)
                .cloned()
                .expect("a given setting has an origin"),
            expected: expected.into(),
        }
    }

    /// The value of `setting`, if given; a refused one is the error naming it.
    pub(crate) fn get<T: Clone>(
        &self,
        setting: &str,
        value: &Option<Parsed<T>>,
    ) -> Result<Option<T>, ConfigError> {
        match value {
            None => Ok(None),
            Some(Ok(value)) => Ok(Some(value.clone())),
            Some(Err(Refused { value, expected })) => Err(self.invalid(setting, value, expected)),
        }
    }
}

/// `origins.get("field", field)?`: a setting is named as its field.
macro_rules! get {
    ($origins:ident, $field:ident) => {
        $origins.get(stringify!($field), $field)?
    };
}
pub(crate) use get;

/// Where a rejected value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValueOrigin {
    /// The command-line flag of this name (`--http-addr`).
    Flag(String),
    /// The environment variable of this name.
    Environment(String),
    /// The config file at this path.
    File(PathBuf),
}

impl fmt::Display for ValueOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueOrigin::Flag(flag) => write!(f, " from {flag}"),
            ValueOrigin::Environment(name) => write!(f, " from environment variable {name}"),
            ValueOrigin::File(path) => write!(f, " in config file {}", path.display()),
        }
    }
}

/// A setting that cannot be used. The message names the setting, the value, where it came
/// from and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid setting {setting} = {value:?}{origin}: {expected}")]
    Invalid {
        setting: String,
        value: String,
        origin: ValueOrigin,
        expected: String,
    },
    #[error("cannot read config file {}: {source}", path.display())]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {} is not valid TOML: {message}", path.display())]
    ParseFile { path: PathBuf, message: String },
    #[error(
        "unknown setting {key:?} in config file {}: the accepted keys are {}",
        path.display(),
        accepted.join(", ")
    )]
    UnknownKey {
        path: PathBuf,
        key: String,
        accepted: Vec<String>,
    },
}

/// A duration in `range`, else `expected`.
pub(crate) fn duration(
    range: RangeInclusive<Duration>,
    expected: &'static str,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |value| {
        parse_duration(value)
            .filter(|d| range.contains(d))
            .ok_or_else(|| expected.to_owned())
    }
}

/// Parses `300` (seconds), `300s`, `5m`, `1h`, `250ms`, `1m30s`, `1.5s`: the one duration
/// parser of every subcommand (humantime takes neither `300` nor `1.5s`).
pub fn parse_duration(value: &str) -> Option<Duration> {
    let s = value.trim();
    if s.is_empty() {
        return None;
    }
    if let Ok(secs) = s.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_len);
        if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
            return None;
        }
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let unit_secs = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        let number: f64 = number.parse().ok()?;
        total = total.checked_add(Duration::try_from_secs_f64(number * unit_secs).ok()?)?;
        rest = tail;
    }
    Some(total)
}

/// Parses `argv` with `command`; if the subcommand given has a `config` argument that names a
/// file, parses again with the file's values as the defaults of that subcommand's flags,
/// beneath the flags and the environment. clap's own errors (and `--help`) exit as with
/// `get_matches`. An item of a list setting may hold no comma (clap would split it there):
/// `list_item` says what an item is.
///
/// # Errors
/// [`ConfigError`] for a file that cannot be read or parsed, holds an unknown key or a value
/// of a type its setting cannot take.
pub fn parse_layered(
    command: clap::Command,
    argv: &[OsString],
    list_item: &str,
) -> Result<ArgMatches, ConfigError> {
    let matches = command.clone().get_matches_from(argv);
    let Some((name, given)) = matches.subcommand() else {
        return Ok(matches);
    };
    let Some(path) = given.try_get_one::<PathBuf>("config").ok().flatten() else {
        return Ok(matches);
    };
    let declared = command.find_subcommand(name).expect("the subcommand given");
    let file = read_file(path, declared, list_item)?;
    let command = command.mut_subcommand(name, |mut subcommand| {
        for (key, values) in file {
            subcommand = subcommand.mut_arg(key, |arg| arg.default_values(values));
        }
        subcommand
    });
    Ok(command.get_matches_from(argv))
}

/// Reads the config file: a TOML table whose keys are settings `declared` (but `config`), each
/// value as the strings a flag would give (one, or the items of a list setting).
fn read_file(
    path: &Path,
    declared: &clap::Command,
    list_item: &str,
) -> Result<Vec<(String, Vec<String>)>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    })?;
    let table: toml::Table = toml::from_str(&text).map_err(|err| ConfigError::ParseFile {
        path: path.to_owned(),
        message: err.message().to_owned() + &location(&text, err.span()),
    })?;
    let settings: Vec<_> = declared
        .get_arguments()
        .filter(|arg| arg.get_id() != "config")
        .collect();
    let mut values = Vec::with_capacity(table.len());
    for (key, value) in table {
        let Some(arg) = settings.iter().find(|arg| arg.get_id() == key.as_str()) else {
            return Err(ConfigError::UnknownKey {
                path: path.to_owned(),
                key,
                accepted: settings
                    .iter()
                    .map(|arg| arg.get_id().to_string())
                    .collect(),
            });
        };
        // The declaration says what the setting takes: a list (a value delimiter), a switch
        // (a flag that may stand alone), a secret (its value hidden from the help). A secret
        // of the wrong type is reported without its value.
        let is_list = arg.get_value_delimiter().is_some();
        let is_switch = arg.get_num_args().is_some_and(|n| n.min_values() == 0);
        let is_secret = arg.is_hide_env_values_set();
        let invalid = |value: &dyn fmt::Display, expected: String| ConfigError::Invalid {
            setting: key.clone(),
            value: if is_secret {
                REDACTED.into()
            } else {
                value.to_string()
            },
            origin: ValueOrigin::File(path.to_owned()),
            expected,
        };
        let strings = match value {
            toml::Value::String(s) => vec![s],
            toml::Value::Integer(n) if !is_secret => vec![n.to_string()],
            toml::Value::Boolean(b) if is_switch => vec![b.to_string()],
            toml::Value::Array(items) if !is_secret => {
                let items = items
                    .into_iter()
                    .map(|item| match item {
                        // clap splits a list's items at commas: an item holds none.
                        toml::Value::String(s) if is_list && s.contains(',') => {
                            Err(invalid(&s.trim(), list_item.to_owned()))
                        }
                        toml::Value::String(s) => Ok(s),
                        other => Err(invalid(
                            &other,
                            format!("expected a list of strings, not of {}", other.type_str()),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if is_list {
                    items
                } else {
                    vec![items.join(",")]
                }
            }
            other => {
                let expected = if is_secret {
                    format!("expected a string, not {}", other.type_str())
                } else if is_list {
                    format!(
                        "expected a list of names, such as [\"llama-70b\", \"mixtral\"], not {}",
                        other.type_str()
                    )
                } else {
                    format!("expected a string or a number, not {}", other.type_str())
                };
                return Err(invalid(&other, expected));
            }
        };
        values.push((key, strings));
    }
    Ok(values)
}

/// " at line L, column C" for a byte span of `text`.
fn location(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    let Some(span) = span else {
        return String::new();
    };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    format!(" (at line {line}, column {column})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let d = |s| parse_duration(s);
        assert_eq!(d("300"), Some(Duration::from_secs(300)));
        assert_eq!(d("300s"), Some(Duration::from_secs(300)));
        assert_eq!(d("5m"), Some(Duration::from_secs(300)));
        assert_eq!(d("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(d("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(d("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(d("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(d(" 2m "), Some(Duration::from_secs(120)));
        for bad in ["", "s", "5x", "-5s", "5 m", ".5s", "5.s", "1e3s", "m5"] {
            assert_eq!(d(bad), None, "{bad:?}");
        }
    }
}
