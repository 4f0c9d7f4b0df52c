//! NATS subjects of the lease events: `{prefix}.{deployment}.{worker_id}`.
//!
//! A worker publishes on its own subject (so NATS permissions can confine it there); a router
//! replica subscribes to `{prefix}.{deployment}.>` and reads the worker back out of each
//! subject with [`Subjects::parse_worker`], which the ingress compares with the worker the
//! event body names.
//!
//! Every token is validated so that a configured name can never widen a subscription or a
//! permission: only ASCII letters, digits, `-` and `_`, 1 to 128 bytes, so no `.`, `*`, `>`,
//! whitespace or anything else. Worker ids are written in canonical decimal (no sign, no
//! leading zero), so each worker has exactly one subject.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The prefix of every lease subject unless configured otherwise.
pub const DEFAULT_SUBJECT_PREFIX: &str = "leases";

/// The longest token (deployment name, or one dot-separated part of the prefix).
pub const MAX_TOKEN_LEN: usize = 128;

/// What is accepted in a deployment name or in each token of a prefix.
const TOKEN_RULE: &str =
    "only ASCII letters, digits, '-' and '_' are allowed (1 to 128 characters)";

/// Values longer than this are cut in error messages.
const MAX_SHOWN_VALUE_CHARS: usize = 80;

/// A deployment name, subject prefix or worker id that cannot be used in a subject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSubjectError {
    /// A deployment name is not one valid subject token.
    #[error("invalid deployment name {}: {TOKEN_RULE}", Shown(.value))]
    DeploymentName {
        /// The rejected value.
        value: String,
    },
    #[error(
        "invalid subject prefix {}: one or more tokens separated by '.', in each {TOKEN_RULE}",
        Shown(.value)
    )]
    /// A subject prefix is not one or more valid tokens separated by `.`.
    SubjectPrefix {
        /// The rejected value.
        value: String,
    },
}

impl InvalidSubjectError {
    /// The rejected value.
    pub fn value(&self) -> &str {
        match self {
            Self::DeploymentName { value } | Self::SubjectPrefix { value } => value,
        }
    }

    /// Which setting the value was for: "deployment name" or "subject prefix".
    pub fn setting(&self) -> &'static str {
        match self {
            Self::DeploymentName { .. } => "deployment name",
            Self::SubjectPrefix { .. } => "subject prefix",
        }
    }
}

/// A value quoted with escapes (tabs, control characters) and cut when very long.
struct Shown<'a>(&'a String);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(MAX_SHOWN_VALUE_CHARS) {
            None => write!(f, "{:?}", self.0),
            Some((cut, _)) => write!(f, "{:?}... ({} bytes)", &self.0[..cut], self.0.len()),
        }
    }
}

/// Whether `token` is one valid subject token.
pub(crate) fn is_valid_token(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= MAX_TOKEN_LEN
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Parses a worker id in canonical decimal: digits only, no sign, no leading zero (except "0").
/// Does not allocate.
fn parse_canonical_u64(s: &str) -> Option<u64> {
    let bytes = s.as_bytes();
    match bytes {
        [] => return None,
        [b'0'] => return Some(0),
        [b'0', ..] => return None,
        _ => {}
    }
    let mut value: u64 = 0;
    for &b in bytes {
        if !b.is_ascii_digit() {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(value)
}

macro_rules! validated_string {
    ($(#[$meta:meta])* $name:ident, $valid:expr, $variant:ident) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// Checks `value`.
            ///
            /// # Errors
            /// The matching [`InvalidSubjectError`] variant when `value` is not valid.
            pub fn new(value: impl Into<String>) -> Result<Self, InvalidSubjectError> {
                let value = value.into();
                if $valid(value.as_str()) {
                    Ok(Self(value))
                } else {
                    Err(InvalidSubjectError::$variant { value })
                }
            }

            /// The value.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The value, as an owned string.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }

        impl FromStr for $name {
            type Err = InvalidSubjectError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidSubjectError;

            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::new(value)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = InvalidSubjectError;

            fn try_from(value: &str) -> Result<Self, Self::Error> {
                Self::new(value)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let value = String::deserialize(deserializer)?;
                Self::new(value).map_err(serde::de::Error::custom)
            }
        }
    };
}

validated_string!(
    /// The deployment token of a subject: ASCII letters, digits, `-` and `_`, 1 to 128 bytes.
    DeploymentName,
    is_valid_token,
    DeploymentName
);

validated_string!(
    /// The first part of every lease subject: one or more dot-separated tokens, each like a
    /// [`DeploymentName`]. Defaults to [`DEFAULT_SUBJECT_PREFIX`].
    SubjectPrefix,
    |value: &str| value.split('.').all(is_valid_token),
    SubjectPrefix
);

impl Default for SubjectPrefix {
    fn default() -> Self {
        Self(DEFAULT_SUBJECT_PREFIX.to_owned())
    }
}

/// The subjects of one deployment's lease events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subjects {
    prefix: SubjectPrefix,
    deployment: DeploymentName,
    /// `{prefix}.{deployment}.`, what every worker subject starts with.
    base: String,
}

impl Subjects {
    /// The subjects of `deployment` under `prefix`.
    pub fn new(prefix: SubjectPrefix, deployment: DeploymentName) -> Self {
        let base = format!("{prefix}.{deployment}.");
        Self {
            prefix,
            deployment,
            base,
        }
    }

    /// The subjects of `deployment` under [`DEFAULT_SUBJECT_PREFIX`].
    pub fn with_default_prefix(deployment: DeploymentName) -> Self {
        Self::new(SubjectPrefix::default(), deployment)
    }

    /// The prefix of every subject.
    pub fn prefix(&self) -> &SubjectPrefix {
        &self.prefix
    }

    /// The deployment.
    pub fn deployment(&self) -> &DeploymentName {
        &self.deployment
    }

    /// The subject a worker publishes its events on: `{prefix}.{deployment}.{worker_id}`.
    pub fn worker_subject(&self, worker_id: u64) -> String {
        format!("{}{worker_id}", self.base)
    }

    /// What a router subscribes to: `{prefix}.{deployment}.>`.
    pub fn deployment_filter(&self) -> String {
        format!("{}>", self.base)
    }

    /// The worker a subject names, only if it is exactly `{prefix}.{deployment}.{worker_id}`
    /// with the worker id in canonical decimal. Does not allocate.
    pub fn parse_worker(&self, subject: &str) -> Option<u64> {
        parse_canonical_u64(subject.strip_prefix(self.base.as_str())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subjects() -> Subjects {
        Subjects::new(
            SubjectPrefix::new("acme.leases").unwrap(),
            DeploymentName::new("llama-70b_prod").unwrap(),
        )
    }

    #[test]
    fn layout() {
        let s = subjects();
        assert_eq!(s.worker_subject(42), "acme.leases.llama-70b_prod.42");
        assert_eq!(
            s.worker_subject(u64::MAX),
            "acme.leases.llama-70b_prod.18446744073709551615"
        );
        assert_eq!(s.deployment_filter(), "acme.leases.llama-70b_prod.>");
        let d = Subjects::with_default_prefix(DeploymentName::new("d").unwrap());
        assert_eq!(d.worker_subject(0), "leases.d.0");
        assert_eq!(d.deployment_filter(), "leases.d.>");
        assert_eq!(d.prefix().as_str(), DEFAULT_SUBJECT_PREFIX);
        assert_eq!(d.deployment().as_str(), "d");
    }

    #[test]
    fn parse_worker_round_trips() {
        let s = subjects();
        for id in [0, 1, 7, 10, 1234567890, u64::MAX] {
            assert_eq!(s.parse_worker(&s.worker_subject(id)), Some(id));
        }
    }

    #[test]
    fn parse_worker_rejects_everything_else() {
        let s = subjects();
        for subject in [
            "",
            "acme.leases.llama-70b_prod",
            "acme.leases.llama-70b_prod.",
            "acme.leases.llama-70b_prod.>",
            "acme.leases.llama-70b_prod.*",
            "acme.leases.llama-70b_prod.1.2",
            "acme.leases.llama-70b_prod.1.",
            "acme.leases.llama-70b_prod.01",
            "acme.leases.llama-70b_prod.00",
            "acme.leases.llama-70b_prod.+1",
            "acme.leases.llama-70b_prod.-1",
            "acme.leases.llama-70b_prod. 1",
            "acme.leases.llama-70b_prod.1 ",
            "acme.leases.llama-70b_prod.0x10",
            "acme.leases.llama-70b_prod.18446744073709551616",
            "acme.leases.llama-70b_prod.99999999999999999999999",
            "acme.leases.llama-70b_prod.１",
            "acme.leases.llama-70b_prodx.1",
            "acme.leases.llama-70b.1",
            "leases.llama-70b_prod.1",
            "xacme.leases.llama-70b_prod.1",
            "acme.leases.other.1",
            "acme.leases.llama-70b_prod.1\n",
        ] {
            assert_eq!(s.parse_worker(subject), None, "{subject:?}");
        }
    }

    const BAD_TOKENS: [&str; 15] = [
        "", "a.b", "*", ">", "a b", "\t", "a\tb", "é", "naïve", "a\n", "a/b", "a*", "$SYS", ".",
        "a\u{0}",
    ];

    #[test]
    fn deployment_names() {
        for good in ["a", "A-Z_0-9", "llama-70b_prod", &"x".repeat(128)] {
            let name = DeploymentName::new(good).unwrap();
            assert_eq!(name.as_str(), good);
            assert_eq!(name.to_string(), good);
            assert_eq!(good.parse::<DeploymentName>().unwrap(), name);
        }
        let long = "x".repeat(129);
        for bad in BAD_TOKENS.iter().copied().chain([long.as_str()]) {
            let err = DeploymentName::new(bad).unwrap_err();
            assert_eq!(
                err,
                InvalidSubjectError::DeploymentName {
                    value: bad.to_owned()
                }
            );
            assert_eq!(err.value(), bad);
            assert_eq!(err.setting(), "deployment name");
            let message = err.to_string();
            assert!(message.starts_with("invalid deployment name "), "{message}");
            assert!(
                message.contains("ASCII letters, digits, '-' and '_'"),
                "{message}"
            );
            assert!(bad.parse::<DeploymentName>().is_err());
        }
    }

    #[test]
    fn error_message_names_the_value() {
        assert_eq!(
            DeploymentName::new("a.b").unwrap_err().to_string(),
            "invalid deployment name \"a.b\": only ASCII letters, digits, '-' and '_' are \
             allowed (1 to 128 characters)"
        );
        assert!(DeploymentName::new("a\tb")
            .unwrap_err()
            .to_string()
            .contains("\"a\\tb\""));
        let huge = DeploymentName::new("y".repeat(10_000))
            .unwrap_err()
            .to_string();
        assert!(huge.len() < 300, "{huge}");
        assert!(huge.contains("(10000 bytes)"), "{huge}");
        assert_eq!(
            SubjectPrefix::new("a..b").unwrap_err().to_string(),
            "invalid subject prefix \"a..b\": one or more tokens separated by '.', in each only \
             ASCII letters, digits, '-' and '_' are allowed (1 to 128 characters)"
        );
    }

    #[test]
    fn prefixes() {
        assert_eq!(SubjectPrefix::default().as_str(), "leases");
        for good in ["leases", "a.b", "org-1.team_2.leases", "x"] {
            assert_eq!(SubjectPrefix::new(good).unwrap().as_str(), good);
        }
        for bad in [
            "", ".", "a.", ".a", "a..b", "a.*", "a.>", ">", "a b", "a.\tb", "lé.a", "a.*.b",
        ] {
            let err = SubjectPrefix::new(bad).unwrap_err();
            assert_eq!(err.setting(), "subject prefix");
            assert_eq!(err.value(), bad);
            assert!(err.to_string().starts_with("invalid subject prefix "));
        }
        let long_token = format!("ok.{}", "x".repeat(129));
        assert!(SubjectPrefix::new(long_token).is_err());
    }

    #[test]
    fn worker_ids() {
        assert_eq!(parse_canonical_u64("0"), Some(0));
        assert_eq!(parse_canonical_u64("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "01",
            "+1",
            "-1",
            " 1",
            "1 ",
            "1.0",
            "18446744073709551616",
            "x",
            "٣",
        ] {
            assert_eq!(parse_canonical_u64(bad), None, "{bad}");
        }
    }

    #[test]
    fn serde_validates() {
        let name: DeploymentName = serde_json::from_str("\"prod-1\"").unwrap();
        assert_eq!(serde_json::to_string(&name).unwrap(), "\"prod-1\"");
        let err = serde_json::from_str::<DeploymentName>("\"a.>\"").unwrap_err();
        assert!(
            err.to_string().contains("invalid deployment name \"a.>\""),
            "{err}"
        );
        let prefix: SubjectPrefix = serde_json::from_str("\"a.b\"").unwrap();
        assert_eq!(prefix.as_str(), "a.b");
        assert!(serde_json::from_str::<SubjectPrefix>("\"a.*\"").is_err());
        assert!(serde_json::from_str::<DeploymentName>("7").is_err());
    }
}
