//! Where each setting's value comes from, and how an unusable value is reported: for `serve`'s
//! settings ([`crate::config`]) and every subcommand's NATS arguments ([`crate::nats_args`]).
//!
//! A setting is taken from a flag, else its environment variable (clap reads both into one
//! field), else the TOML file `--config` names, else the default; a flag or variable replaces a
//! list of the file. [`parse_layered`] lays the file beneath the flags as clap's defaults, so
//! that `ArgMatches::value_source` tells each value's origin ([`Sourced`]). Each value is
//! parsed once, by its setting's `value_parser` ([`setting`]); a value it refuses waits
//! ([`Refused`]) until its origin is known ([`Origins::get`]), so that every mistake names the
//! setting, the value, its origin and what is accepted: `invalid setting http_addr = "abc"
//! from --http-addr: expected HOST:PORT such as 127.0.0.1:9464`.
//!
//! Why not figment (0.10, last released in May 2024): it would read the environment a second
//! time beside clap's `env` (which `--help` and precedence need anyway), could still not tell
//! a flag from its variable without clap, and words its errors in serde's terms.

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

/// A value a setting does not take, and what it takes; a parser gives `value` to show other
/// than the whole value (one URL of a list, without its password; `<redacted>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    pub(crate) value: Option<String>,
    pub(crate) expected: String,
}

impl From<String> for Refused {
    fn from(expected: String) -> Self {
        let value = None;
        Self { value, expected }
    }
}

/// clap's value parser for a setting: `parse` gives the setting's type; what it refuses does
/// not fail clap's parse, it waits in the value until [`Origins::get`] can name its origin.
pub(crate) fn setting<T, E: Into<Refused>>(
    parse: impl Fn(&str) -> Result<T, E> + Clone + Send + Sync + 'static,
) -> impl Fn(&str) -> Result<Parsed<T>, std::convert::Infallible> + Clone + Send + Sync + 'static {
    move |raw| {
        Ok(parse(raw).map_err(|refused| {
            let mut refused = refused.into();
            refused.value.get_or_insert_with(|| raw.to_owned());
            refused
        }))
    }
}

/// [`setting`] for a secret: a refused value shows as `<redacted>` (unless it is empty).
pub(crate) fn secret<T>(
    parse: impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static,
) -> impl Fn(&str) -> Result<Parsed<T>, std::convert::Infallible> + Clone + Send + Sync + 'static {
    setting(move |raw: &str| {
        let value = Some(if raw.is_empty() { "" } else { REDACTED }.to_owned());
        parse(raw).map_err(|expected| Refused { value, expected })
    })
}

/// Arguments and where each of their values came from: a flag, a variable, or the config
/// file that [`parse_layered`] laid beneath them as clap's defaults.
#[derive(Clone, Debug)]
pub struct Sourced<T> {
    pub args: T,
    pub origins: Origins,
}

/// Where each given setting's value came from, by setting, as an error says it: " from
/// --http-addr", " from environment variable NAME" or " in config file PATH".
#[derive(Clone, Debug, Default)]
pub struct Origins(BTreeMap<String, String>);

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
        let origins = declared::<T>().into_iter().filter_map(|arg| {
            let origin = match matches.value_source(arg.get_id().as_str())? {
                ValueSource::CommandLine => format!(" from --{}", arg.get_long()?),
                ValueSource::EnvVariable => {
                    let name = arg.get_env()?.to_string_lossy();
                    format!(" from environment variable {name}")
                }
                _ => in_file(file?),
            };
            Some((arg.get_id().to_string(), origin))
        });
        let (args, origins) = (T::from_arg_matches(matches)?, Origins(origins.collect()));
        Ok(Self { args, origins })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

/// The settings `T` declares, in order.
pub(crate) fn declared<T: clap::Args>() -> Vec<clap::Arg> {
    settings_of(&T::augment_args(clap::Command::new("settings")))
}

/// The settings `command` declares, in order: every argument but `--config` itself.
fn settings_of(command: &clap::Command) -> Vec<clap::Arg> {
    let settings = command.get_arguments().filter(|a| a.get_id() != "config");
    settings.cloned().collect()
}

impl Origins {
    /// An error about the value of `setting`, which was given.
    pub(crate) fn invalid(&self, setting: &str, value: impl ToString, why: &str) -> ConfigError {
        let origin = self.0.get(setting).cloned();
        ConfigError::Invalid {
            setting: setting.to_owned(),
            value: value.to_string(),
            origin: origin.expect("a given setting has an origin"),
            expected: why.to_owned(),
        }
    }

    /// The value of `setting`, if given; a refused one is the error naming it.
    pub(crate) fn get<T: Clone>(
        &self,
        setting: &str,
        value: &Option<Parsed<T>>,
    ) -> Result<Option<T>, ConfigError> {
        value.clone().transpose().map_err(|refused| {
            self.invalid(
                setting,
                refused.value.unwrap_or_default(),
                &refused.expected,
            )
        })
    }
}

/// `origins.get("field", field)?`: a setting is named as its field.
macro_rules! get {
    ($origins:ident, $field:ident) => {
        $origins.get(stringify!($field), $field)?
    };
}
pub(crate) use get;

/// The origin of a value from the config file at `path`.
fn in_file(path: &Path) -> String {
    format!(" in config file {}", path.display())
}

/// A setting that cannot be used: the message names the setting, the value, its origin, the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid setting {setting} = {value:?}{origin}: {expected}")]
    Invalid {
        setting: String,
        value: String,
        origin: String,
        expected: String,
    },
    #[error("cannot read config file {}: {source}", path.display())]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {} is not valid TOML: {message}", path.display())]
    ParseFile { path: PathBuf, message: String },
    #[error(
        "unknown setting {key:?} in config file {}: the accepted keys are {}",
        path.display(),
        known.join(", ")
    )]
    UnknownKey {
        path: PathBuf,
        key: String,
        known: Vec<String>,
    },
}

/// A duration in `range`, else what it takes, written from the range with `seconds` (which
/// is also the first example with a unit) and `more` as examples.
pub(crate) fn duration(
    range: RangeInclusive<Duration>,
    seconds: u64,
    more: &str,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    let text = |d: Duration| match d.as_millis() {
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    };
    let what = match (*range.start(), *range.end()) {
        (Duration::ZERO, Duration::MAX) => "duration".to_owned(),
        (min, Duration::MAX) if min == Duration::from_nanos(1) => "positive duration".to_owned(),
        (min, Duration::MAX) => format!("duration of at least {}", text(min)),
        (min, max) => format!("duration from {} to {}", text(min), text(max)),
    };
    let expected = format!(
        "expected a {what}: seconds ({seconds}) or a number with a unit ms, s, m or h \
         ({seconds}s, {more})"
    );
    move |value| {
        let d = parse_duration(value).filter(|d| range.contains(d));
        d.ok_or_else(|| expected.clone())
    }
}

/// Parses `300` (seconds), `300s`, `5m`, `1h`, `250ms`, `1m30s`, `1.5s`: the one duration
/// parser of every subcommand (humantime takes neither `300` nor `1.5s`).
pub fn parse_duration(value: &str) -> Option<Duration> {
    let s = value.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    // Numbers (digits and a dot inside), each followed by its unit.
    fn split(s: &str, number: bool) -> (&str, &str) {
        let end = s.find(|c: char| (c.is_ascii_digit() || c == '.') != number);
        s.split_at(end.unwrap_or(s.len()))
    }
    let units = [("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)];
    let (mut total, mut rest) = (Duration::ZERO, s);
    while !rest.is_empty() {
        let (number, tail) = split(rest, true);
        let (unit, tail) = split(tail, false);
        let (_, unit_secs) = units.into_iter().find(|(name, _)| *name == unit)?;
        let inside = !number.starts_with('.') && !number.ends_with('.');
        let number: f64 = number.parse().ok().filter(|_| inside)?;
        total = total.checked_add(Duration::try_from_secs_f64(number * unit_secs).ok()?)?;
        rest = tail;
    }
    (!s.is_empty()).then_some(total)
}

/// Parses `argv` with `command`; if the subcommand given has a `config` argument that names a
/// file, parses again with the file's values as the defaults of that subcommand's flags,
/// beneath the flags and the environment; a [`ConfigError`] for a file that cannot be read or
/// parsed, or holds a setting it cannot. clap's own errors (and `--help`) exit as with
/// `get_matches`. `list_item` says what an item of a list setting is (it holds no comma).
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
    let file = read_file(path, &settings_of(declared), list_item)?;
    let command = command.mut_subcommand(name, |mut subcommand| {
        for (key, values) in file {
            subcommand = subcommand.mut_arg(key, |arg| arg.default_values(values));
        }
        subcommand
    });
    Ok(command.get_matches_from(argv))
}

/// Reads the config file: a TOML table whose keys are `settings`, each value as the strings a
/// flag would give (one, or the items of a list setting).
fn read_file(
    path: &Path,
    settings: &[clap::Arg],
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
    let mut values = Vec::with_capacity(table.len());
    for (key, value) in table {
        let Some(arg) = settings.iter().find(|arg| arg.get_id() == key.as_str()) else {
            let known = settings.iter().map(|a| a.get_id().to_string()).collect();
            let path = path.to_owned();
            return Err(ConfigError::UnknownKey { path, key, known });
        };
        // What the declaration says the setting takes: a list (a value delimiter), a switch (a
        // flag that may stand alone), a secret (hidden from the help, and from errors here).
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
            origin: in_file(path),
            expected,
        };
        let strings = match value {
            toml::Value::String(s) => vec![s],
            toml::Value::Integer(n) if !is_secret => vec![n.to_string()],
            toml::Value::Boolean(b) if is_switch => vec![b.to_string()],
            toml::Value::Array(items) if !is_secret => {
                let mut strings = Vec::with_capacity(items.len());
                for item in items {
                    let toml::Value::String(s) = item else {
                        let of = item.type_str();
                        let expected = format!("expected a list of strings, not of {of}");
                        return Err(invalid(&item, expected));
                    };
                    // clap splits a list's items at commas: an item holds none.
                    if is_list && s.contains(',') {
                        return Err(invalid(&s.trim(), list_item.to_owned()));
                    }
                    strings.push(s);
                }
                if !is_list {
                    strings = vec![strings.join(",")];
                }
                strings
            }
            other => {
                let expected = match (is_secret, is_list) {
                    (true, _) => "expected a string",
                    (_, true) => "expected a list of names, such as [\"llama-70b\", \"mixtral\"]",
                    _ => "expected a string or a number",
                };
                let of = other.type_str();
                return Err(invalid(&other, format!("{expected}, not {of}")));
            }
        };
        values.push((key, strings));
    }
    Ok(values)
}

/// " (at line L, column C)" for a byte span of `text`.
fn location(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    span.map_or_else(String::new, |span| {
        let before = &text[..span.start.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        format!(" (at line {line}, column {column})")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let (d, five_minutes) = (|s| parse_duration(s), Some(Duration::from_secs(300)));
        assert_eq!(["300", "300s", "5m"].map(d), [five_minutes; 3]);
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
