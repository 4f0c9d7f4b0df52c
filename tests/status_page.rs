//! The status page (`GET /`) in a real headless Chromium (Debian's `chromium`, driven over
//! the DevTools protocol by `chromiumoxide`), against the served API of a router fed by a
//! nats-server of the test's own with real lease events. The page is read through its DOM
//! (the `data-*` attributes of src/service/status.html), polled until a deadline, never slept
//! on. Without `chromium` (or `nats-server`) the tests fail with the install hint.
//!
//! `STATUS_PAGE_SCREENSHOT=docs/status-page.png cargo test --test status_page` also writes
//! the screenshot shown in README.md.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use chromiumoxide::browser::{Browser, BrowserConfig};
use chromiumoxide::handler::viewport::Viewport;
use chromiumoxide::page::ScreenshotParams;
use chromiumoxide::Page;
use futures::StreamExt;
use lease_router::service::{
    router, serve, ApiAuth, ApiState, BearerToken, DeploymentHost, HostSettings,
};
use lease_router::wire::Admitted;
use lease_router::{connect, DeploymentName, NatsConnectConfig};
use lease_router_testkit::NatsServer;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use common::RawPublisher;

/// Bound of every poll of the page (it refreshes every second).
const POLL_DEADLINE: Duration = Duration::from_secs(30);
const TOKEN: &str = "page-token-91f3c0";
const INSTALL_HINT: &str = "the status page is tested in a real browser; install it with \
    `apt-get install -y chromium` (Debian/Ubuntu) or `brew install --cask chromium`";

/// The Chromium binary: `$CHROMIUM`, else the first of the usual names on `PATH`.
fn chromium() -> PathBuf {
    if let Some(path) = std::env::var_os("CHROMIUM") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "CHROMIUM={} is not a file: {INSTALL_HINT}",
            path.display()
        );
        return path;
    }
    let names = [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ];
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .flat_map(|dir| names.iter().map(move |name| dir.join(name)))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no Chromium found on PATH (tried {names:?}, or set CHROMIUM=/path/to/chrome): \
                 {INSTALL_HINT}"
            )
        })
}

/// A headless Chromium of the test's own (its own profile directory), and the task that
/// speaks the DevTools protocol with it; [`Chrome::close`] ends both.
struct Chrome {
    browser: Browser,
    handler: JoinHandle<()>,
    _profile: tempfile::TempDir,
}

impl Chrome {
    async fn launch() -> Self {
        let profile = tempfile::tempdir().unwrap();
        let config = BrowserConfig::builder()
            .chrome_executable(chromium())
            .user_data_dir(profile.path())
            // The sandbox needs privileges a container rarely grants; the page is our own.
            .no_sandbox()
            .arg("--disable-gpu")
            .arg("--disable-dev-shm-usage")
            .window_size(1280, 900)
            .viewport(Viewport {
                width: 1280,
                height: 900,
                ..Viewport::default()
            })
            .launch_timeout(Duration::from_secs(60))
            .build()
            .expect("a browser config");
        let (browser, mut handler) = Browser::launch(config).await.unwrap_or_else(|e| {
            panic!(
                "Chromium does not start ({}): {e}; {INSTALL_HINT}",
                chromium().display()
            )
        });
        let handler = tokio::spawn(async move {
            // Ends when the browser's connection closes.
            while handler.next().await.is_some() {}
        });
        Self {
            browser,
            handler,
            _profile: profile,
        }
    }

    async fn open(&self, addr: SocketAddr) -> Page {
        let page = self
            .browser
            .new_page(format!("http://{addr}/"))
            .await
            .expect("the page opens");
        page.wait_for_navigation().await.expect("the page loads");
        page
    }

    async fn close(mut self) {
        self.browser.close().await.expect("the browser closes");
        timeout(Duration::from_secs(20), self.browser.wait())
            .await
            .expect("Chromium exits")
            .expect("Chromium's exit status");
        timeout(Duration::from_secs(20), self.handler)
            .await
            .expect("the DevTools task ends with the browser")
            .unwrap();
    }
}

/// What the page shows, read from its DOM in one go.
const READ_PAGE: &str = r##"JSON.stringify({
  reads: Number(document.getElementById("updated").dataset.reads),
  nats: document.getElementById("nats").dataset.state,
  empty: document.getElementById("empty").classList.contains("shown"),
  auth: document.getElementById("auth").classList.contains("shown"),
  authReason: document.getElementById("auth-reason").textContent,
  errors: [...document.querySelectorAll("#errors [data-field=error]")].map(e => e.textContent),
  errorsShown: document.getElementById("errors").classList.contains("shown"),
  deployments: [...document.querySelectorAll("section.deployment")].map(s => ({
    name: s.dataset.deployment,
    figures: Object.fromEntries([...s.querySelectorAll(".figures [data-field]")]
      .map(f => [f.dataset.field, f.textContent])),
    dropReasons: (s.querySelector("[data-field=drop_reasons]") || {}).textContent,
    classes: [...s.querySelectorAll("tr.class")].map(r => ({
      name: r.dataset.class,
      figures: Object.fromEntries([...r.querySelectorAll("[data-field]")]
        .map(f => [f.dataset.field, f.textContent])),
    })),
    workers: [...s.querySelectorAll("tr.worker")].map(r => ({
      id: r.dataset.worker + "/" + r.dataset.dpRank,
      visible: r.getBoundingClientRect().height > 0,
      kvBar: r.querySelector(".bar.kv span").getBoundingClientRect().width,
      figures: Object.fromEntries([...r.querySelectorAll("[data-field]")]
        .map(f => [f.dataset.field, f.textContent])),
    })),
  })),
})"##;

async fn read(page: &Page) -> Value {
    let text: String = page
        .evaluate(READ_PAGE)
        .await
        .expect("the page can be read")
        .into_value()
        .expect("a string");
    serde_json::from_str(&text).expect("JSON")
}

/// Reads the page until `check` accepts what it shows, at most [`POLL_DEADLINE`].
async fn until<T>(page: &Page, what: &str, check: impl Fn(&Value) -> Option<T>) -> T {
    let deadline = Instant::now() + POLL_DEADLINE;
    loop {
        let shown = read(page).await;
        if let Some(value) = check(&shown) {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not shown within {POLL_DEADLINE:?}; the page shows:\n{shown:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A figure as shown ("1,234"), as a number; `None` for "–".
fn number(text: &Value) -> Option<f64> {
    text.as_str()?
        .replace(',', "")
        .trim_end_matches(" s")
        .parse()
        .ok()
}

fn deployment<'a>(shown: &'a Value, name: &str) -> Option<&'a Value> {
    shown["deployments"]
        .as_array()?
        .iter()
        .find(|d| d["name"] == name)
}

/// The router and its API on a socket.
struct Served {
    _nats: NatsServer,
    nats_url: String,
    host: DeploymentHost,
    addr: SocketAddr,
    shutdown: CancellationToken,
    http: JoinHandle<std::io::Result<()>>,
}

impl Served {
    async fn start(deployments: &[&str], auth: Option<ApiAuth>) -> Self {
        let nats = common::server().await;
        let nats_url = nats.url();
        let config = NatsConnectConfig::new([nats_url.clone()])
            .with_name("status page test")
            .with_connect_deadline(Duration::from_secs(10));
        let connection = connect(&config).await.expect("connect");
        let host = DeploymentHost::new(connection, HostSettings::default());
        for name in deployments {
            host.add(&DeploymentName::new(*name).unwrap())
                .await
                .expect("hosted");
        }
        let mut state = ApiState::new(host.clone());
        if let Some(auth) = auth {
            state = state.with_auth(auth);
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let http = tokio::spawn(serve(listener, state, shutdown.clone()));
        Self {
            _nats: nats,
            nats_url,
            host,
            addr,
            shutdown,
            http,
        }
    }

    async fn stop_http(&mut self) {
        self.shutdown.cancel();
        timeout(Duration::from_secs(20), &mut self.http)
            .await
            .expect("the HTTP server stops")
            .unwrap()
            .unwrap();
    }

    async fn stop(mut self) {
        if !self.http.is_finished() {
            self.stop_http().await;
        }
        timeout(Duration::from_secs(30), self.host.shutdown_all())
            .await
            .expect("shutdown_all ends")
            .expect("clean shutdown");
        assert_eq!(self.host.live_tasks(), 0);
    }
}

/// Simulated workers: one publisher per worker, publishing real lease events.
struct Workers {
    publishers: Vec<(u64, RawPublisher)>,
    next_request: u64,
}

impl Workers {
    async fn new(nats_url: &str, deployment: &str, ids: &[u64]) -> Self {
        let client = common::client(nats_url).await.client().clone();
        let publishers = ids
            .iter()
            .map(|&id| (id, RawPublisher::new(client.clone(), deployment, 1000 + id)))
            .collect();
        Self {
            publishers,
            next_request: 0,
        }
    }

    /// Each worker admits `n` requests of a size that differs by worker, and produces the
    /// first output token of every other one (its prompt leaves the prefill queue).
    async fn admit(&mut self, n: u32) {
        for (id, publisher) in &mut self.publishers {
            for i in 0..n {
                self.next_request += 1;
                let request_id = format!("req-{id}-{}", self.next_request);
                publisher
                    .send(Admitted {
                        // Two blocks of its own prompt: the prefix index shows them.
                        block_hashes: vec![*id << 32 | u64::from(i) << 1, *id << 32 | 1],
                        block_capacity: None,
                        class: None,
                        request_id: request_id.clone(),
                        worker_id: *id,
                        dp_rank: 0,
                        prompt_tokens: 200 * u32::try_from(*id).unwrap() + 37 * i,
                        expected_output_tokens: Some(128),
                        cached_tokens: None,
                    })
                    .await;
                if i % 2 == 1 {
                    publisher.send(common::progressed(&request_id, *id)).await;
                }
            }
            publisher.flush().await;
        }
    }
}

/// Each class's figures as the page shows them, by class name.
fn classes_shown(shown: &Value, name: &str) -> Option<Vec<(String, Value)>> {
    let classes = deployment(shown, name)?["classes"].as_array()?;
    Some(
        classes
            .iter()
            .map(|c| (c["name"].as_str().unwrap().to_owned(), c["figures"].clone()))
            .collect(),
    )
}

/// One figure of one class's row, as a number.
fn class_figure(classes: &[(String, Value)], class: &str, field: &str) -> Option<f64> {
    let (_, figures) = classes.iter().find(|(name, _)| name == class)?;
    number(&figures[field])
}

/// Admission on the page: none until classes are set; then whether the deployment is
/// saturated, and per class its in-flight requests across the fleet (the test workers name
/// no class: the default's, but for one premium request) and what this replica's admission
/// did: admitted, queued, waiting now, refused, abandoned.
async fn admission_is_shown(served: &Served, llama: &mut Workers, page: &Page) {
    use lease_router::{AdmissionClass, AdmissionConfig, QueueConfig, RouteRequest};
    use lease_router::{RouteRequestError, SaturationConfig};
    let none = until(page, "no admission classes", |shown| {
        deployment(shown, "llama-70b")
            .and_then(|d| d["figures"]["admission"].as_str().map(str::to_owned))
    })
    .await;
    assert_eq!(none, "no classes");
    let name = DeploymentName::new("llama-70b").unwrap();
    let scheduler = served.host.get(&name).unwrap().scheduler().clone();
    let admission = AdmissionConfig::default()
        .with_class(AdmissionClass::new("premium", 1, 4.0))
        .with_class(AdmissionClass::new("regular", 0, 1.0))
        .with_default_class("regular")
        .with_queue(
            QueueConfig::default()
                .with_max_queued(1)
                .with_max_wait_ms(60_000),
        );
    scheduler.set_admission(admission.clone()).unwrap();
    // Not saturated: both classes are routed.
    for (id, class) in [("p0", "premium"), ("r0", "regular")] {
        let routed = scheduler
            .route(RouteRequest::new(id, 10).with_class(class))
            .await;
        assert!(routed.is_ok(), "{id}: {routed:?}");
    }
    // A premium request of another replica's, admitted by its worker: premium has work in
    // flight that stays (the provisional bookings above expire unconfirmed).
    let (worker_id, publisher) = &mut llama.publishers[0];
    publisher
        .send(Admitted {
            block_hashes: Vec::new(),
            block_capacity: None,
            class: Some("premium".into()),
            request_id: "other-replica".into(),
            worker_id: *worker_id,
            dp_rank: 0,
            prompt_tokens: 50,
            expected_output_tokens: Some(10),
            cached_tokens: None,
        })
        .await;
    publisher.flush().await;
    let shown = until(page, "the classes in flight", |shown| {
        let classes = classes_shown(shown, "llama-70b")?;
        (class_figure(&classes, "premium", "admitted") == Some(1.0)
            // The workers' 12, and this replica's r0 until it expires unconfirmed.
            && (12.0..=13.0).contains(&class_figure(&classes, "regular", "in_flight_requests")?)
            && (1.0..=2.0).contains(&class_figure(&classes, "premium", "in_flight_requests")?))
        .then(|| shown.clone())
    })
    .await;
    assert_eq!(
        deployment(&shown, "llama-70b").unwrap()["figures"]["admission"],
        "not saturated"
    );

    // Saturated by any prefill waiting: regular (alone in band 0, all of its tokens) may not
    // go, nor may premium (alone in band 1); one premium request waits, the queue's bound.
    scheduler
        .set_admission(
            admission
                .clone()
                .with_saturation(SaturationConfig::default().with_max_prefill_tokens_per_worker(0)),
        )
        .unwrap();
    let refused = scheduler
        .route(
            RouteRequest::new("r1", 10)
                .with_class("regular")
                .with_max_wait_ms(0),
        )
        .await;
    assert!(
        matches!(refused, Err(RouteRequestError::Overloaded { .. })),
        "{refused:?}"
    );
    let waiting = {
        let scheduler = scheduler.clone();
        tokio::spawn(async move {
            scheduler
                .route(RouteRequest::new("p1", 10).with_class("premium"))
                .await
        })
    };
    until(page, "a premium request waiting", |shown| {
        let classes = classes_shown(shown, "llama-70b")?;
        (class_figure(&classes, "premium", "waiting") == Some(1.0)).then_some(())
    })
    .await;
    // The queue is full: the next one (behind the higher band anyway) is refused at once.
    let refused = scheduler
        .route(RouteRequest::new("r2", 10).with_class("regular"))
        .await;
    assert!(
        matches!(refused, Err(RouteRequestError::Overloaded { .. })),
        "{refused:?}"
    );
    let shown = until(page, "the refusals", |shown| {
        let classes = classes_shown(shown, "llama-70b")?;
        (class_figure(&classes, "regular", "refused") == Some(2.0)).then(|| shown.clone())
    })
    .await;
    let classes = classes_shown(&shown, "llama-70b").unwrap();
    let figures = |class: &str| {
        ["admitted", "queued", "waiting", "refused", "abandoned"]
            .map(|field| class_figure(&classes, class, field).unwrap())
    };
    assert_eq!(figures("premium"), [1.0, 1.0, 1.0, 0.0, 0.0], "{shown:#}");
    assert_eq!(figures("regular"), [1.0, 0.0, 0.0, 2.0, 0.0], "{shown:#}");
    assert_eq!(
        deployment(&shown, "llama-70b").unwrap()["figures"]["admission"],
        "saturated"
    );
    // Its caller goes away: it leaves the queue.
    waiting.abort();
    until(page, "the abandoned request", |shown| {
        let classes = classes_shown(shown, "llama-70b")?;
        (class_figure(&classes, "premium", "abandoned") == Some(1.0)
            && class_figure(&classes, "premium", "waiting") == Some(0.0))
        .then_some(())
    })
    .await;
    // Back to the default saturation thresholds for the rest of the test.
    scheduler.set_admission(admission).unwrap();
}

async fn with_deadline<T>(what: &str, future: impl Future<Output = T>) -> T {
    timeout(POLL_DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {POLL_DEADLINE:?}"))
}

/// The page is one self-contained document: nothing from elsewhere, and a policy that would
/// block it anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_self_contained() {
    let nats = common::server().await;
    let connection = common::client(&nats.url()).await;
    let host = DeploymentHost::new(connection, HostSettings::default());
    let app = router(ApiState::new(host));
    let response = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let header = |name: &str| response.headers()[name].to_str().unwrap().to_owned();
    assert_eq!(header("content-type"), "text/html; charset=utf-8");
    let csp = header("content-security-policy");
    assert!(csp.starts_with("default-src 'none';"), "{csp}");
    assert!(csp.contains("connect-src 'self'"), "{csp}");
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let html = String::from_utf8(body.to_vec()).unwrap();
    assert!(html.starts_with("<!doctype html>"));
    for external in ["http://", "https://", " src=", "<link", "@import", "url("] {
        assert!(!html.contains(external), "the page refers to {external:?}");
    }
}

/// Every worker of every deployment is shown with its load, and the figures move with the
/// events: two reads of the page differ for every worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_every_worker_and_its_figures_change() {
    let served = Served::start(&["llama-70b", "mixtral"], None).await;
    let mut llama = Workers::new(&served.nats_url, "llama-70b", &[1, 2, 3, 4]).await;
    let mut mixtral = Workers::new(&served.nats_url, "mixtral", &[7, 8]).await;
    llama.admit(3).await;
    mixtral.admit(2).await;
    // One event that is not one, to show a drop.
    let garbage = RawPublisher::new(llama.publishers[0].1.client.clone(), "llama-70b", 9);
    garbage
        .send_bytes("leases.llama-70b.1".into(), b"not msgpack".to_vec())
        .await;
    garbage.flush().await;

    let chrome = Chrome::launch().await;
    let page = chrome.open(served.addr).await;
    // (deployment, workers, bookings of each worker)
    let expected = [("llama-70b", 4, 3.0), ("mixtral", 2, 2.0)];
    let first = until(&page, "every worker with its load and the drop", |shown| {
        let all = expected.iter().all(|(name, workers, bookings)| {
            deployment(shown, name).is_some_and(|d| {
                let rows = d["workers"].as_array().unwrap();
                rows.len() == *workers
                    && rows
                        .iter()
                        .all(|w| number(&w["figures"]["active_bookings"]) == Some(*bookings))
            })
        });
        let dropped = deployment(shown, "llama-70b")
            .and_then(|d| number(&d["figures"]["dropped"]))
            .is_some_and(|n| n >= 1.0);
        (all && dropped).then(|| shown.clone())
    })
    .await;
    // Each llama worker holds its first block and the second of each of its 3 prompts.
    let llama_prefix = until(&page, "the prefix index", |shown| {
        deployment(shown, "llama-70b")
            .and_then(|d| number(&d["figures"]["prefix_entries"]))
            .filter(|&n| n == 4.0 * 4.0)
    })
    .await;
    assert_eq!(llama_prefix, 16.0);
    admission_is_shown(&served, &mut llama, &page).await;
    // Its five route requests (two routed, two refused, one queued) were decisions the
    // scheduler made and timed; mixtral's scheduler made none.
    let p99 = until(&page, "the route decisions", |shown| {
        let figures = &deployment(shown, "llama-70b")?["figures"];
        (number(&figures["route_decisions"]) == Some(5.0))
            .then(|| figures["decision_p99"].as_str().unwrap_or("").to_owned())
    })
    .await;
    assert!(p99.starts_with("≤ ") && p99.ends_with('s'), "{p99}");
    let mixtral_figures = until(&page, "mixtral's figures", |shown| {
        deployment(shown, "mixtral").map(|d| d["figures"].clone())
    })
    .await;
    assert_eq!(
        (
            &mixtral_figures["route_decisions"],
            &mixtral_figures["decision_p99"]
        ),
        (&Value::from("0"), &Value::from("–")),
        "{mixtral_figures:#}"
    );
    assert_eq!(first["nats"], "connected", "{first:#}");
    assert_eq!(first["errors"], serde_json::json!([]), "{first:#}");
    assert_eq!(first["empty"], false);
    let llama_shown = deployment(&first, "llama-70b").unwrap();
    assert!(
        llama_shown["dropReasons"]
            .as_str()
            .unwrap()
            .contains("decode 1"),
        "{llama_shown:#}"
    );
    for (name, _, _) in expected {
        for worker in deployment(&first, name).unwrap()["workers"]
            .as_array()
            .unwrap()
        {
            assert_eq!(worker["visible"], true, "{worker:#}");
            assert!(
                worker["kvBar"].as_f64().unwrap() > 0.0,
                "a bar drawn: {worker:#}"
            );
        }
    }

    // More events: every worker's figures move, and the rate shows them.
    llama.admit(2).await;
    mixtral.admit(2).await;
    let second = until(&page, "every worker's figures changed", |shown| {
        let all_changed = expected.iter().all(|(name, workers, _)| {
            let (Some(now), Some(before)) = (deployment(shown, name), deployment(&first, name))
            else {
                return false;
            };
            let rows = now["workers"].as_array().unwrap();
            rows.len() == *workers
                && rows.iter().all(|w| {
                    before["workers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|b| b["id"] == w["id"])
                        .is_some_and(|b| b["figures"]["kv_tokens"] != w["figures"]["kv_tokens"])
                })
        });
        all_changed.then(|| shown.clone())
    })
    .await;
    for (name, _, _) in expected {
        let before = deployment(&first, name).unwrap();
        let after = deployment(&second, name).unwrap();
        assert!(
            number(&after["figures"]["received"]) > number(&before["figures"]["received"]),
            "{name}: {before:#} then {after:#}"
        );
    }
    until(&page, "a rate of events", |shown| {
        deployment(shown, "llama-70b")
            .and_then(|d| number(&d["figures"]["events_per_second"]))
            .filter(|&rate| rate > 0.0)
    })
    .await;

    if let Some(path) = std::env::var_os("STATUS_PAGE_SCREENSHOT") {
        page.save_screenshot(ScreenshotParams::builder().full_page(true).build(), &path)
            .await
            .expect("a screenshot");
        eprintln!("screenshot written to {}", PathBuf::from(path).display());
    }
    chrome.close().await;
    served.stop().await;
}

/// No deployment: the page says so, without an error; then the API goes away, and the page
/// says that instead of showing stale figures as current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_router_renders_and_api_errors_are_reported() {
    let mut served = Served::start(&[], None).await;
    let chrome = Chrome::launch().await;
    let page = chrome.open(served.addr).await;
    let shown = until(&page, "a read of the empty router", |shown| {
        (shown["reads"].as_u64() >= Some(2)).then(|| shown.clone())
    })
    .await;
    assert_eq!(shown["empty"], true, "{shown:#}");
    assert_eq!(shown["deployments"], serde_json::json!([]), "{shown:#}");
    assert_eq!(shown["errors"], serde_json::json!([]), "{shown:#}");
    assert_eq!(shown["nats"], "connected");
    assert_eq!(shown["auth"], false);

    served.stop_http().await;
    let shown = until(&page, "the API error", |shown| {
        let errors = shown["errors"].as_array()?;
        errors
            .iter()
            .any(|e| e.as_str().unwrap().contains("does not answer"))
            .then(|| shown.clone())
    })
    .await;
    assert_eq!(shown["errorsShown"], true, "{shown:#}");
    chrome.close().await;
    served.stop().await;
}

/// Reads protected: the page asks for the token, says when it is refused, and shows the
/// deployments once it has the right one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_protected_reads_the_page_asks_for_the_token() {
    let auth = ApiAuth::new(BearerToken::new(TOKEN).unwrap()).protect_reads(true);
    let served = Served::start(&["guarded"], Some(auth)).await;
    let mut workers = Workers::new(&served.nats_url, "guarded", &[5]).await;
    workers.admit(1).await;
    let chrome = Chrome::launch().await;
    let page = chrome.open(served.addr).await;
    let shown = until(&page, "the token prompt", |shown| {
        (shown["auth"] == true).then(|| shown.clone())
    })
    .await;
    assert_eq!(shown["deployments"], serde_json::json!([]), "{shown:#}");
    // NATS state comes from /healthz, a probe: shown without the token.
    until(&page, "the NATS state", |shown| {
        (shown["nats"] == "connected").then_some(())
    })
    .await;

    let enter = |token: &str| {
        format!(
            "document.getElementById('token').value = {token:?}; \
             document.getElementById('auth').requestSubmit(); true"
        )
    };
    with_deadline("typing a wrong token", page.evaluate(enter("not-it")))
        .await
        .unwrap();
    until(&page, "the refusal", |shown| {
        (shown["auth"] == true && shown["authReason"] == "that token was refused").then_some(())
    })
    .await;
    with_deadline("typing the token", page.evaluate(enter(TOKEN)))
        .await
        .unwrap();
    let shown = until(&page, "the deployment behind the token", |shown| {
        let guarded = deployment(shown, "guarded")?;
        (shown["auth"] == false && guarded["workers"].as_array()?.len() == 1).then(|| shown.clone())
    })
    .await;
    assert_eq!(shown["errors"], serde_json::json!([]), "{shown:#}");
    chrome.close().await;
    served.stop().await;
}
