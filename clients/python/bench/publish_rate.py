"""Events per second one Python LeasePublisher sustains, one event a message and batched.

Against a running nats-server and a `lease-router serve --deployment bench` on it::

    python bench/publish_rate.py --nats-url nats://127.0.0.1:4222 \
        --router-url http://127.0.0.1:9464 --events 200000

For each mode: one publisher, 8 worker subjects, realistic lifecycles (admitted with 512
prompt tokens, two progressed, completed), published as fast as its queue takes them (the
producer yields to the loop whenever the queue is full, so nothing is dropped), timed from the
first `publish` to the end of `close` (everything flushed); the router's
`events_received_total` must grow by exactly the events published. Prints one JSON line per
mode and round; the median of the rounds is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time

import httpx

from lease_router import Batching, LeasePublisher, Outcome, ProgressStage, connect


def received(router_url: str, deployment: str) -> float:
    text = httpx.get(f"{router_url}/metrics", timeout=5).text
    m = re.search(
        rf'^lease_router_events_received_total\{{deployment="{deployment}"\}} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


async def one_round(
    nats_url: str, router_url: str, deployment: str, events: int, batched: bool
) -> dict[str, object]:
    nc = await connect(nats_url)
    before = received(router_url, deployment)
    publisher = await LeasePublisher.start(nc, deployment, batching=Batching() if batched else None)
    start = time.perf_counter()
    sent = 0
    n = 0
    while sent < events:
        w = n % 8
        rid = f"b{n}"
        for ok in (
            publisher.admitted(rid, w, 0, 512, 128),
            publisher.progressed(rid, w, 0, ProgressStage.PREFILL_DONE, 1),
            publisher.progressed(rid, w, 0, ProgressStage.DECODING, 64),
            publisher.completed(rid, w, 0, Outcome.FINISHED),
        ):
            if not ok:
                raise SystemExit("dropped: the producer must wait for room")
        sent += 4
        n += 1
        if n % 256 == 0:
            # Leave room: the queue holds 8,192; let the task drain it.
            while publisher.stats().pending > 4096:
                await asyncio.sleep(0)
    stats = await publisher.close()
    elapsed = time.perf_counter() - start
    await nc.close()
    deadline = time.monotonic() + 30
    while received(router_url, deployment) - before < sent and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    got = received(router_url, deployment) - before
    return {
        "mode": "batched" if batched else "single",
        "events": sent,
        "seconds": round(elapsed, 3),
        "events_per_s": round(sent / elapsed),
        "messages": stats.batches if batched else sent,
        "router_received": got,
        "dropped": stats.dropped_queue_full + stats.failed,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description="Python LeasePublisher events/s")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--router-url", default="http://127.0.0.1:9464")
    parser.add_argument("--deployment", default="bench")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    medians: dict[str, list[int]] = {"single": [], "batched": []}
    for _ in range(args.rounds):
        for batched in (False, True):
            result = await one_round(
                args.nats_url, args.router_url, args.deployment, args.events, batched
            )
            print(json.dumps(result), flush=True)
            rate = result["events_per_s"]
            assert isinstance(rate, int)
            medians[str(result["mode"])].append(rate)
    print(json.dumps({f"median_{k}": statistics.median(v) for k, v in medians.items()}))


if __name__ == "__main__":
    asyncio.run(main())
