"""The engine hook: the right event at each step, and the runnable example against the router."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
from typing import Any

from conftest import NatsServer, Router, wait_until
from nats.aio.client import Client as NatsClient
from test_publisher import Tap

from lease_router import LeaseHook, LeasePublisher, Outcome, block_hashes

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fake_engine.py"


async def test_each_callback_publishes_its_event(nc: NatsClient) -> None:
    tap = await Tap.on(nc, "hook")
    publisher = await LeasePublisher.start(nc, "hook")
    now = [100.0]
    hook = LeaseHook(
        publisher, 8, block_size=16, block_capacity=777, progress_interval=2.0, clock=lambda: now[0]
    )
    hook.on_engine_start(dp_ranks=[0, 1])
    prompt = list(range(16 * 300))  # 300 blocks: the first 256 go
    hook.on_request_admitted("h1", prompt, dp_rank=1, expected_output_tokens=50, cached_tokens=32)
    assert hook.live_requests == 1
    hook.on_first_token("h1")
    for produced in range(2, 36):
        now[0] += 0.125  # 4.25 s of decoding: a renewal every 2 s, two
        hook.on_tokens("h1", produced)
    hook.on_request_finished("h1", Outcome.CANCELLED)
    assert not hook.on_request_finished("h1")  # once
    assert not hook.on_tokens("h1", 41)
    hook.on_engine_stop()
    await publisher.close()

    events = await tap.wait(8)
    kinds = [(e["kind"], e.get("stage")) for e in events]
    assert kinds == [
        ("worker_reset", None),
        ("worker_reset", None),
        ("admitted", None),
        ("progressed", "prefill_done"),
        ("progressed", "decoding"),
        ("progressed", "decoding"),
        ("completed", None),
        ("worker_reset", None),
    ]
    assert [e.get("dp") for e in events[:2]] == [0, 1]
    admitted = events[2]
    assert admitted["ptok"] == 4800 and admitted["ctok"] == 32 and admitted["etok"] == 50
    assert admitted["dp"] == 1 and admitted["bcap"] == 777
    assert admitted["blk"] == block_hashes(prompt)[:256]
    assert [events[4]["otok"], events[5]["otok"]] == [17, 33]  # 2 s and 4 s after prefill
    assert events[6]["outcome"] == "cancelled" and events[6]["dp"] == 1
    assert events[7]["leaving"] is True and "dp" not in events[7]
    assert len(tap.messages) == 8


async def test_the_fake_engine_example_runs_against_the_router(
    nats_server: NatsServer, make_router: Any
) -> None:
    d = "example"
    router: Router = make_router([d], "--http-token", "tok")
    requests, workers = 40, 3
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE),
        "--nats-url",
        nats_server.url,
        "--router-url",
        router.url,
        "--token",
        "tok",
        "--deployment",
        d,
        "--workers",
        str(workers),
        "--requests",
        str(requests),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert sum(summary["requests"].values()) == requests
    assert summary["dropped"] == 0
    assert summary["cached_tokens"] > 0, "follow-up turns found their prefix cached"

    def applied(kind: str) -> float:
        return router.metric("events_applied_total", deployment=d, kind=kind)

    await wait_until("every completion applied", lambda: applied("completed") == requests)
    assert applied("admitted") == requests
    assert applied("progressed") >= requests  # prefill_done each, renewals besides
    assert applied("worker_reset") == 2 * workers  # start and leave
    assert router.metric("events_dropped_total", deployment=d) == 0
    assert router.metric("active_leases", deployment=d) == 0
    assert router.metric("workers_left_total", deployment=d) == workers
    assert router.metric("route_decisions_total", deployment=d, outcome="routed") == requests
    # Every routed admission reported ctok, and the router compared it with its prediction.
    assert router.metric("prefix_compared_admissions_total", deployment=d) == requests
    assert (
        router.metric("prefix_reported_cached_tokens_total", deployment=d)
        == summary["cached_tokens"]
    )
    assert router.metric("events_received_total", deployment=d) == summary["events"]
