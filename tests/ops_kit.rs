//! The operations kit in deploy/: the alert rules (promtool's checks and unit tests), the
//! Grafana dashboard (valid PromQL, wired to its data source), the metrics both use (each
//! exists in a running router's `/metrics`; a real Prometheus scraping that router answers
//! every dashboard query and evaluates every rule), docker-compose.yml
//! (`docker-compose config`) and the Kubernetes manifests (deploy/kubernetes/validate.py:
//! schemas and hardening).
//!
//! Each tool it runs is required: a missing one fails the test with the command that
//! installs it (`.ci/run` installs them all), it never skips.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use std::net::SocketAddr;

use lease_router::service::{serve, ApiState, DeploymentHost, HostSettings};
use lease_router::NatsConnection;
use lease_router::{AdmissionClass, AdmissionConfig, DeploymentName, LeaseStreamConfig};
use lease_router_testkit::NatsServer;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const PROMTOOL_HINT: &str =
    "promtool is missing: `apt-get install prometheus` (Debian's package ships promtool)";
const COMPOSE_HINT: &str = "neither `docker-compose` nor `docker compose` is installed: \
                            `apt-get install docker-compose`";
const PYTHON_HINT: &str = "python3 is missing: `apt-get install python3 python3-pip`";

/// Labels Prometheus adds to every scraped series: a query may use them on any metric.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Runs `program` in the repository; a program that is not installed fails with `hint`.
fn run(program: &str, args: &[&str], hint: &str) -> Output {
    match Command::new(program)
        .args(args)
        .current_dir(repo())
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{hint} ({program}: {e})"),
        Err(e) => panic!("{program} did not run: {e}"),
    }
}

fn assert_success(output: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    stdout
}

fn promtool(args: &[&str]) -> String {
    let output = run("promtool", args, PROMTOOL_HINT);
    assert_success(&output, &format!("promtool {}", args.join(" ")))
}

// ---------------------------------------------------------------------------------------------
// Reading the rules and the dashboard
// ---------------------------------------------------------------------------------------------

const RULES: &str = "deploy/prometheus/lease-router.rules.yml";
const RULE_TESTS: &str = "deploy/prometheus/lease-router.rules.test.yml";
const DASHBOARD: &str = "deploy/grafana/dashboards/lease-router.json";

/// `(alert name, expr)` of every rule. The file keeps one style: `- alert: NAME`, then
/// `expr: ONE LINE` or `expr: |` and an indented block.
fn alert_rules() -> Vec<(String, String)> {
    let text = read(RULES);
    let lines: Vec<&str> = text.lines().collect();
    let mut rules = Vec::new();
    let mut name = None;
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if let Some(n) = trimmed.strip_prefix("- alert: ") {
            name = Some(n.trim().to_string());
        } else if let Some(expr) = trimmed.strip_prefix("expr: ") {
            let indent = line.len() - trimmed.len();
            let expr = if expr.trim() == "|" {
                lines[i + 1..]
                    .iter()
                    .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                    .map(|l| l.trim())
                    .collect::<Vec<_>>()
                    .join(" ")
            } else {
                expr.trim().to_string()
            };
            let name = name.take().expect("an expr follows its `- alert:` line");
            rules.push((name, expr));
        }
    }
    assert_eq!(
        rules.len(),
        text.matches("- alert: ").count(),
        "every alert has an expr in the style this test reads"
    );
    rules
}

/// Every query of the dashboard: `(where, query)`, the panels' targets and the variables'.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("each target has an expr");
            let place = format!("panel {:?} {}", panel["title"], target["refId"]);
            queries.push((place, expr.to_string()));
        }
    }
    for var in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if var["type"] == "query" {
            let query = var["query"]["query"]
                .as_str()
                .expect("a query variable's query");
            queries.push((format!("variable {}", var["name"]), query.to_string()));
        }
    }
    queries
}

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD)).expect("the dashboard is JSON")
}

/// The dashboard's query with Grafana's variables replaced by what Prometheus would see.
fn as_promql(query: &str) -> String {
    query
        .replace("$__rate_interval", "1m")
        .replace("$deployment", ".*")
        .replace("$instance", ".*")
}

/// The `lease_router_*` metrics a query reads, each with the label names its selector uses.
fn selectors(query: &str) -> Vec<(String, Vec<String>)> {
    let mut found = Vec::new();
    let mut rest = query;
    while let Some(start) = rest.find("lease_router_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].to_string();
        let mut labels = Vec::new();
        if let Some(matchers) = tail[end..].strip_prefix('{') {
            let matchers = &matchers[..matchers.find('}').expect("a closed selector")];
            for matcher in matchers.split(',').filter(|m| !m.trim().is_empty()) {
                let label = matcher
                    .split(['=', '!'])
                    .next()
                    .expect("a label name")
                    .trim();
                labels.push(label.to_string());
            }
        }
        found.push((name, labels));
        rest = &tail[end..];
    }
    found
}

/// Label names a query groups by (`by (...)`, `without (...)`, `on (...)`, `ignoring (...)`)
/// or reads with `label_values(metric, label)`.
fn grouping_labels(query: &str) -> Vec<String> {
    let mut labels = Vec::new();
    for keyword in ["by", "without", "on", "ignoring"] {
        let mut rest = query;
        while let Some(at) = rest.find(keyword) {
            let before = rest[..at].chars().last();
            let after = rest[at + keyword.len()..].trim_start();
            rest = &rest[at + keyword.len()..];
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            if let Some(list) = after.strip_prefix('(') {
                let list = &list[..list.find(')').expect("a closed label list")];
                labels.extend(
                    list.split(',')
                        .map(|l| l.trim().to_string())
                        .filter(|l| !l.is_empty()),
                );
            }
        }
    }
    if let Some(args) = query.trim().strip_prefix("label_values(") {
        let label = args
            .trim_end_matches(')')
            .split(',')
            .nth(1)
            .expect("a label");
        labels.push(label.trim().to_string());
    }
    labels
}

// ---------------------------------------------------------------------------------------------
// Alert rules
// ---------------------------------------------------------------------------------------------

#[test]
fn alert_rules_pass_promtool_checks_and_unit_tests() {
    let checked = promtool(&["check", "rules", RULES]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", alert_rules().len())),
        "{checked}"
    );
    let tested = promtool(&["test", "rules", RULE_TESTS]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The compose file's Prometheus configuration, with the rule file it loads.
    promtool(&["check", "config", "deploy/prometheus/prometheus.yml"]);
}

/// Each alert has a runbook and a severity, and a unit test in which it fires (the expected
/// alerts of a case are exact, so the healthy series beside the firing ones stay quiet).
#[test]
fn every_alert_has_a_runbook_and_a_firing_unit_test() {
    let rules_text = read(RULES);
    let rules = alert_rules();
    assert!(rules.len() >= 9, "{rules:?}");
    assert_eq!(rules_text.matches("runbook: ").count(), rules.len());
    assert_eq!(rules_text.matches("severity: ").count(), rules.len());
    let tests = read(RULE_TESTS);
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    for (name, _) in &rules {
        let fires = lines.windows(3).any(|w| {
            w[0] == format!("alertname: {name}") && w[1] == "exp_alerts:" && w[2] == "- exp_labels:"
        });
        assert!(fires, "{name}: no unit test in which it fires");
    }
}

/// deploy/README.md's table of alerts names exactly the rules, with their severities.
#[test]
fn readme_lists_exactly_the_alerts() {
    let rules_text = read(RULES);
    let mut declared = BTreeMap::new();
    let mut name = None;
    for line in rules_text.lines().map(str::trim) {
        if let Some(n) = line.strip_prefix("- alert: ") {
            name = Some(n.to_string());
        } else if let Some(severity) = line.strip_prefix("severity: ") {
            let name = name.take().expect("a severity follows its alert");
            declared.insert(name, severity.to_string());
        }
    }
    let readme = read("deploy/README.md");
    let section = readme
        .split("\n## Alerts\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("deploy/README.md has an Alerts section");
    let documented: BTreeMap<String, String> = section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_string(), cells[2].to_string())
        })
        .collect();
    assert_eq!(
        documented, declared,
        "deploy/README.md's alerts and the rules differ"
    );
}

// ---------------------------------------------------------------------------------------------
// Dashboard
// ---------------------------------------------------------------------------------------------

#[test]
fn dashboard_queries_are_valid_promql() {
    let dashboard = dashboard();
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() > 20, "{queries:?}");
    // promtool parses PromQL in rule files: each query becomes a recording rule (YAML is a
    // superset of JSON, so the file is written as JSON).
    let rules: Vec<Value> = queries
        .iter()
        .filter(|(_, q)| !q.starts_with("label_values("))
        .enumerate()
        .map(|(i, (_, q))| serde_json::json!({"record": format!("dashboard:query_{i}"), "expr": as_promql(q)}))
        .collect();
    let file = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard-queries.yml");
    std::fs::write(&path, file.to_string()).unwrap();
    let checked = promtool(&["check", "rules", path.to_str().unwrap()]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", rules.len())),
        "{checked}"
    );
}

#[test]
fn dashboard_is_wired_to_the_provisioned_data_source() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "lease-router");
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let datasource = variables
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a data source variable");
    assert_eq!(datasource["query"], "prometheus");
    // The provisioned data source is the variable's default.
    let provisioned = read("deploy/grafana/provisioning/datasources/prometheus.yml");
    let uid = datasource["current"]["value"].as_str().unwrap();
    assert!(
        provisioned.contains(&format!("uid: {uid}\n")),
        "{provisioned}"
    );
    let expected = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});
    let mut ids = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        assert!(ids.insert(panel["id"].as_u64().expect("an id")), "{panel}");
        for key in ["x", "y", "w", "h"] {
            assert!(panel["gridPos"][key].is_u64(), "{panel}");
        }
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"], expected, "{}", panel["title"]);
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}", panel["title"]);
        for target in targets {
            assert_eq!(target["datasource"], expected, "{}", panel["title"]);
        }
    }
    // The provider loads the directory compose mounts the dashboards at.
    let provider = read("deploy/grafana/provisioning/dashboards/lease-router.yml");
    let compose = read("docker-compose.yml");
    assert!(provider.contains("path: /etc/grafana/dashboards\n"));
    assert!(compose.contains("./deploy/grafana/dashboards:/etc/grafana/dashboards:ro"));
}

// ---------------------------------------------------------------------------------------------
// The metrics both use, against a running router
// ---------------------------------------------------------------------------------------------

/// Metric name (as scraped) to the label names of its series, from OpenMetrics text.
fn scraped_series(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut series: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name_end = line.find(['{', ' ']).expect("a sample");
        let labels = series.entry(line[..name_end].to_string()).or_default();
        if line[name_end..].starts_with('{') {
            let body = &line[name_end + 1..line.find('}').expect("closed labels")];
            for pair in body.split(',').filter(|p| !p.is_empty()) {
                labels.insert(pair.split('=').next().unwrap().to_string());
            }
        }
    }
    series
}

async fn get(client: &reqwest::Client, url: &str) -> String {
    let response = client.get(url).send().await.expect("GET");
    assert!(response.status().is_success(), "{url}: {response:?}");
    response.text().await.expect("a body")
}

/// Workers of the router under test, each with live leases.
const WORKERS: u64 = 3;
/// The router's `max_active_leases`, not the default, so the gauge is seen to report it.
const LEASE_BOUND: usize = 5_000;

/// A durable router (so the catch-up series exist) serving deployment `ops` on a socket,
/// fed by [`WORKERS`] workers whose leases are live (so the per-worker and lag series
/// exist).
struct TestRouter {
    _server: NatsServer,
    _workers: NatsConnection,
    host: DeploymentHost,
    addr: SocketAddr,
    shutdown: CancellationToken,
    served: JoinHandle<std::io::Result<()>>,
    client: reqwest::Client,
}

impl TestRouter {
    /// The router, and its `/metrics` once it has taken the traffic.
    async fn start() -> (Self, String) {
        let server = common::js_server().await;
        let connection = common::client(&server.url()).await;
        // Admission classes, so the per-class series exist (the workers name no class: the
        // default's).
        let admission = AdmissionConfig::default()
            .with_class(AdmissionClass::new("premium", 1, 4.0))
            .with_class(AdmissionClass::new("regular", 0, 1.0))
            .with_default_class("regular");
        let settings = HostSettings {
            durable: Some(LeaseStreamConfig::new()),
            max_active_leases: LEASE_BOUND,
            admission,
            ..HostSettings::default()
        };
        let host = DeploymentHost::new(connection, settings);
        host.add(&DeploymentName::new("ops").unwrap())
            .await
            .expect("the deployment starts");

        let workers = common::client(&server.url()).await;
        let mut publisher = common::RawPublisher::new(workers.client().clone(), "ops", 1);
        for worker in 1..=WORKERS {
            for request in 0..4 {
                let id = format!("r-{worker}-{request}");
                publisher.send(common::admitted(&id, worker, 256)).await;
                publisher.send(common::progressed(&id, worker)).await;
            }
        }
        publisher.flush().await;

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(
            listener,
            ApiState::new(host.clone()),
            shutdown.clone(),
        ));
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let router = Self {
            _server: server,
            _workers: workers,
            host,
            addr,
            shutdown,
            served,
            client,
        };

        // Until every worker has its bookings (the default class all of them), the replay is
        // done and the lag histogram has the events (polled, bounded).
        let in_flight = format!(
            "lease_router_class_inflight_requests{{deployment=\"ops\",class=\"regular\"}} {}\n",
            WORKERS * 4
        );
        let deadline = tokio::time::Instant::now() + common::BOUND;
        let text = loop {
            let text = get(&router.client, &router.metrics_url()).await;
            let busy_workers = text
                .lines()
                .filter(|l| {
                    l.starts_with("lease_router_worker_active_bookings{") && !l.ends_with(" 0")
                })
                .count();
            if busy_workers == WORKERS as usize
                && text.contains(&in_flight)
                && text.contains("lease_router_catchup_done{deployment=\"ops\"} 1")
                && !text.contains(
                    "lease_router_publish_to_apply_lag_seconds_count{deployment=\"ops\"} 0\n",
                )
            {
                break text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the router did not take the traffic:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            text.contains(&format!(
                "lease_router_max_active_leases{{deployment=\"ops\"}} {LEASE_BOUND}\n"
            )),
            "{text}"
        );
        assert!(text.contains("lease_router_router_tasks_ended{deployment=\"ops\"} 0\n"));
        (router, text)
    }

    fn metrics_url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// Stops the server and every router; checks that no task is left.
    async fn stop(self) {
        self.shutdown.cancel();
        self.served
            .await
            .unwrap()
            .expect("the server stops cleanly");
        tokio::time::timeout(Duration::from_secs(30), self.host.shutdown_all())
            .await
            .expect("shutdown_all ends")
            .expect("clean shutdown");
        assert_eq!(self.host.live_tasks(), 0);
    }
}

/// Every metric that a dashboard query or an alert rule reads is in a running router's
/// `/metrics`, with the labels the query selects and groups by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alerts_use_only_exported_metrics() {
    let (router, text) = TestRouter::start().await;
    let series = scraped_series(&text);
    let mut queries: Vec<(String, String)> = dashboard_queries(&dashboard());
    queries.extend(
        alert_rules()
            .into_iter()
            .map(|(name, expr)| (format!("alert {name}"), expr)),
    );
    let mut problems = Vec::new();
    for (place, query) in &queries {
        let used = selectors(query);
        if used.is_empty() {
            problems.push(format!("{place}: reads no lease_router_ metric: {query}"));
        }
        let mut labels_of_query: BTreeSet<&str> = TARGET_LABELS.into_iter().collect();
        for (name, labels) in &used {
            let Some(exported) = series.get(name) else {
                problems.push(format!("{place}: {name} is not exported"));
                continue;
            };
            labels_of_query.extend(exported.iter().map(String::as_str));
            for label in labels {
                if !exported.contains(label) && !TARGET_LABELS.contains(&label.as_str()) {
                    problems.push(format!("{place}: {name} has no label {label}"));
                }
            }
        }
        for label in grouping_labels(query) {
            if !labels_of_query.contains(label.as_str()) {
                problems.push(format!("{place}: no metric of the query has label {label}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}\n\nscraped:\n{text}",
        problems.join("\n")
    );

    router.stop().await;
}

/// A Prometheus server of the test's own (Debian's `prometheus` package, with promtool),
/// scraping one target every second and evaluating the alert rules every second; killed on
/// drop.
struct Prometheus {
    child: std::process::Child,
    base: String,
    client: reqwest::Client,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    async fn start(target: SocketAddr) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [repo().join(RULES)],
            "scrape_configs": [{
                "job_name": "lease-router",
                "static_configs": [{"targets": [target.to_string()]}],
            }],
        });
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config.to_string()).unwrap();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let port = lease_router_testkit::pick_free_ports(1).unwrap()[0];
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{PROMTOOL_HINT} (prometheus: {e})"));
        let prometheus = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            client: reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap(),
            _dir: dir,
        };
        prometheus
            .until("Prometheus is ready", || async {
                let ready = prometheus
                    .client
                    .get(format!("{}/-/ready", prometheus.base));
                ready.send().await.is_ok_and(|r| r.status().is_success())
            })
            .await;
        prometheus
    }

    /// Polls `check` until it holds, at most [`common::BOUND`]; shows Prometheus's log if not.
    async fn until<F, Fut>(&self, what: &str, check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        if !common::eventually(common::BOUND, check).await {
            let log = std::fs::read_to_string(self._dir.path().join("prometheus.log"));
            panic!(
                "{what}: not within {:?}; log:\n{}",
                common::BOUND,
                log.unwrap_or_default()
            );
        }
    }

    async fn api(&self, path_and_query: &str) -> Value {
        let url = format!("{}/api/v1/{path_and_query}", self.base);
        let body = get_any(&self.client, &url).await;
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: {e}: {body}"))
    }

    /// The answer of an instant query: `Ok(series)`, or `Err(Prometheus's error)`.
    async fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        let answer = self
            .api(&format!("query?query={}", url_encode(promql)))
            .await;
        match answer["status"].as_str() {
            Some("success") => Ok(answer["data"]["result"].as_array().unwrap().clone()),
            _ => Err(answer.to_string()),
        }
    }
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// GET whatever the status: Prometheus answers a bad query with 400 and a JSON error.
async fn get_any(client: &reqwest::Client, url: &str) -> String {
    let response = client.get(url).send().await.expect("GET");
    response.text().await.expect("a body")
}

/// A real Prometheus scraping a running router: every dashboard query answers with series
/// (one that keeps only values above 0 may be empty: nothing of its kind happened), and every
/// alert rule evaluates without error and is neither pending nor firing on the healthy
/// router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_evaluates_dashboard_and_rules_against_a_running_router() {
    let (router, _) = TestRouter::start().await;
    let prometheus = Prometheus::start(router.addr).await;
    let rule_count = alert_rules().len();
    // Rates need two samples in their window; each rule is evaluated at least once.
    prometheus
        .until("a few scrapes and one evaluation of each rule", || async {
            let scrapes = prometheus
                .query("count_over_time(lease_router_nats_connected[1m]) >= 4")
                .await;
            let rules = prometheus.api("rules").await;
            let evaluated = rules["data"]["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["rules"].as_array().unwrap())
                .filter(|r| r["health"] != "unknown")
                .count();
            scrapes.is_ok_and(|s| !s.is_empty()) && evaluated == rule_count
        })
        .await;

    let mut problems = Vec::new();
    for (place, query) in dashboard_queries(&dashboard()) {
        let promql = match query.strip_prefix("label_values(") {
            // The variable's values: the label's values among the metric's series.
            Some(args) => {
                let (metric, label) = args.trim_end_matches(')').split_once(',').unwrap();
                format!("group by ({}) ({metric})", label.trim())
            }
            None => query
                .replace("$__rate_interval", "5s")
                .replace("$deployment", ".*")
                .replace("$instance", ".*"),
        };
        match prometheus.query(&promql).await {
            Ok(series) if series.is_empty() && !promql.trim_end().ends_with("> 0") => {
                problems.push(format!("{place}: no series for {promql}"))
            }
            Ok(_) => {}
            Err(error) => problems.push(format!("{place}: {error}")),
        }
    }
    let rules = prometheus.api("rules").await;
    for group in rules["data"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            if rule["health"] != "ok" || rule["state"] != "inactive" {
                problems.push(format!("rule {}: {rule}", rule["name"]));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    drop(prometheus);
    router.stop().await;
}

// ---------------------------------------------------------------------------------------------
// docker-compose.yml and Kubernetes
// ---------------------------------------------------------------------------------------------

#[test]
fn compose_file_is_valid_and_mounts_existing_files() {
    let plugin = Command::new("docker")
        .args(["compose", "version"])
        .output()
        .is_ok_and(|o| o.status.success());
    let (program, prefix): (&str, &[&str]) = if plugin {
        ("docker", &["compose"])
    } else {
        ("docker-compose", &[])
    };
    for profile in [&[][..], &["--profile", "cluster"][..]] {
        let args: Vec<&str> = [prefix, profile, &["config", "-q"]].concat();
        let output = run(program, &args, COMPOSE_HINT);
        assert_success(&output, &format!("{program} {}", args.join(" ")));
    }
    let compose = read("docker-compose.yml");
    let mounts: Vec<&str> = compose
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- ./"))
        .map(|m| m.split(':').next().unwrap())
        .collect();
    assert!(mounts.len() >= 3, "{mounts:?}");
    for mount in mounts {
        assert!(
            Path::new(&repo().join(mount)).exists(),
            "{mount} is mounted but absent"
        );
    }
}

#[test]
fn kubernetes_manifests_validate() {
    let output = run("python3", &["deploy/kubernetes/validate.py"], PYTHON_HINT);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_ne!(
        output.status.code(),
        Some(3),
        "a validator is missing (`.ci/run` installs it):\n{stderr}"
    );
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for kind in [
        "Deployment",
        "Service",
        "ServiceMonitor",
        "Secret",
        "PodDisruptionBudget",
        "PrometheusRule",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("ok ") && l.contains(&format!(" {kind}/lease-router"))),
            "{kind} validated:\n{stdout}"
        );
    }
}
