"""Real processes for the tests: a nats-server and a `lease-router serve`, each on free ports.

Nothing of NATS is mocked. `nats-server` is `$NATS_SERVER_BIN`, else the one on PATH; the
router is `$LEASE_ROUTER_BIN`, else the workspace's `target/debug/lease-router`. A missing one
fails the test with how to get it (none skips). `cli/tests/python_client.rs` runs this suite
with both set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NatsClient

REPO = pathlib.Path(__file__).resolve().parents[3]
FIXTURES = REPO / "schemas" / "fixtures"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def nats_server_bin() -> str:
    env = os.environ.get("NATS_SERVER_BIN")
    if env:
        return env
    found = shutil.which("nats-server")
    if found:
        return found
    pytest.fail(
        "nats-server not found: set NATS_SERVER_BIN or put it on PATH "
        "(scripts/tools nats-server gets one into .tools/)"
    )


def router_bin() -> str:
    env = os.environ.get("LEASE_ROUTER_BIN")
    if env:
        return env
    built = REPO / "target" / "debug" / "lease-router"
    if built.exists():
        return str(built)
    pytest.fail("lease-router not found: set LEASE_ROUTER_BIN or `cargo build -p lease-router-cli`")


class NatsServer:
    """One nats-server on loopback, JetStream on with its own store directory."""

    def __init__(self, jetstream: bool = True) -> None:
        self.dir = tempfile.mkdtemp(prefix="lr-py-nats-")
        self.port = 0
        self.jetstream = jetstream
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        for _ in range(5):
            self.port = free_port()
            args = [nats_server_bin(), "-a", "127.0.0.1", "-p", str(self.port)]
            if self.jetstream:
                args += ["-js", "-sd", os.path.join(self.dir, "store")]
            log = open(os.path.join(self.dir, "log"), "ab")  # noqa: SIM115
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn,
                ):
                    if conn.recv(4).startswith(b"INFO"):
                        return
                time.sleep(0.02)
            self.stop()
        raise RuntimeError(f"nats-server did not start; log:\n{self.log()}")

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return pathlib.Path(self.dir, "log").read_text(errors="replace")[-3000:]
        return ""

    def pause(self) -> None:
        """Freezes the server (SIGSTOP): connections stay open, nothing is read."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Router:
    """`lease-router serve` on a free HTTP port, for the deployments given."""

    def __init__(self, nats_url: str, deployments: list[str], *extra: str) -> None:
        self.deployments = deployments
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        args = [
            router_bin(),
            "serve",
            "--nats-url",
            nats_url,
            "--http-addr",
            "127.0.0.1:0",
            "--connect-deadline",
            "10s",
            *[a for d in deployments for a in ("--deployment", d)],
            *extra,
        ]
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        match = re.search(r"listening on (http://\S+)", line)
        if not match:
            self.proc.kill()
            self.stderr.seek(0)
            raise RuntimeError(f"serve did not start: {line!r}\n{self.stderr.read().decode()}")
        self.url = match.group(1)

    def metrics_text(self, token: str | None = None) -> str:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.get(f"{self.url}/metrics", headers=headers, timeout=5)
        response.raise_for_status()
        return response.text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `lease_router_{name}` over the series whose labels include `labels`."""
        return metric(self.metrics_text(), name, **labels)

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", timeout=5)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


_SERIES = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$")


def metric(text: str, name: str, **labels: str) -> float:
    full = f"lease_router_{name}"
    total = 0.0
    found = False
    for line in text.splitlines():
        m = _SERIES.match(line)
        if not m or m.group(1) != full:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found:
        raise KeyError(f"no series {full} with {labels}")
    return total


async def wait_until(what: str, check: Any, timeout: float = 10.0) -> Any:
    """Polls `check()` (sync) until it is truthy; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = await asyncio.to_thread(check)
        except (KeyError, httpx.HTTPError) as err:
            last = err
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what} (last: {last!r})")
        await asyncio.sleep(0.05)


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def make_router(nats_server: NatsServer) -> Iterator[Any]:
    routers: list[Router] = []

    def make(deployments: list[str], *extra: str) -> Router:
        router = Router(nats_server.url, deployments, *extra)
        routers.append(router)
        return router

    try:
        yield make
    finally:
        for router in routers:
            router.close()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.close()
