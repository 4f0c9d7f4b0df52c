"""Durable mode: JetStream acknowledgements, re-sends under the same Nats-Msg-Id, stored once."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats
import pytest
from conftest import NatsServer, Router, wait_until
from nats.aio.client import Client as NatsClient

from lease_router import (
    Batching,
    LeasePublisher,
    Outcome,
    StreamMissingError,
    stream_name,
)
from lease_router.wire import decode_message


class HoldingProxy:
    """A TCP proxy that can hold what the server sends (acknowledgements included)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.released = asyncio.Event()
        self.released.set()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if held:
                    await self.released.wait()
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.tasks.append(asyncio.create_task(self._pump(reader, up_writer, False)))
        self.tasks.append(asyncio.create_task(self._pump(up_reader, writer, True)))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.server:
            self.server.close()


async def stream_messages(nc: NatsClient, deployment: str) -> list[Any]:
    js = nc.jetstream()
    name = stream_name(deployment)
    info = await js.stream_info(name)
    return [
        await js.get_msg(name, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)
    ]


async def test_a_missing_stream_is_refused_with_how_to_get_it(nc: NatsClient) -> None:
    with pytest.raises(StreamMissingError, match="serve --durable --deployment nostream"):
        await LeasePublisher.start_durable(nc, "nostream")


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
async def test_retried_publishes_are_stored_once(
    nats_server: NatsServer, make_router: Any, nc: NatsClient, batched: bool
) -> None:
    d = f"durable{int(batched)}"
    router: Router = make_router([d], "--durable")
    proxy = HoldingProxy(nats_server.port)
    await proxy.start()
    pub_nc = await nats.connect(f"nats://127.0.0.1:{proxy.port}", ping_interval=60)
    try:
        publisher = await LeasePublisher.start_durable(
            pub_nc,
            d,
            batching=Batching() if batched else None,
            max_in_flight=1 if batched else 8,  # more in flight than the window
            ack_timeout=0.3,
        )
        publisher.worker_reset(4)
        await publisher.flush()
        # The acknowledgements are held: every message in flight times out and is re-sent.
        proxy.hold()
        n = 40
        for i in range(n):
            publisher.admitted(f"d-{i}", 4, 0, 64)
            if batched and i % 10 == 9:
                await asyncio.sleep(0.01)  # several batches, by the linger
        await asyncio.sleep(1.2)
        proxy.release()
        stats = await asyncio.wait_for(publisher.close(), 60)
    finally:
        await pub_nc.close()
        await proxy.close()
    assert stats.retries > 0, f"nothing was re-sent: {stats}"
    assert (stats.published, stats.failed, stats.pending) == (n + 1, 0, 0)

    messages = await stream_messages(nc, d)
    seqs = [e["seq"] for m in messages for e in decode_message(m.data)]
    assert seqs == list(range(1, n + 2)), "each event stored exactly once, in order"
    pid = publisher.publisher_id
    for m in messages:
        events = decode_message(m.data)
        first, last = events[0]["seq"], events[-1]["seq"]
        want = f"{pid}-{first}" if len(events) == 1 else f"{pid}-{first}-{last}"
        assert m.headers and m.headers.get("Nats-Msg-Id") == want
    if batched:
        assert len(messages) < n
    await wait_until(
        "every event applied once",
        lambda: router.metric("events_applied_total", deployment=d, kind="admitted") == n,
        timeout=20,
    )
    assert router.metric("events_dropped_total", deployment=d) == 0
    assert router.metric("active_leases", deployment=d) == n


async def test_durable_events_reach_a_replica_that_starts_later(
    nats_server: NatsServer, make_router: Any, nc: NatsClient
) -> None:
    d = "later"
    first: Router = make_router([d], "--durable")
    publisher = await LeasePublisher.start_durable(nc, d)
    publisher.worker_reset(9)
    publisher.admitted("kept", 9, 0, 100)
    publisher.admitted("gone", 9, 0, 100)
    publisher.completed("gone", 9, 0, Outcome.FINISHED)
    stats = await publisher.close()
    assert stats.published == 4
    await wait_until("applied", lambda: first.metric("active_leases", deployment=d) == 1)
    second: Router = make_router([d], "--durable")
    await wait_until("replayed", lambda: second.metric("active_leases", deployment=d) == 1)
    leases = second.get(f"/v1/deployments/{d}/leases")["leases"]
    assert [lease["request_id"] for lease in leases] == ["kept"]
