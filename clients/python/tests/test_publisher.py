"""The publisher against a real nats-server and a real `lease-router serve`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import nats
from conftest import NatsServer, Router, wait_until
from nats.aio.client import Client as NatsClient

from lease_router import (
    Batching,
    LeasePublisher,
    Outcome,
    ProgressStage,
    PublisherClosedError,
    block_hashes,
)
from lease_router.wire import BATCH_PREFIX, decode_message


class Tap:
    """A raw subscriber on a deployment's subjects: every message as it was on the wire."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []

    @classmethod
    async def on(cls, nc: NatsClient, deployment: str) -> Tap:
        tap = cls()

        async def take(msg: Any) -> None:
            tap.messages.append((msg.subject, msg.data))

        await nc.subscribe(f"leases.{deployment}.>", cb=take)
        await nc.flush()
        return tap

    def events(self) -> list[dict[str, Any]]:
        return [e for _, data in self.messages for e in decode_message(data)]

    async def wait(self, events: int, timeout: float = 10) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.events()) < events and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        got = self.events()
        assert len(got) >= events, f"{len(got)} of {events} events arrived"
        return got


def worker(router: Router, deployment: str, worker_id: int, dp: int = 0) -> dict[str, Any] | None:
    for w in router.get(f"/v1/deployments/{deployment}/workers")["workers"]:
        if w["worker_id"] == worker_id and w["dp_rank"] == dp:
            return dict(w)
    return None


async def test_every_event_kind_is_applied_by_the_router(make_router: Any, nc: NatsClient) -> None:
    d = "kinds"
    router: Router = make_router([d])
    tap = await Tap.on(nc, d)
    publisher = await LeasePublisher.start(nc, d)

    assert publisher.worker_reset(3)
    tokens = list(range(1000, 1000 + 40))  # two full blocks of 16
    hashes = block_hashes(tokens)
    assert publisher.admitted(
        "r-1", 3, 1, 40, 64, cached_tokens=16, block_hashes=hashes, block_capacity=25_000
    )
    await publisher.flush()
    w = await wait_until("r-1 admitted", lambda: worker(router, d, 3, 1))
    assert (w["active_bookings"], w["prompt_tokens"], w["expected_output_tokens"]) == (1, 40, 64)
    assert w["prefill_tokens"] == 40 - 16  # ctok counted
    assert router.metric("prefix_index_entries", deployment=d) == 2  # blk learned

    assert publisher.prefill_done("r-1", 3, 1)
    await publisher.flush()
    w = await wait_until(
        "prefill done", lambda: (x := worker(router, d, 3, 1)) and x["prefill_tokens"] == 0 and x
    )
    assert w["kv_tokens"] == 41

    assert publisher.progressed("r-1", 3, 1, ProgressStage.DECODING, 17)
    await publisher.flush()
    w = await wait_until(
        "decoding", lambda: (x := worker(router, d, 3, 1)) and x["kv_tokens"] == 57 and x
    )
    assert w["remaining_output_tokens"] == 64 - 17

    assert publisher.completed("r-1", 3, 1, Outcome.FINISHED)
    # A reset of one rank drops only that rank's leases.
    publisher.admitted("r-2", 3, 0, 10)
    publisher.admitted("r-3", 3, 1, 10)
    publisher.worker_reset(3, 1)
    publisher.worker_left(3)
    stats = await publisher.close()
    assert (stats.queued, stats.published, stats.failed, stats.pending) == (9, 9, 0, 0)

    def applied() -> dict[str, float]:
        return {
            k: router.metric("events_applied_total", deployment=d, kind=k)
            for k in ("admitted", "progressed", "completed", "worker_reset")
        }

    await wait_until(
        "every event applied",
        lambda: applied() == {"admitted": 3, "progressed": 2, "completed": 1, "worker_reset": 3},
    )
    assert router.metric("events_dropped_total", deployment=d) == 0
    assert router.metric("active_leases", deployment=d) == 0
    assert router.metric("workers_left_total", deployment=d) == 2  # both ranks
    assert router.metric("prefix_forgotten_entries_total", deployment=d) >= 2
    assert worker(router, d, 3, 0) is None  # left

    # On the wire: one publisher id, sequence 1..9 in order, each event as the contract says.
    events = await tap.wait(9)
    assert [e["seq"] for e in events] == list(range(1, 10))
    assert {e["pub"] for e in events} == {publisher.publisher_id}
    assert all(s == "leases.kinds.3" for s, _ in tap.messages)
    assert [e["kind"] for e in events][:5] == [
        "worker_reset",
        "admitted",
        "progressed",
        "progressed",
        "completed",
    ]
    assert events[1]["blk"] == hashes and events[1]["bcap"] == 25_000
    assert events[-1]["leaving"] is True
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts) and abs(ts[0] / 1e6 - time.time()) < 60
    with_closed = False
    try:
        publisher.worker_reset(3)
    except PublisherClosedError:
        with_closed = True
    assert with_closed


async def test_a_new_publisher_has_a_new_id_and_starts_at_one(
    make_router: Any, nc: NatsClient
) -> None:
    tap = await Tap.on(nc, "ids")
    first = await LeasePublisher.start(nc, "ids")
    second = await LeasePublisher.start(nc, "ids")
    assert first.publisher_id != second.publisher_id
    first.worker_reset(1)
    second.worker_reset(2)
    await first.close()
    await second.close()
    events = await tap.wait(2)
    assert sorted((e["pub"], e["seq"]) for e in events) == sorted(
        [(first.publisher_id, 1), (second.publisher_id, 1)]
    )


async def test_batches_are_applied_event_by_event(make_router: Any, nc: NatsClient) -> None:
    d = "batches"
    router: Router = make_router([d])
    tap = await Tap.on(nc, d)
    publisher = await LeasePublisher.start(nc, d, batching=Batching())
    n = 600
    for w in (1, 2):
        publisher.worker_reset(w)
        for i in range(n):
            publisher.admitted(f"r-{w}-{i}", w, 0, 512)
            publisher.completed(f"r-{w}-{i}", w, 0, Outcome.FINISHED)
    total = 2 * (1 + 2 * n)
    stats = await publisher.close()
    assert (stats.published, stats.failed) == (total, 0)
    await wait_until(
        "every event applied",
        lambda: router.metric("events_applied_total", deployment=d) == total,
    )
    assert router.metric("events_dropped_total", deployment=d) == 0
    batches = router.metric("batches_received_total", deployment=d)
    assert batches == stats.batches
    # 2,402 events in at least ceil(1201 / 256) = 5 messages per subject, at most 256 each.
    assert 10 <= batches < total / 50

    await tap.wait(total)
    seqs: list[int] = []
    for subject, data in tap.messages:
        events = decode_message(data)
        assert len(events) <= 256
        assert len(data) <= 64 * 1024
        if len(events) > 1:
            assert data.startswith(BATCH_PREFIX)
        assert all(subject == f"leases.{d}.{e['wid']}" for e in events)
        inner = [e["seq"] for e in events]
        assert inner == sorted(inner)
        seqs += inner
    assert sorted(seqs) == list(range(1, total + 1))
    assert any(len(decode_message(data)) == 256 for _, data in tap.messages)


async def test_a_batch_stays_under_max_bytes_and_a_lone_event_leaves_by_the_linger(
    make_router: Any, nc: NatsClient
) -> None:
    d = "bytes"
    tap = await Tap.on(nc, d)
    publisher = await LeasePublisher.start(nc, d, batching=Batching(max_bytes=1000))
    for i in range(100):
        publisher.admitted(f"request-{i:04}", 5, 0, 100)
    await publisher.flush()
    await tap.wait(100)
    sizes = [len(data) for _, data in tap.messages]
    assert max(sizes) <= 1000 and min(sizes) > 0
    assert len(sizes) >= 100 * 45 // 1000

    # Linger: one event, no flush, goes out alone, as a plain event, within a few ms.
    before = len(tap.messages)
    start = time.monotonic()
    publisher.worker_reset(5)
    await tap.wait(101, timeout=2)
    assert time.monotonic() - start < 0.5
    assert not tap.messages[before][1].startswith(BATCH_PREFIX)
    await publisher.close()


async def test_open_batches_all_leave_once_2048_events_wait(nc: NatsClient) -> None:
    d = "openbound"
    tap = await Tap.on(nc, d)
    # Batches that would never fill nor linger out on their own.
    publisher = await LeasePublisher.start(
        nc, d, batching=Batching(linger=30, max_events=100_000, max_bytes=10_000_000)
    )
    for i in range(2047):
        publisher.completed(f"r{i}", i % 16, 0, Outcome.CANCELLED)
    await asyncio.sleep(0.3)
    assert tap.messages == [], "2,047 open events wait"
    publisher.completed("last", 0, 0, Outcome.CANCELLED)
    events = await tap.wait(2048, timeout=3)
    assert len(tap.messages) == 16
    # Oldest batch first: the subjects leave in the order of their first event.
    firsts = [decode_message(data)[0]["seq"] for _, data in tap.messages]
    assert firsts == sorted(firsts)
    assert len(events) == 2048
    await publisher.close()


async def test_the_queue_bound_under_a_stalled_server(
    nats_server: NatsServer, make_router: Any
) -> None:
    d = "stalled"
    router: Router = make_router([d])
    # A small client buffer: the task stalls soon after the server stops reading.
    nc = await nats.connect(nats_server.url, pending_size=64 * 1024, flush_timeout=30)
    publisher = await LeasePublisher.start(nc, d, queue_capacity=1000)
    publisher.worker_reset(1)
    await publisher.flush()

    nats_server.pause()
    try:
        attempted, accepted, slowest = 0, 0, 0.0
        # Publish for a second (the socket and the client's buffer fill, then the queue).
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for i in range(1000):
                start = time.perf_counter()
                ok = publisher.admitted(f"r-{attempted}-{i}", 1, 0, 100)
                slowest = max(slowest, time.perf_counter() - start)
                accepted += ok
            attempted += 1000
            await asyncio.sleep(0.005)  # the engine's loop goes on: the task gets its turns
        stalled = publisher.stats()
        assert stalled.dropped_queue_full > 0, stalled
        assert stalled.queued == accepted + 1
        assert stalled.dropped_queue_full == attempted - accepted
        assert stalled.pending >= 999, f"the task is stalled: {stalled}"
        assert slowest < 0.05, f"a publish took {slowest * 1e3:.1f} ms"
        # The newest are dropped: a new event is refused while the queue is full.
        assert not publisher.completed("newest", 1, 0, Outcome.FINISHED)
        # Nothing flushes while the server is frozen.
        flush = asyncio.ensure_future(publisher.flush())
        await asyncio.sleep(0.3)
        assert not flush.done()
    finally:
        nats_server.resume()

    await asyncio.wait_for(flush, 30)
    stats = await asyncio.wait_for(publisher.close(), 30)
    assert stats.pending == 0 and stats.failed == 0
    assert stats.published == accepted + 1
    assert stats.dropped_queue_full == attempted - accepted + 1
    assert stats.attempted == attempted + 2
    # Dropped events spent no sequence number: the router sees every published one, no gap.
    await wait_until(
        "every published event received",
        lambda: router.metric("events_received_total", deployment=d) == stats.published,
        timeout=30,
    )
    await asyncio.sleep(0.3)
    assert router.metric("events_received_total", deployment=d) == stats.published
    assert router.metric("events_dropped_total", deployment=d) == 0
    assert router.metric("sequence_gaps_total", deployment=d) == 0
    await nc.close()


async def test_publish_from_another_thread(make_router: Any, nc: NatsClient) -> None:
    d = "threads"
    router: Router = make_router([d])
    publisher = await LeasePublisher.start(nc, d, batching=Batching())

    def engine_thread(w: int) -> None:
        for i in range(500):
            publisher.admitted(f"t{w}-{i}", w, 0, 8)
            time.sleep(0.0001 if i % 50 == 0 else 0)

    await asyncio.gather(*(asyncio.to_thread(engine_thread, w) for w in (1, 2, 3)))
    stats = await publisher.close()
    assert stats.published == 1500
    await wait_until("1500 admitted", lambda: router.metric("active_leases", deployment=d) == 1500)
    assert router.metric("events_dropped_total", deployment=d) == 0


def test_msgpack_is_the_wire(nc: Any = None) -> None:
    # The tap decodes with msgpack itself, not with the package's own reader.
    assert msgpack.unpackb(b"\x81\xa1v\x01") == {"v": 1}
