//! Fleet-wide admission: a deployment's classes, and what each has in flight across the
//! whole fleet.
//!
//! A deployment may name **admission classes** (tenants, tiers): each has a priority
//! **band** (higher is served first) and a **weight** (its share among the classes of its
//! band). A request names its class (`class` in a route request, `cls` on the worker's
//! `admitted`); one that names none, or a class the deployment does not have, counts under
//! the **default class**. Without classes ([`AdmissionConfig::default`]) there is no
//! admission at all: every request is routed as before, and nothing is counted per class.
//!
//! What each class has in flight is kept from the leases, so it is the same in every
//! replica: every worker's `admitted` and `completed` reach every replica over the bus. The
//! lease manager resolves a request's class once, at its admission, to a small [`ClassId`]
//! its lease keeps; every booking and release it hands the scheduler carries that id, and
//! the scheduler adds it to the class's sums ([`ClassSums`]) exactly as it adds the
//! booking to its worker's: released once, by whichever of completion, expiry,
//! supersession or worker reset wins the lease's claim.
//!
//! Class ids are interned per deployment when a class is configured, and never reused: a
//! lease keeps the id it was admitted with while the classes change under it. A lease of a
//! class that is no longer configured counts under the default class.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use crate::histogram::{bucket, figures, micros, HistogramFigures, QUEUE_WAIT_BOUNDS_US};
use crate::load::{BookingWeight, LoadSums, WorkerLoad};

/// Classes a deployment may have.
pub const MAX_CLASSES: usize = 64;

/// The longest class name, in bytes.
pub const MAX_CLASS_NAME_LEN: usize = 64;

/// The largest class weight.
pub const MAX_CLASS_WEIGHT: f64 = 1000.0;

/// Distinct class names a deployment may configure over its life (ids are never reused).
const MAX_INTERNED: usize = u16::MAX as usize - 1;

/// One admission class of a deployment: [`AdmissionClass::new`], or JSON
/// `{"name": "premium", "band": 1, "weight": 4}`.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionClass {
    name: String,
    band: u8,
    weight: f64,
}

impl AdmissionClass {
    /// A class named `name` (ASCII letters, digits, `-` and `_`, 1 to
    /// [`MAX_CLASS_NAME_LEN`] bytes), in priority `band` (higher is served first), with
    /// `weight` (finite, above 0, at most [`MAX_CLASS_WEIGHT`]) among its band's classes.
    /// Checked by [`AdmissionConfig::validate`].
    pub fn new(name: impl Into<String>, band: u8, weight: f64) -> Self {
        Self {
            name: name.into(),
            band,
            weight,
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its priority band: higher is served first.
    pub fn band(&self) -> u8 {
        self.band
    }

    /// Its weight among the classes of its band.
    pub fn weight(&self) -> f64 {
        self.weight
    }
}

/// Default of [`SaturationConfig::max_prefill_tokens_per_worker`]: 16,384 prefill tokens
/// waiting per member worker, about a second of prefill on one GPU (twice the default
/// hot-worker gap of prefix routing).
pub const DEFAULT_MAX_PREFILL_TOKENS_PER_WORKER: u64 = 16_384;

/// Default of [`SaturationConfig::max_kv_share`]: 90 % of the KV capacity held.
pub const DEFAULT_MAX_KV_SHARE: f64 = 0.9;

/// When a deployment is **saturated**, from the shared picture (the member workers' loads,
/// the same in every replica): [`Default`], then the `with_*` methods, or JSON
/// `{"max_prefill_tokens_per_worker": 16384, "kv_capacity_tokens": 200000,
/// "max_kv_share": 0.9}` (each optional).
///
/// Saturated when either holds:
/// - **prefill**: the prefill tokens waiting over every member worker, divided by the
///   number of members, exceed `max_prefill_tokens_per_worker` (a new request would wait
///   behind that much prefill wherever it went);
/// - **KV**: with `kv_capacity_tokens` set (the KV cache of one worker rank, in tokens),
///   the KV tokens held over every member exceed `max_kv_share` of the members' capacity
///   (members × `kv_capacity_tokens`). Unset (the default), this criterion is off: the
///   events do not carry the engines' KV capacity.
///
/// A deployment without member workers is not saturated.
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaturationConfig {
    max_prefill_tokens_per_worker: u64,
    kv_capacity_tokens: Option<u64>,
    max_kv_share: f64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self {
            max_prefill_tokens_per_worker: DEFAULT_MAX_PREFILL_TOKENS_PER_WORKER,
            kv_capacity_tokens: None,
            max_kv_share: DEFAULT_MAX_KV_SHARE,
        }
    }
}

impl SaturationConfig {
    /// Sets the prefill tokens waiting per member worker above which the deployment is
    /// saturated. Default [`DEFAULT_MAX_PREFILL_TOKENS_PER_WORKER`].
    pub fn with_max_prefill_tokens_per_worker(mut self, tokens: u64) -> Self {
        self.max_prefill_tokens_per_worker = tokens;
        self
    }

    /// Sets the KV capacity of one worker rank, in tokens, which turns the KV criterion on.
    pub fn with_kv_capacity_tokens(mut self, tokens: u64) -> Self {
        self.kv_capacity_tokens = Some(tokens);
        self
    }

    /// Sets the share of the members' KV capacity held above which the deployment is
    /// saturated. Default [`DEFAULT_MAX_KV_SHARE`].
    pub fn with_max_kv_share(mut self, share: f64) -> Self {
        self.max_kv_share = share;
        self
    }

    /// The prefill criterion's threshold, per member worker.
    pub fn max_prefill_tokens_per_worker(&self) -> u64 {
        self.max_prefill_tokens_per_worker
    }

    /// One worker rank's KV capacity in tokens; `None`: the KV criterion is off.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        self.kv_capacity_tokens
    }

    /// The KV criterion's threshold, a share of the members' capacity.
    pub fn max_kv_share(&self) -> f64 {
        self.max_kv_share
    }

    /// Refuses thresholds that cannot be met or make no sense.
    ///
    /// # Errors
    /// [`ConfigureAdmissionError::InvalidSaturation`] for a KV capacity of 0, or a KV share
    /// that is not finite and in (0, 1].
    pub fn validate(&self) -> Result<(), ConfigureAdmissionError> {
        if self.kv_capacity_tokens == Some(0) {
            return Err(ConfigureAdmissionError::InvalidSaturation(
                "kv_capacity_tokens must be at least 1".into(),
            ));
        }
        let share = self.max_kv_share;
        if !(share.is_finite() && share > 0.0 && share <= 1.0) {
            return Err(ConfigureAdmissionError::InvalidSaturation(format!(
                "max_kv_share must be above 0 and at most 1 (got {share})"
            )));
        }
        Ok(())
    }

    /// The saturation of a deployment whose member workers carry `loads`.
    pub fn assess<'a>(&self, loads: impl IntoIterator<Item = &'a WorkerLoad>) -> Saturation {
        let (mut members, mut prefill, mut kv) = (0u64, 0u64, 0u64);
        for load in loads {
            members += 1;
            prefill = prefill.saturating_add(load.prefill_tokens);
            kv = kv.saturating_add(load.kv_tokens);
        }
        if members == 0 {
            return Saturation::default();
        }
        let prefill_per_worker = prefill as f64 / members as f64;
        let kv_share = self
            .kv_capacity_tokens
            .map(|capacity| kv as f64 / (capacity as f64 * members as f64));
        let saturated = prefill_per_worker > self.max_prefill_tokens_per_worker as f64
            || kv_share.is_some_and(|share| share > self.max_kv_share);
        Saturation {
            saturated,
            members,
            prefill_tokens_per_worker: prefill_per_worker,
            kv_share,
        }
    }
}

/// A deployment's saturation as [`SaturationConfig::assess`] finds it.
#[derive(Clone, Copy, PartialEq, Debug, Default, Serialize)]
pub struct Saturation {
    /// Whether either criterion holds.
    pub saturated: bool,
    /// Member workers counted.
    pub members: u64,
    /// Prefill tokens waiting per member worker.
    pub prefill_tokens_per_worker: f64,
    /// KV tokens held over the members' capacity; `None` without a KV capacity.
    pub kv_share: Option<f64>,
}

/// Default of [`QueueConfig::max_queued`]: route requests one replica holds waiting.
pub const DEFAULT_MAX_QUEUED: usize = 1024;

/// Default of [`QueueConfig::max_wait_ms`]: 2 seconds.
pub const DEFAULT_MAX_WAIT_MS: u64 = 2_000;

/// The most [`QueueConfig::max_queued`] may be: a waiting request keeps its body (up to the
/// route API's 2 MB) until it goes, so this bounds a replica's queue in memory.
pub const MAX_QUEUED_LIMIT: usize = 65_536;

/// The most [`QueueConfig::max_wait_ms`] may be: 10 minutes. Nothing waits forever.
pub const MAX_WAIT_LIMIT_MS: u64 = 600_000;

/// The bounded queue of one replica, where a route request waits while the deployment is
/// saturated and its class may not go yet: [`Default`], then the `with_*` methods, or JSON
/// `{"max_queued": 1024, "max_wait_ms": 2000}` (each optional).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    max_queued: usize,
    max_wait_ms: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_queued: DEFAULT_MAX_QUEUED,
            max_wait_ms: DEFAULT_MAX_WAIT_MS,
        }
    }
}

impl QueueConfig {
    /// Sets how many route requests may wait in this replica at once; one more is refused
    /// at once. 0: none waits. Default [`DEFAULT_MAX_QUEUED`].
    pub fn with_max_queued(mut self, max: usize) -> Self {
        self.max_queued = max;
        self
    }

    /// Sets the longest a route request waits, whatever it asks
    /// ([`RouteRequest::max_wait_ms`](crate::RouteRequest::max_wait_ms)); then it is
    /// refused. Default [`DEFAULT_MAX_WAIT_MS`].
    pub fn with_max_wait_ms(mut self, ms: u64) -> Self {
        self.max_wait_ms = ms;
        self
    }

    /// Route requests that may wait at once.
    pub fn max_queued(&self) -> usize {
        self.max_queued
    }

    /// The longest wait, in milliseconds.
    pub fn max_wait_ms(&self) -> u64 {
        self.max_wait_ms
    }

    /// Refuses a queue that is not bounded.
    ///
    /// # Errors
    /// [`ConfigureAdmissionError::InvalidQueue`] for `max_queued` over [`MAX_QUEUED_LIMIT`]
    /// or `max_wait_ms` over [`MAX_WAIT_LIMIT_MS`].
    pub fn validate(&self) -> Result<(), ConfigureAdmissionError> {
        if self.max_queued > MAX_QUEUED_LIMIT {
            return Err(ConfigureAdmissionError::InvalidQueue(format!(
                "max_queued must be at most {MAX_QUEUED_LIMIT} (got {})",
                self.max_queued
            )));
        }
        if self.max_wait_ms > MAX_WAIT_LIMIT_MS {
            return Err(ConfigureAdmissionError::InvalidQueue(format!(
                "max_wait_ms must be at most {MAX_WAIT_LIMIT_MS} (got {})",
                self.max_wait_ms
            )));
        }
        Ok(())
    }
}

/// A deployment's admission classes: [`Default`] (none: no admission), then the `with_*`
/// methods; or JSON, as the PUT body and the `admission` setting of `lease-router serve`
/// spell it: `{"classes": [...], "default_class": "...", "saturation": {...}, "queue":
/// {...}}`, each key optional (check it with [`AdmissionConfig::validate`]).
#[derive(Clone, PartialEq, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    classes: Vec<AdmissionClass>,
    default_class: Option<String>,
    saturation: SaturationConfig,
    queue: QueueConfig,
}

impl AdmissionConfig {
    /// Adds a class.
    pub fn with_class(mut self, class: AdmissionClass) -> Self {
        self.classes.push(class);
        self
    }

    /// Sets the classes (replacing any added before).
    pub fn with_classes(mut self, classes: Vec<AdmissionClass>) -> Self {
        self.classes = classes;
        self
    }

    /// Sets the class of requests that name none, or a class the deployment does not have:
    /// one of the classes, required when there are any.
    pub fn with_default_class(mut self, name: impl Into<String>) -> Self {
        self.default_class = Some(name.into());
        self
    }

    /// Sets when the deployment counts as saturated.
    pub fn with_saturation(mut self, saturation: SaturationConfig) -> Self {
        self.saturation = saturation;
        self
    }

    /// When the deployment counts as saturated.
    pub fn saturation(&self) -> SaturationConfig {
        self.saturation
    }

    /// Sets the bounds of this replica's waiting route requests.
    pub fn with_queue(mut self, queue: QueueConfig) -> Self {
        self.queue = queue;
        self
    }

    /// The bounds of this replica's waiting route requests.
    pub fn queue(&self) -> QueueConfig {
        self.queue
    }

    /// The classes, in the order they were given.
    pub fn classes(&self) -> &[AdmissionClass] {
        &self.classes
    }

    /// The default class's name; `None` without classes.
    pub fn default_class(&self) -> Option<&str> {
        self.default_class.as_deref()
    }

    /// Whether the deployment has classes (and so admission).
    pub fn is_enabled(&self) -> bool {
        !self.classes.is_empty()
    }

    /// The class a request naming `name` counts under: that class if the deployment has
    /// it, otherwise the default class; `None` without classes.
    pub fn class_of(&self, name: Option<&str>) -> Option<&AdmissionClass> {
        name.and_then(|name| self.classes.iter().find(|c| c.name == name))
            .or_else(|| {
                let default = self.default_class.as_deref()?;
                self.classes.iter().find(|c| c.name == default)
            })
    }

    /// Refuses classes that cannot be used.
    ///
    /// # Errors
    /// [`ConfigureAdmissionError`]: more than [`MAX_CLASSES`] classes, a name that is not
    /// a valid class name, a weight that is not finite, above 0 and at most
    /// [`MAX_CLASS_WEIGHT`], two classes of one name, a default class that is missing or
    /// not one of the classes, a default class without classes, saturation thresholds
    /// [`SaturationConfig::validate`] refuses, or a queue [`QueueConfig::validate`] refuses.
    pub fn validate(&self) -> Result<(), ConfigureAdmissionError> {
        self.saturation.validate()?;
        self.queue.validate()?;
        if self.classes.is_empty() {
            return match &self.default_class {
                Some(name) => Err(ConfigureAdmissionError::DefaultWithoutClasses(name.clone())),
                None => Ok(()),
            };
        }
        if self.classes.len() > MAX_CLASSES {
            return Err(ConfigureAdmissionError::TooManyClasses(self.classes.len()));
        }
        let mut seen = hashbrown::HashSet::new();
        for class in &self.classes {
            if !is_valid_class_name(&class.name) {
                return Err(ConfigureAdmissionError::InvalidName(shown(&class.name)));
            }
            if !(class.weight.is_finite() && class.weight > 0.0 && class.weight <= MAX_CLASS_WEIGHT)
            {
                return Err(ConfigureAdmissionError::InvalidWeight {
                    class: class.name.clone(),
                    weight: class.weight,
                });
            }
            if !seen.insert(class.name.as_str()) {
                return Err(ConfigureAdmissionError::DuplicateName(class.name.clone()));
            }
        }
        match &self.default_class {
            None => Err(ConfigureAdmissionError::MissingDefault),
            Some(name) if !seen.contains(name.as_str()) => {
                Err(ConfigureAdmissionError::UnknownDefault(shown(name)))
            }
            Some(_) => Ok(()),
        }
    }
}

/// A class name: what a subject token accepts, at most [`MAX_CLASS_NAME_LEN`] bytes.
pub(crate) fn is_valid_class_name(name: &str) -> bool {
    name.len() <= MAX_CLASS_NAME_LEN && crate::subject::is_valid_token(name)
}

/// A name as an error shows it: quoted, cut after 80 bytes.
fn shown(name: &str) -> String {
    match name.char_indices().nth(80) {
        None => format!("{name:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &name[..cut], name.len()),
    }
}

/// Why a deployment's admission classes were refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigureAdmissionError {
    /// More than [`MAX_CLASSES`] classes.
    #[error("{0} classes: a deployment has at most {MAX_CLASSES}")]
    TooManyClasses(usize),
    /// A class name is not 1 to 64 ASCII letters, digits, `-` and `_`.
    #[error(
        "invalid class name {0}: only ASCII letters, digits, '-' and '_' are allowed (1 to \
         {MAX_CLASS_NAME_LEN} characters)"
    )]
    InvalidName(String),
    /// A class weight is not finite, above 0 and at most [`MAX_CLASS_WEIGHT`].
    #[error(
        "class {class:?}: weight must be a finite number above 0 and at most \
         {MAX_CLASS_WEIGHT} (got {weight})"
    )]
    InvalidWeight {
        /// The class.
        class: String,
        /// Its weight.
        weight: f64,
    },
    /// Two classes have one name.
    #[error("class {0:?} is given twice: class names are unique")]
    DuplicateName(String),
    /// Classes without a default class.
    #[error("default_class is required with classes: the class of requests that name none")]
    MissingDefault,
    /// A default class that is not one of the classes.
    #[error("default_class {0} is not one of the classes")]
    UnknownDefault(String),
    /// A default class but no classes.
    #[error("default_class {0:?} is given without classes")]
    DefaultWithoutClasses(String),
    /// Saturation thresholds that make no sense; holds why.
    #[error("invalid saturation: {0}")]
    InvalidSaturation(String),
    /// A queue that is not bounded; holds why.
    #[error("invalid queue: {0}")]
    InvalidQueue(String),
    /// The deployment has configured too many distinct class names over its life.
    #[error("too many distinct class names over this deployment's life (ids are not reused)")]
    TooManyNames,
}

/// A class as its lease keeps it: an interned id of the deployment's [`ClassTable`]; 0 is
/// "no class" (none named, or one the deployment did not have at admission), which counts
/// under the default class.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub(crate) struct ClassId(pub(crate) u16);

/// A deployment's classes as the lease manager and the scheduler share them: the config in
/// force and the interned names.
pub(crate) struct ClassTable {
    /// Whether classes are configured: read without the lock on every admission.
    enabled: AtomicBool,
    inner: RwLock<TableInner>,
}

#[derive(Default)]
struct TableInner {
    config: AdmissionConfig,
    /// Id `i + 1` is `names[i]`.
    names: Vec<Arc<str>>,
    ids: HashMap<Arc<str>, ClassId>,
}

impl Default for ClassTable {
    fn default() -> Self {
        Self {
            enabled: AtomicBool::new(false),
            inner: RwLock::new(TableInner::default()),
        }
    }
}

impl ClassTable {
    /// Whether classes are configured (without the lock).
    pub(crate) fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// The classes in force.
    pub(crate) fn config(&self) -> AdmissionConfig {
        self.inner.read().config.clone()
    }

    /// Puts `config` in force, interning its names.
    pub(crate) fn set(&self, config: AdmissionConfig) -> Result<(), ConfigureAdmissionError> {
        config.validate()?;
        let mut inner = self.inner.write();
        let new = config
            .classes
            .iter()
            .filter(|c| !inner.ids.contains_key(c.name.as_str()))
            .count();
        if inner.names.len() + new > MAX_INTERNED {
            return Err(ConfigureAdmissionError::TooManyNames);
        }
        for class in &config.classes {
            if !inner.ids.contains_key(class.name.as_str()) {
                let name: Arc<str> = Arc::from(class.name.as_str());
                inner.names.push(name.clone());
                let id = ClassId(inner.names.len() as u16);
                inner.ids.insert(name, id);
            }
        }
        self.enabled.store(config.is_enabled(), Ordering::Release);
        inner.config = config;
        Ok(())
    }

    /// The id a request naming `name` is admitted with: its class's, if the deployment has
    /// it now; otherwise 0 (the default class).
    pub(crate) fn resolve(&self, name: Option<&str>) -> ClassId {
        let Some(name) = name else {
            return ClassId::default();
        };
        if !self.enabled.load(Ordering::Acquire) {
            return ClassId::default();
        }
        let inner = self.inner.read();
        match inner.ids.get(name) {
            Some(&id) if inner.config.classes.iter().any(|c| c.name == name) => id,
            _ => ClassId::default(),
        }
    }

    /// The name of an id (`None` for 0 or an id never interned).
    pub(crate) fn name(&self, id: ClassId) -> Option<Arc<str>> {
        let index = usize::from(id.0).checked_sub(1)?;
        self.inner.read().names.get(index).cloned()
    }

    /// Each configured class with what it has in flight across the fleet, from `sums`: a
    /// class's own, and for the default class also those of no class or of a class no
    /// longer configured. In the order of the config; empty without classes.
    pub(crate) fn loads(&self, sums: &ClassSums) -> Vec<ClassLoad> {
        let inner = self.inner.read();
        let folded = Self::fold(&inner, sums);
        inner
            .config
            .classes
            .iter()
            .zip(&folded)
            .map(|(class, sums)| ClassLoad::new(class, sums))
            .collect()
    }

    /// The classes in force, and each one's load across the fleet from `sums` (in their
    /// order, as [`Self::loads`] counts them), read together.
    pub(crate) fn snapshot(&self, sums: &ClassSums) -> (AdmissionConfig, Vec<WorkerLoad>) {
        let inner = self.inner.read();
        let loads = Self::fold(&inner, sums)
            .iter()
            .map(LoadSums::load)
            .collect();
        (inner.config.clone(), loads)
    }

    /// The sums of each configured class, in the config's order: its own, and for the
    /// default class also those of no class or of a class no longer configured. Empty
    /// without classes.
    fn fold(inner: &TableInner, sums: &ClassSums) -> Vec<LoadSums> {
        let config = &inner.config;
        let Some(default) = config.default_class.as_deref() else {
            return Vec::new();
        };
        let mut folded: Vec<LoadSums> = config
            .classes
            .iter()
            .map(|class| {
                let id = inner.ids.get(class.name.as_str()).copied();
                id.map(|id| sums.of(id)).unwrap_or_default()
            })
            .collect();
        let Some(at) = config.classes.iter().position(|c| c.name == default) else {
            return folded;
        };
        let configured = |id: ClassId| {
            let index = usize::from(id.0).wrapping_sub(1);
            inner
                .names
                .get(index)
                .is_some_and(|name| config.classes.iter().any(|c| *c.name == **name))
        };
        for (id, class_sums) in sums.iter() {
            if !configured(id) {
                folded[at].merge(&class_sums);
            }
        }
        folded
    }
}

/// What a class has in flight across the fleet, and what this replica's admission did
/// with its route requests ([`crate::SchedulerHandle::class_loads`]).
#[derive(Clone, PartialEq, Debug, Serialize)]
pub struct ClassLoad {
    /// The class.
    pub class: String,
    /// Its priority band.
    pub band: u8,
    /// Its weight among its band's classes.
    pub weight: f64,
    /// Requests in flight: live bookings of the class on every worker (this replica's
    /// provisional ones included).
    pub in_flight_requests: u64,
    /// Tokens in flight: prompt plus expected output of those bookings, as admitted
    /// (unknown output counts 0).
    pub in_flight_tokens: u64,
    /// This replica's admission decisions for the class (its own: not fleet-wide).
    #[serde(flatten)]
    pub admission: ClassAdmission,
}

impl ClassLoad {
    fn new(class: &AdmissionClass, sums: &LoadSums) -> Self {
        let load = sums.load();
        Self {
            class: class.name.clone(),
            band: class.band,
            weight: class.weight,
            in_flight_requests: load.active_bookings,
            in_flight_tokens: load.prompt_tokens + load.expected_output_tokens,
            admission: ClassAdmission::default(),
        }
    }
}

/// What one replica's admission did with the route requests of one class, since the
/// replica started: each replica counts the requests it was asked to route, so these add
/// up over the replicas (unlike the in-flight figures, which every replica shares). Counted
/// only while the deployment has classes, under the class a request counts under (its own,
/// or the default).
#[derive(Clone, PartialEq, Debug, Default, Serialize)]
pub struct ClassAdmission {
    /// Routed (a decision answered with a worker), at once or from the queue.
    pub admitted: u64,
    /// Entered this replica's queue (each once).
    pub queued: u64,
    /// In this replica's queue now: `queued` less those that left it (`wait.count`).
    pub waiting: u64,
    /// Refused with 429: at once (no wait allowed, or the queue full) or when their wait
    /// ran out.
    pub refused: u64,
    /// Left the queue because their caller went away.
    pub abandoned: u64,
    /// The time spent in the queue by the requests that left it (routed, refused or
    /// abandoned): buckets from 5 ms to 10 s, left out of the JSON (`{"count",
    /// "sum_seconds"}`).
    #[serde(serialize_with = "count_and_sum")]
    pub wait: HistogramFigures,
}

fn count_and_sum<S: serde::Serializer>(
    wait: &HistogramFigures,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeStruct;
    let mut out = serializer.serialize_struct("HistogramFigures", 2)?;
    out.serialize_field("count", &wait.count)?;
    out.serialize_field("sum_seconds", &wait.sum_seconds)?;
    out.end()
}

/// One class's admission counts, kept by the scheduler actor (plain fields: only it writes
/// them, and queries read them through it).
#[derive(Clone, Debug, Default)]
pub(crate) struct ClassCounts {
    pub(crate) admitted: u64,
    pub(crate) queued: u64,
    pub(crate) refused: u64,
    pub(crate) abandoned: u64,
    left: u64,
    waited: std::time::Duration,
    /// Per bucket (not cumulative); the last is +Inf.
    wait_buckets: [u64; QUEUE_WAIT_BOUNDS_US.len() + 1],
}

impl ClassCounts {
    /// A request left the queue after `waited`.
    pub(crate) fn left_queue(&mut self, waited: std::time::Duration) {
        self.wait_buckets[bucket(&QUEUE_WAIT_BOUNDS_US, micros(waited))] += 1;
        self.waited += waited;
        self.left += 1;
    }

    /// The figures, with `waiting` requests of the class in the queue now.
    pub(crate) fn figures(&self, waiting: u64) -> ClassAdmission {
        ClassAdmission {
            admitted: self.admitted,
            queued: self.queued,
            waiting,
            refused: self.refused,
            abandoned: self.abandoned,
            wait: figures(
                &QUEUE_WAIT_BOUNDS_US,
                self.wait_buckets,
                self.waited.as_secs_f64(),
                self.left,
            ),
        }
    }
}

/// Every class's [`ClassCounts`] in one replica, by class name: kept across changes of the
/// classes (a class removed and configured again goes on counting), bounded by the names a
/// deployment may configure over its life.
#[derive(Debug, Default)]
pub(crate) struct AdmissionCounts(HashMap<String, ClassCounts>);

impl AdmissionCounts {
    /// The counts of `class`.
    pub(crate) fn of(&mut self, class: &str) -> &mut ClassCounts {
        self.0.entry_ref(class).or_default()
    }

    /// The figures of `class` (zero if it never counted), with `waiting` queued now.
    pub(crate) fn figures(&self, class: &str, waiting: u64) -> ClassAdmission {
        self.0
            .get(class)
            .map(|counts| counts.figures(waiting))
            .unwrap_or_else(|| ClassCounts::default().figures(waiting))
    }
}

/// The scheduler's sums per class id, kept exactly as its per-worker sums are (signed, so
/// operations add up in any order).
#[derive(Default)]
pub(crate) struct ClassSums {
    sums: Vec<LoadSums>,
}

impl ClassSums {
    fn slot(&mut self, id: ClassId) -> &mut LoadSums {
        let index = usize::from(id.0);
        if index >= self.sums.len() {
            self.sums.resize(index + 1, LoadSums::default());
        }
        &mut self.sums[index]
    }

    /// One booking of `weight` more (`sign` 1) or less (`sign` -1) in class `id`.
    pub(crate) fn add(&mut self, id: ClassId, sign: i64, weight: BookingWeight) {
        self.slot(id).add(sign, weight);
    }

    /// A live booking of class `id` moved from `from` to `to`.
    pub(crate) fn shift(&mut self, id: ClassId, from: BookingWeight, to: BookingWeight) {
        self.slot(id).shift(from, to);
    }

    /// A live booking of `weight` moved from class `from` to class `to` (an admission that
    /// names another class than the route decision it took over).
    pub(crate) fn reclass(&mut self, from: ClassId, to: ClassId, weight: BookingWeight) {
        self.slot(from).add(-1, weight);
        self.slot(to).add(1, weight);
    }

    /// The sums of class `id`.
    pub(crate) fn of(&self, id: ClassId) -> LoadSums {
        self.sums
            .get(usize::from(id.0))
            .copied()
            .unwrap_or_default()
    }

    /// Every id with its sums.
    fn iter(&self) -> impl Iterator<Item = (ClassId, LoadSums)> + '_ {
        self.sums
            .iter()
            .enumerate()
            .map(|(i, sums)| (ClassId(i as u16), *sums))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::RequestLoad;

    fn load(prefill: u64, kv: u64) -> WorkerLoad {
        WorkerLoad {
            prefill_tokens: prefill,
            kv_tokens: kv,
            ..WorkerLoad::default()
        }
    }

    /// Each criterion at its threshold (not above it: not saturated) and just past it.
    #[test]
    fn a_class_s_waits_are_bucketed_and_its_json_keeps_count_and_sum() {
        let mut counts = ClassCounts::default();
        counts.left_queue(std::time::Duration::from_millis(5));
        counts.left_queue(std::time::Duration::from_micros(5_001));
        counts.left_queue(std::time::Duration::from_secs(60));
        let figures = counts.figures(2);
        assert_eq!(figures.wait.count, 3);
        assert_eq!(figures.wait.buckets[0], (0.005, 1), "5 ms at the bound");
        assert_eq!(figures.wait.buckets[1], (0.01, 2));
        assert_eq!(
            figures.wait.buckets.last(),
            Some(&(10.0, 2)),
            "60 s past 10 s"
        );
        let json = serde_json::to_value(&figures).unwrap();
        assert_eq!(
            json["wait"],
            serde_json::json!({"count": 3, "sum_seconds": 60.010001}),
            "no buckets in the JSON"
        );
        assert_eq!(json["waiting"], 2);
    }

    #[test]
    fn saturation_is_prefill_per_worker_or_kv_share_past_its_threshold() {
        let config = SaturationConfig::default().with_max_prefill_tokens_per_worker(1000);
        assert_eq!(config.assess([]), Saturation::default(), "no members");
        let at = config.assess(&[load(1500, 0), load(500, 0)]);
        assert!(!at.saturated, "{at:?}");
        assert_eq!((at.members, at.prefill_tokens_per_worker), (2, 1000.0));
        assert_eq!(at.kv_share, None, "the KV criterion is off by default");
        assert!(
            config
                .assess(&[load(1501, 1 << 40), load(500, 0)])
                .saturated
        );

        let kv = config.with_kv_capacity_tokens(1000).with_max_kv_share(0.5);
        let at = kv.assess(&[load(0, 600), load(0, 400)]);
        assert_eq!((at.saturated, at.kv_share), (false, Some(0.5)));
        assert!(kv.assess(&[load(0, 601), load(0, 400)]).saturated);
        assert!(kv.validate().is_ok());
        for bad in [
            kv.with_max_kv_share(0.0),
            kv.with_max_kv_share(1.5),
            kv.with_max_kv_share(f64::NAN),
            kv.with_kv_capacity_tokens(0),
        ] {
            assert!(matches!(
                bad.validate(),
                Err(ConfigureAdmissionError::InvalidSaturation(_))
            ));
            assert!(AdmissionConfig::default()
                .with_saturation(bad)
                .validate()
                .is_err());
        }
        let json: SaturationConfig = serde_json::from_str(r#"{"kv_capacity_tokens": 5}"#).unwrap();
        assert_eq!(json, SaturationConfig::default().with_kv_capacity_tokens(5));
        assert!(serde_json::from_str::<SaturationConfig>(r#"{"kv": 5}"#).is_err());
    }

    fn two() -> AdmissionConfig {
        AdmissionConfig::default()
            .with_class(AdmissionClass::new("premium", 1, 4.0))
            .with_class(AdmissionClass::new("regular", 0, 1.0))
            .with_default_class("regular")
    }

    /// The JSON of the PUT body and the `admission` setting: every key optional, an unknown
    /// one refused.
    #[test]
    fn admission_reads_from_json() {
        let json = r#"{"classes": [{"name": "premium", "band": 1, "weight": 4},
            {"name": "regular", "band": 0, "weight": 1}], "default_class": "regular",
            "saturation": {"max_prefill_tokens_per_worker": 10}, "queue": {"max_queued": 3}}"#;
        let config: AdmissionConfig = serde_json::from_str(json).unwrap();
        assert_eq!(
            config,
            two()
                .with_saturation(SaturationConfig::default().with_max_prefill_tokens_per_worker(10))
                .with_queue(QueueConfig::default().with_max_queued(3))
        );
        let back: AdmissionConfig =
            serde_json::from_value(serde_json::to_value(&config).unwrap()).unwrap();
        assert_eq!(back, config);
        assert_eq!(
            serde_json::from_str::<AdmissionConfig>("{}").unwrap(),
            AdmissionConfig::default()
        );
        let err = serde_json::from_str::<AdmissionConfig>(r#"{"class": []}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `class`"), "{err}");
    }

    #[test]
    fn a_queue_is_bounded_in_length_and_in_wait() {
        let at_most = QueueConfig::default()
            .with_max_queued(MAX_QUEUED_LIMIT)
            .with_max_wait_ms(MAX_WAIT_LIMIT_MS);
        assert_eq!(at_most.validate(), Ok(()));
        for (queue, needle) in [
            (at_most.with_max_queued(MAX_QUEUED_LIMIT + 1), "max_queued"),
            (
                at_most.with_max_wait_ms(MAX_WAIT_LIMIT_MS + 1),
                "max_wait_ms",
            ),
            (at_most.with_max_wait_ms(u64::MAX), "max_wait_ms"),
        ] {
            let error = queue.validate().unwrap_err();
            assert!(matches!(error, ConfigureAdmissionError::InvalidQueue(_)));
            assert!(error.to_string().contains(needle), "{error}");
            let config = AdmissionConfig::default().with_queue(queue);
            assert_eq!(
                config.validate(),
                Err(error),
                "the deployment's check has it too"
            );
        }
    }

    #[test]
    fn no_classes_is_valid_and_disabled() {
        let none = AdmissionConfig::default();
        assert!(none.validate().is_ok());
        assert!(!none.is_enabled());
        assert_eq!(none.class_of(Some("premium")), None);
        assert!(two().validate().is_ok());
        assert!(two().is_enabled());
    }

    /// Every rule of [`AdmissionConfig::validate`], each at its bound.
    #[test]
    fn classes_are_checked_at_their_bounds() {
        let one = |name: &str, weight: f64| {
            AdmissionConfig::default()
                .with_class(AdmissionClass::new(name, 0, weight))
                .with_default_class(name)
                .validate()
        };
        assert!(one("a", 1.0).is_ok());
        assert!(one(&"a".repeat(64), 1.0).is_ok());
        assert!(one("a-b_C9", MAX_CLASS_WEIGHT).is_ok());
        assert!(one("a", f64::MIN_POSITIVE).is_ok());
        for bad in ["", "a.b", "a b", "a*", ">", "é"] {
            assert!(
                matches!(one(bad, 1.0), Err(ConfigureAdmissionError::InvalidName(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            one(&"a".repeat(65), 1.0),
            Err(ConfigureAdmissionError::InvalidName(_))
        ));
        for bad in [0.0, -1.0, 1000.5, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(
                    one("a", bad),
                    Err(ConfigureAdmissionError::InvalidWeight { .. })
                ),
                "{bad}"
            );
        }
        let dup = two().with_class(AdmissionClass::new("premium", 3, 1.0));
        assert_eq!(
            dup.validate(),
            Err(ConfigureAdmissionError::DuplicateName("premium".into()))
        );
        let no_default = AdmissionConfig::default().with_class(AdmissionClass::new("a", 0, 1.0));
        assert_eq!(
            no_default.validate(),
            Err(ConfigureAdmissionError::MissingDefault)
        );
        let err = two().with_default_class("gold").validate().unwrap_err();
        assert_eq!(
            err,
            ConfigureAdmissionError::UnknownDefault("\"gold\"".into())
        );
        assert!(err.to_string().contains("\"gold\""), "{err}");
        assert!(matches!(
            AdmissionConfig::default()
                .with_default_class("a")
                .validate(),
            Err(ConfigureAdmissionError::DefaultWithoutClasses(_))
        ));
        let at_most = |n: usize| {
            AdmissionConfig::default()
                .with_classes(
                    (0..n)
                        .map(|i| AdmissionClass::new(format!("c{i}"), 0, 1.0))
                        .collect(),
                )
                .with_default_class("c0")
                .validate()
        };
        assert!(at_most(MAX_CLASSES).is_ok());
        assert_eq!(
            at_most(MAX_CLASSES + 1),
            Err(ConfigureAdmissionError::TooManyClasses(MAX_CLASSES + 1))
        );
    }

    #[test]
    fn a_request_counts_under_its_class_or_the_default() {
        let config = two();
        assert_eq!(config.class_of(Some("premium")).unwrap().name(), "premium");
        assert_eq!(config.class_of(Some("gold")).unwrap().name(), "regular");
        assert_eq!(config.class_of(None).unwrap().name(), "regular");
        let table = ClassTable::default();
        assert_eq!(table.resolve(Some("premium")), ClassId(0), "no classes yet");
        table.set(config).unwrap();
        let premium = table.resolve(Some("premium"));
        assert_ne!(premium, ClassId(0));
        assert_eq!(table.resolve(Some("gold")), ClassId(0));
        assert_eq!(table.resolve(None), ClassId(0));
        assert_eq!(table.name(premium).as_deref(), Some("premium"));
        assert_eq!(table.name(ClassId(0)), None);
    }

    /// The default class counts what has no class, and what belongs to a class no longer
    /// configured; ids are kept across a change of the classes.
    #[test]
    fn loads_fold_the_unclassed_into_the_default_class() {
        let table = ClassTable::default();
        table.set(two()).unwrap();
        let premium = table.resolve(Some("premium"));
        let regular = table.resolve(Some("regular"));
        let w = BookingWeight::from(RequestLoad::new(100, Some(20)));
        let mut sums = ClassSums::default();
        sums.add(premium, 1, w);
        sums.add(premium, 1, w);
        sums.add(regular, 1, w);
        sums.add(ClassId(0), 1, w);
        let loads = table.loads(&sums);
        let figures: Vec<_> = loads
            .iter()
            .map(|l| (l.class.as_str(), l.in_flight_requests, l.in_flight_tokens))
            .collect();
        assert_eq!(figures, [("premium", 2, 240), ("regular", 2, 240)]);

        // Premium goes away: its bookings count under the default; back, they are its own.
        table
            .set(
                AdmissionConfig::default()
                    .with_class(AdmissionClass::new("regular", 0, 1.0))
                    .with_default_class("regular"),
            )
            .unwrap();
        assert_eq!(table.resolve(Some("premium")), ClassId(0));
        let loads = table.loads(&sums);
        assert_eq!(loads.len(), 1);
        assert_eq!(loads[0].in_flight_requests, 4);
        table.set(two()).unwrap();
        assert_eq!(table.resolve(Some("premium")), premium, "the id is kept");

        // A release brings the sums back exactly.
        sums.add(premium, -1, w);
        sums.reclass(regular, premium, w);
        let loads = table.loads(&sums);
        assert_eq!(loads[0].in_flight_requests, 2);
        assert_eq!(loads[1].in_flight_requests, 1);
        assert!(table.set(AdmissionConfig::default()).is_ok());
        assert!(table.loads(&sums).is_empty(), "no classes, no loads");
        assert_eq!(table.resolve(Some("premium")), ClassId(0));
    }
}
