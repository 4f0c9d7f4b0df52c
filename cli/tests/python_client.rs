//! The Python package (`clients/python/`, `lease-router` on PyPI's naming, import
//! `lease_router`) built, installed and tested the way its users get it: a wheel (and sdist)
//! made with `python -m build`, installed into a fresh virtual environment in a temporary
//! directory (its dependencies from PyPI), then its pytest suite run from there against real
//! `nats-server` processes and this crate's `lease-router serve` binary, `mypy --strict` on the
//! installed package, the tests and the examples, and `ruff` (lint and format).
//!
//! The tools (build and its backend hatchling, pytest, pytest-asyncio, mypy, ruff) come from
//! the project's `.tools/venv` (`scripts/tools`, PYTHON_PACKAGES; `scripts/test` installs them),
//! else from the `python3` on PATH. The fresh environment sees them through a `.pth` line
//! added after the wheel is installed and checked on its own, so the package and its
//! dependencies are the wheel's, never the tools'. A missing tool fails the test with how to
//! get it; any failing step fails it with that step's output.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_lease-router");

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ is in the workspace")
        .to_path_buf()
}

/// The Python with the test tools: `.tools/venv`'s, else `python3` on PATH.
fn tools_python() -> PathBuf {
    let venv = workspace().join(".tools/venv/bin/python3");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

fn show(output: &Output) -> String {
    format!(
        "exit: {}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `cmd`; panics naming `step`, with its output, unless it succeeds.
fn run(step: &str, cmd: &mut Command) -> Output {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{step}: could not run {cmd:?}: {e}"));
    assert!(output.status.success(), "{step} failed\n{}", show(&output));
    output
}

fn stdout_line(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// The directory of pure-Python packages (`site-packages`) of `python`.
fn purelib(python: &Path) -> String {
    stdout_line(&run(
        "finding site-packages",
        Command::new(python).args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ]),
    ))
}

#[test]
fn python_package_builds_installs_and_passes_its_suite_mypy_and_ruff() {
    let root = workspace();
    let package = root.join("clients/python");
    let python = tools_python();
    let nats_server = lease_router_testkit::nats_server_binary().unwrap_or_else(|| {
        panic!(
            "nats-server was not found (NATS_SERVER_BIN, PATH, .tools/): `scripts/test` gets \
             one, or `scripts/tools nats-server`"
        )
    });

    let probe = Command::new(&python)
        .args([
            "-c",
            "import build, hatchling, pytest, pytest_asyncio, mypy, ruff, venv",
        ])
        .output();
    match probe {
        Ok(output) if output.status.success() => {}
        Ok(output) => panic!(
            "the Python test tools are missing from {}: `scripts/test` installs them into \
             .tools/venv (scripts/tools, PYTHON_PACKAGES), or `{} -m pip install build \
             hatchling pytest pytest-asyncio mypy ruff`\n{}",
            python.display(),
            python.display(),
            show(&output)
        ),
        Err(e) => {
            panic!("python3 does not run ({e}): install python3 (with venv), then `scripts/test`")
        }
    }

    let tmp = tempfile::tempdir().expect("a temporary directory");
    let dist = tmp.path().join("dist");
    // The sdist, then the wheel from it: what the sdist leaves out, the wheel lacks too.
    // No isolation: the backend is the pinned hatchling of the tools, no download.
    run(
        "python -m build",
        Command::new(&python)
            .args(["-m", "build", "--no-isolation", "--outdir"])
            .arg(&dist)
            .arg(&package)
            .env("PYTHONDONTWRITEBYTECODE", "1"),
    );
    let wheel = std::fs::read_dir(&dist)
        .expect("dist/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .expect("python -m build made a wheel");
    let name = wheel.file_name().unwrap().to_string_lossy().to_string();
    // The contract's version is its title's: "# ... (version MAJOR.MINOR)".
    let contract =
        std::fs::read_to_string(workspace().join("schemas/README.md")).expect("schemas/README.md");
    let version = contract
        .lines()
        .next()
        .and_then(|title| title.rsplit_once("(version "))
        .and_then(|(_, v)| v.strip_suffix(')'))
        .expect("schemas/README.md's title names the contract's version");
    assert!(
        name.starts_with(&format!("lease_router-{version}.")),
        "{name}: versioned with wire {version}"
    );

    // A clean environment: the wheel and its dependencies only.
    let venv = tmp.path().join("venv");
    run(
        "python -m venv",
        Command::new(&python).args(["-m", "venv"]).arg(&venv),
    );
    let vpython = venv.join("bin/python");
    run(
        "pip install the wheel (dependencies from PyPI)",
        Command::new(&vpython)
            .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
            .arg(&wheel)
            .env("PIP_ROOT_USER_ACTION", "ignore"),
    );
    run(
        "pip check",
        Command::new(&vpython).args(["-m", "pip", "check"]),
    );
    let site = purelib(&vpython);
    run(
        "importing the installed package and its dependencies",
        Command::new(&vpython)
            .args([
                "-c",
                "import sys, lease_router, nats, msgpack, httpx, xxhash, importlib.resources as r; \
                 assert lease_router.__file__.startswith(sys.argv[1]), lease_router.__file__; \
                 assert r.files('lease_router').joinpath('py.typed').is_file(); \
                 assert lease_router.__version__.startswith(lease_router.CONTRACT_VERSION + '.')",
            ])
            .arg(&site)
            .current_dir(tmp.path()),
    );
    // Now the tools, after the environment's own packages on sys.path.
    let tools_site = purelib(&python);
    std::fs::write(
        Path::new(&site).join("zz_lease_router_tools.pth"),
        tools_site + "\n",
    )
    .expect("writing the .pth");

    let in_venv = |args: &[&str]| {
        let mut cmd = Command::new(&vpython);
        cmd.args(args)
            .current_dir(&package)
            .env("NATS_SERVER_BIN", &nats_server)
            .env("LEASE_ROUTER_BIN", BIN)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            // Only the plugins named: the tools' environment holds others (cloudcoil's).
            .env("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
            .env("MYPYPATH", package.join("tests"))
            .env_remove("PYTHONPATH")
            .env_remove("NATS_URL");
        cmd
    };
    let mypy_cache = tmp.path().join("mypy-cache");
    let mypy_cache = mypy_cache.to_str().unwrap();

    let pytest = run(
        "pytest (clients/python/tests against nats-server and lease-router serve)",
        &mut in_venv(&[
            "-m",
            "pytest",
            "-p",
            "pytest_asyncio.plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "tests",
        ]),
    );
    let summary = stdout_line(&pytest);
    println!("{summary}");
    assert!(
        summary.contains(" passed") && !summary.contains("skipped"),
        "every test ran: {summary}"
    );
    run(
        "mypy --strict on the installed package",
        &mut in_venv(&[
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            mypy_cache,
            "-p",
            "lease_router",
        ]),
    );
    run(
        "mypy --strict on the tests, examples and bench",
        &mut in_venv(&[
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            mypy_cache,
            "tests",
            "examples",
            "bench",
        ]),
    );
    run(
        "ruff check",
        &mut in_venv(&["-m", "ruff", "check", "--no-cache", "."]),
    );
    run(
        "ruff format --check",
        &mut in_venv(&["-m", "ruff", "format", "--check", "--no-cache", "."]),
    );
}
