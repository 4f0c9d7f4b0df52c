"""Publishing a worker's lease events on NATS: :class:`LeasePublisher`.

The engine calls :meth:`LeasePublisher.publish` (or :meth:`~LeasePublisher.admitted`,
:meth:`~LeasePublisher.progressed`, ...) at each step of a request's life. The call never
blocks and never awaits, and it may come from any thread: the event goes into a bounded queue
(8,192 events by default) and, when that queue is full, the **new** event is dropped, counted
(:attr:`PublisherStats.dropped_queue_full`) and ``publish`` returns ``False``. Losing an event
is survivable (the routers see the gap, the lease expires); stalling the engine on the bus is
not.

One asyncio task takes the events in order, stamps each with the publisher's random id and
the next sequence number (from 1: an event dropped at the queue spends none), encodes it
canonically and publishes it on ``{prefix}.{deployment}.{worker_id}``. With
:class:`Batching` (wire 1.2) each worker subject's events leave together: up to 256 events or
64 KiB per message, the first one waiting at most 1 ms, every open batch once 2,048 events wait
over all subjects. Without it every event is one message. :meth:`~LeasePublisher.flush` and
:meth:`~LeasePublisher.close` send what waits. The defaults and limits are the Rust
``LeasePublisher``'s.

Durable mode (:meth:`LeasePublisher.start_durable`) publishes to the deployment's JetStream
stream with ``Nats-Msg-Id`` = ``{pub}-{seq}`` (``{pub}-{first}-{last}`` for a batch), up to
``max_in_flight`` acknowledgements awaited at a time; a message whose acknowledgement fails
or times out (5 s) is re-sent with the same bytes and id (10 times at most), so the stream
stores it once.

Reconnects are the NATS client's: nats-py buffers publishes while it reconnects (its
``pending_size``); once that buffer is full the task waits for the connection, the queue fills
and new events are dropped at ``publish``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import PubAck
from nats.js.errors import NotFoundError

from .wire import (
    Admitted,
    Completed,
    KvCleared,
    KvRemoved,
    KvStored,
    LeaseEvent,
    Outcome,
    Progressed,
    ProgressStage,
    WorkerReset,
    batch_message_len,
    encode_batch,
    encode_fields,
)

log = logging.getLogger("lease_router.publisher")

#: Events waiting for the task, by default; past it ``publish`` drops the new event.
DEFAULT_QUEUE_CAPACITY: Final = 8192
#: Attempts of one publish (the first included) before its events are dropped as failed.
DEFAULT_MAX_PUBLISH_ATTEMPTS: Final = 5
#: Events the task takes from the queue before it lets the event loop run again.
MAX_TAKE: Final = 256
#: Events held in open batches over all subjects, at most: a router judges sequence numbers in
#: windows of 4,096 per publisher and batches of different subjects leave out of ``seq`` order.
MAX_OPEN_BATCH_EVENTS: Final = 2048
#: How long one JetStream acknowledgement may take before the message is re-sent.
ACK_TIMEOUT: Final = 5.0
#: Re-sends of one durable message whose acknowledgement failed, before it is given up.
MAX_RESENDS: Final = 10
#: Acknowledgements a durable publisher awaits at a time, by default (``simulate --durable``'s).
DEFAULT_MAX_IN_FLIGHT: Final = 256
#: The default first token(s) of every lease subject.
DEFAULT_SUBJECT_PREFIX: Final = "leases"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class PublisherClosedError(RuntimeError):
    """The publisher was closed: it takes no more events."""


class StreamMissingError(RuntimeError):
    """Durable mode: the deployment's JetStream stream does not exist (or JetStream is off)."""


class FlushError(RuntimeError):
    """A flush or close could not deliver: the client is closed, or acknowledgements failed."""


@dataclass(frozen=True, slots=True)
class Batching:
    """How a publisher batches (wire 1.2); the defaults are the Rust publisher's.

    A worker subject's events wait at most ``linger`` seconds for company; a batch goes out
    earlier when it holds ``max_events`` events or one more would make it larger than
    ``max_bytes`` (keep it at or below the routers' ``--max-batch-bytes`` and the server's
    ``max_payload``). Only once every router of the deployment reads batches (1.2 or later).
    """

    linger: float = 0.001
    max_events: int = 256
    max_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.linger < 0:
            raise ValueError("linger must not be negative")
        if self.max_events < 1:
            raise ValueError("max_events must be at least 1")
        if self.max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")


@dataclass(frozen=True, slots=True)
class Retry:
    """Delays between the attempts of one core-NATS publish (the Rust publisher's defaults).

    ``initial`` seconds, doubling, at most ``max_interval``, each delay moved by up to
    ``randomization`` of itself.
    """

    initial: float = 0.020
    max_interval: float = 1.0
    randomization: float = 0.2
    max_attempts: int = DEFAULT_MAX_PUBLISH_ATTEMPTS

    def delays(self) -> _Backoff:
        """A fresh backoff."""
        return _Backoff(self.initial, self.max_interval, self.randomization)


class _Backoff:
    def __init__(self, initial: float, max_interval: float, randomization: float) -> None:
        self._next = initial
        self._max = max_interval
        self._jitter = randomization

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._max)
        if self._jitter:
            delay *= 1 + random.uniform(-self._jitter, self._jitter)
        return max(delay, 0.0)


@dataclass(slots=True)
class PublisherStats:
    """The publisher's counters (all monotonic); :meth:`LeasePublisher.stats` copies them."""

    #: Events accepted into the queue.
    queued: int = 0
    #: Events handed to the NATS client (durable: acknowledged or still awaiting it).
    published: int = 0
    #: Batch messages (of two events or more) handed to the NATS client.
    batches: int = 0
    #: Events dropped because the queue was full.
    dropped_queue_full: int = 0
    #: Events dropped after their last failed attempt.
    failed: int = 0
    #: Publish attempts after the first one (durable: re-sends), over all messages.
    retries: int = 0
    #: Events refused at ``publish`` as invalid (not an event of the contract).
    rejected_invalid: int = 0

    @property
    def pending(self) -> int:
        """Accepted events not yet published nor failed; 0 once ``close`` has returned."""
        return max(self.queued - self.published - self.failed, 0)

    @property
    def attempted(self) -> int:
        """Every event offered to ``publish`` while open."""
        return self.queued + self.dropped_queue_full + self.rejected_invalid

    def copy(self) -> PublisherStats:
        """A copy of the counters now."""
        return PublisherStats(
            self.queued,
            self.published,
            self.batches,
            self.dropped_queue_full,
            self.failed,
            self.retries,
            self.rejected_invalid,
        )


class _SendFailedError(Exception):
    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


class _Sink(Protocol):
    async def send(self, subject: str, payload: bytes, msg_id: str) -> None: ...

    async def flush(self) -> None: ...


class _CoreSink:
    """Core NATS: at most once; the client's flush is the delivery point."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc

    async def send(self, subject: str, payload: bytes, msg_id: str) -> None:
        nc = self._nc
        while True:
            try:
                await nc.publish(subject, payload)
                return
            except nats.errors.OutboundBufferLimitError:
                # Disconnected and the client's reconnect buffer is full: wait for the
                # connection (the Rust client's publish waits the same way), the queue fills.
                if nc.is_closed:
                    raise _SendFailedError("the NATS connection is closed", True) from None
                await asyncio.sleep(0.01)
            except (nats.errors.MaxPayloadError, nats.errors.BadSubjectError) as err:
                raise _SendFailedError(repr(err), True) from err
            except nats.errors.ConnectionClosedError as err:
                raise _SendFailedError("the NATS connection is closed", True) from err
            except (nats.errors.Error, OSError) as err:
                raise _SendFailedError(repr(err), False) from err

    async def flush(self) -> None:
        await _flush_client(self._nc)


async def _flush_client(nc: NatsClient) -> None:
    """The client's flush (a PING answered), tried again while the server does not answer."""
    while True:
        try:
            await nc.flush()
            return
        except nats.errors.TimeoutError:
            # A stalled or unreachable server: wait on, as the Rust publisher does.
            if nc.is_closed:
                raise FlushError("the NATS connection is closed") from None
        except (nats.errors.Error, OSError) as err:
            raise FlushError(f"flushing lease events to NATS failed: {err!r}") from err


@dataclass(slots=True)
class _InFlight:
    subject: str
    payload: bytes
    msg_id: str
    ack: asyncio.Future[PubAck] | None


class _JetStreamSink:
    """JetStream: every message acknowledged; a failed one re-sent under the same id."""

    def __init__(
        self,
        nc: NatsClient,
        max_in_flight: int,
        ack_timeout: float,
        stats: PublisherStats,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream(publish_async_max_pending=max(max_in_flight, 1) + 1)
        self._max = max(max_in_flight, 1)
        self._ack_timeout = ack_timeout
        self._in_flight: deque[_InFlight] = deque()
        self._stats = stats

    async def _send_once(self, entry: _InFlight) -> str | None:
        try:
            entry.ack = await self._js.publish_async(
                entry.subject, entry.payload, headers={"Nats-Msg-Id": entry.msg_id}
            )
            return None
        except (nats.errors.Error, OSError) as err:
            entry.ack = None
            return repr(err)

    async def send(self, subject: str, payload: bytes, msg_id: str) -> None:
        entry = _InFlight(subject, payload, msg_id, None)
        error = await self._send_once(entry)
        if error is not None:
            if self._nc.is_closed:
                raise _SendFailedError(error, True)
            raise _SendFailedError(error, False)
        self._in_flight.append(entry)
        if len(self._in_flight) > self._max:
            # A window of acknowledgements: the oldest must be stored before more go out.
            await self._settle(self._in_flight.popleft())

    async def _settle(self, entry: _InFlight) -> bool:
        """Waits for the entry's acknowledgement, re-sending it until stored; whether it was."""
        backoff = _Backoff(0.05, 2.0, 0.2)
        last_error = "not sent"
        for attempt in range(MAX_RESENDS + 1):
            if attempt > 0:
                await asyncio.sleep(backoff.next_delay())
                self._stats.retries += 1
                error = await self._send_once(entry)
                if error is not None:
                    last_error = error
                    continue
            ack = entry.ack
            if ack is None:
                continue
            try:
                # A timed-out wait cancels the future, which frees its slot in nats-py.
                await asyncio.wait_for(ack, self._ack_timeout)
                return True
            except asyncio.TimeoutError:
                last_error = "acknowledgement timed out"
            except (nats.errors.Error, OSError) as err:
                last_error = repr(err)
            entry.ack = None
        log.warning(
            "durable publish never acknowledged; giving up (msg id %s): %s",
            entry.msg_id,
            last_error,
        )
        return False

    async def flush(self) -> None:
        # What was sent before the flush; the task goes on sending meanwhile.
        pending = list(self._in_flight)
        self._in_flight.clear()
        failed = 0
        for entry in pending:
            if not await self._settle(entry):
                failed += 1
        await _flush_client(self._nc)
        if failed:
            raise FlushError(f"{failed} durable publishes were never acknowledged")


@dataclass(slots=True)
class _OpenBatch:
    subject: str
    first_sequence: int
    last_sequence: int
    events: list[bytes] = field(default_factory=list)
    body: int = 0


_Item = tuple[LeaseEvent, int] | asyncio.Future[None] | None


def check_token(what: str, token: str) -> None:
    """Raises ``ValueError`` unless ``token`` is a valid subject token (1-128 of A-Za-z0-9_-)."""
    if not _TOKEN.match(token):
        raise ValueError(
            f"invalid {what} {token!r}: 1 to 128 characters, only ASCII letters, digits, - and _"
        )


def stream_name(deployment: str, subject_prefix: str = DEFAULT_SUBJECT_PREFIX) -> str:
    """The JetStream stream of one deployment: ``LEASE_ROUTER_{prefix}__{deployment}``."""
    return f"LEASE_ROUTER_{subject_prefix.replace('.', '_')}__{deployment}"


class LeasePublisher:
    """Publishes a worker's lease events on NATS, in order, without ever blocking the caller.

    Start it inside a running event loop with :meth:`start` (core NATS) or
    :meth:`start_durable` (JetStream) on a connected nats-py client; :meth:`close` it on
    shutdown (after the worker's ``worker_left``). ``publish`` and the event methods may be
    called from any thread.
    """

    def __init__(
        self,
        nc: NatsClient,
        deployment: str,
        *,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        batching: Batching | None = None,
        retry: Retry | None = None,
        _sink: _Sink | None = None,
        _stats: PublisherStats | None = None,
    ) -> None:
        """Use :meth:`start` or :meth:`start_durable`; this is what they call."""
        check_token("deployment", deployment)
        for token in subject_prefix.split("."):
            check_token("subject prefix token", token)
        if queue_capacity < 1:
            raise ValueError("queue_capacity must be at least 1")
        self._loop = asyncio.get_running_loop()
        self._nc = nc
        self._deployment = deployment
        self._subject_base = f"{subject_prefix}.{deployment}."
        self._stats = _stats or PublisherStats()
        self._sink: _Sink = _sink or _CoreSink(nc)
        self._durable = _sink is not None
        self._capacity = queue_capacity
        self._batching = batching
        self._retry = retry or Retry()
        #: A random u64, the ``pub`` of every event this publisher sends.
        self.publisher_id: int = random.SystemRandom().getrandbits(64)
        self._next_sequence = 1
        self._lock = threading.Lock()
        self._queue: deque[_Item] = deque()
        self._events_queued = 0  # events in the queue (the markers do not count)
        self._closing = False
        self._idle = False
        self._wake = asyncio.Event()
        self._subjects: dict[int, str] = {}
        self._open: dict[int, _OpenBatch] = {}
        self._open_events = 0
        self._linger_deadline: float | None = None
        self._task = self._loop.create_task(self._run(), name="lease-publisher")

    @classmethod
    async def start(
        cls,
        nc: NatsClient,
        deployment: str,
        *,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        batching: Batching | None = None,
        retry: Retry | None = None,
    ) -> LeasePublisher:
        """A core-NATS publisher for ``deployment``, with a new random publisher id."""
        return cls(
            nc,
            deployment,
            subject_prefix=subject_prefix,
            queue_capacity=queue_capacity,
            batching=batching,
            retry=retry,
        )

    @classmethod
    async def start_durable(
        cls,
        nc: NatsClient,
        deployment: str,
        *,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        batching: Batching | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        ack_timeout: float = ACK_TIMEOUT,
    ) -> LeasePublisher:
        """A durable publisher: the deployment's stream must exist (a durable router makes it).

        Raises :class:`StreamMissingError` when it does not, saying how to get it.
        """
        check_token("deployment", deployment)
        name = stream_name(deployment, subject_prefix)
        try:
            await nc.jetstream().stream_info(name)
        except NotFoundError:
            raise StreamMissingError(
                f"no JetStream stream {name} holds deployment {deployment}'s events "
                f"({subject_prefix}.{deployment}.>): a durable router creates it when the "
                f"deployment is added (`serve --durable --deployment {deployment}`, or PUT "
                f"/v1/deployments/{deployment}); add the deployment first, or publish without "
                "durable mode"
            ) from None
        except nats.errors.NoRespondersError:
            raise StreamMissingError(
                "the NATS server has no JetStream: start nats-server with -js to use durable "
                "mode, or publish without it"
            ) from None
        stats = PublisherStats()
        sink = _JetStreamSink(nc, max_in_flight, ack_timeout, stats)
        return cls(
            nc,
            deployment,
            subject_prefix=subject_prefix,
            queue_capacity=queue_capacity,
            batching=batching,
            _sink=sink,
            _stats=stats,
        )

    @property
    def deployment(self) -> str:
        """The deployment this publisher publishes for."""
        return self._deployment

    def subject(self, worker_id: int) -> str:
        """The subject of ``worker_id``'s events."""
        subject = self._subjects.get(worker_id)
        if subject is None:
            if len(self._subjects) >= 4096:
                self._subjects.clear()
            subject = self._subjects[worker_id] = f"{self._subject_base}{worker_id}"
        return subject

    def stats(self) -> PublisherStats:
        """A copy of the counters, read now."""
        with self._lock:
            return self._stats.copy()

    # ------------------------------------------------------------------------------------
    # The engine's side: never blocks.

    def publish(self, event: LeaseEvent) -> bool:
        """Queues one event; ``False`` when the queue was full (the event was dropped, counted).

        Never blocks, never awaits; safe from any thread. Raises
        :class:`PublisherClosedError` once the publisher is closed, ``TypeError`` for
        something that is not an event (counted in ``rejected_invalid``).
        """
        stamp = time.time_ns() // 1000
        with self._lock:
            if self._closing:
                raise PublisherClosedError("lease publisher is closed")
            if not isinstance(
                event,
                (Admitted, Progressed, Completed, WorkerReset, KvStored, KvRemoved, KvCleared),
            ):
                self._stats.rejected_invalid += 1
                raise TypeError(f"not a lease event: {type(event).__name__}")
            if self._events_queued >= self._capacity:
                self._stats.dropped_queue_full += 1
                dropped = self._stats.dropped_queue_full
                wake = False
            else:
                self._stats.queued += 1
                self._events_queued += 1
                self._queue.append((event, stamp))
                dropped = 0
                wake = self._idle
                self._idle = False
        if dropped:
            if dropped == 1 or dropped % 10_000 == 0:
                log.warning("lease event queue full, dropping new events (%d so far)", dropped)
            return False
        if wake:
            self._wake_task()
        return True

    def _wake_task(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    def admitted(
        self,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        prompt_tokens: int,
        expected_output_tokens: int | None = None,
        *,
        cached_tokens: int | None = None,
        block_hashes: tuple[int, ...] | list[int] = (),
        block_capacity: int | None = None,
        admission_class: str | None = None,
    ) -> bool:
        """Queues an ``admitted`` (see :class:`~lease_router.wire.Admitted`)."""
        return self.publish(
            Admitted(
                request_id,
                worker_id,
                dp_rank,
                prompt_tokens,
                expected_output_tokens,
                cached_tokens,
                tuple(block_hashes),
                block_capacity,
                admission_class,
            )
        )

    def progressed(
        self,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        stage: ProgressStage,
        output_tokens: int,
    ) -> bool:
        """Queues a ``progressed``."""
        return self.publish(Progressed(request_id, worker_id, dp_rank, stage, output_tokens))

    def prefill_done(
        self, request_id: str, worker_id: int, dp_rank: int, output_tokens: int = 1
    ) -> bool:
        """Queues a ``progressed`` at stage ``prefill_done`` (the first token is out)."""
        return self.progressed(
            request_id, worker_id, dp_rank, ProgressStage.PREFILL_DONE, output_tokens
        )

    def completed(self, request_id: str, worker_id: int, dp_rank: int, outcome: Outcome) -> bool:
        """Queues a ``completed``: send exactly one per request, on errors too."""
        return self.publish(Completed(request_id, worker_id, dp_rank, outcome))

    def worker_reset(self, worker_id: int, dp_rank: int | None = None) -> bool:
        """Queues a ``worker_reset`` (at start-up, before the first ``admitted``)."""
        return self.publish(WorkerReset(worker_id, dp_rank, False))

    def worker_left(self, worker_id: int, dp_rank: int | None = None) -> bool:
        """Queues a ``worker_reset`` with ``leaving`` (1.1): on a clean shutdown."""
        return self.publish(WorkerReset(worker_id, dp_rank, True))

    def kv_stored(
        self,
        worker_id: int,
        dp_rank: int,
        block_hashes: list[int] | tuple[int, ...],
        parent_hash: int | None = None,
    ) -> bool:
        """Queues a ``kv_stored`` (1.3): the engine stored these blocks (chain order, 1-256)."""
        return self.publish(KvStored(worker_id, dp_rank, tuple(block_hashes), parent_hash))

    def kv_removed(
        self, worker_id: int, dp_rank: int, block_hashes: list[int] | tuple[int, ...]
    ) -> bool:
        """Queues a ``kv_removed`` (1.3): the engine evicted these blocks (1-256)."""
        return self.publish(KvRemoved(worker_id, dp_rank, tuple(block_hashes)))

    def kv_cleared(self, worker_id: int, dp_rank: int | None = None) -> bool:
        """Queues a ``kv_cleared`` (1.3): the engine's cache (of one rank, or all) is empty."""
        return self.publish(KvCleared(worker_id, dp_rank))

    # ------------------------------------------------------------------------------------
    # Flush and close.

    def _marker(self, closing: bool) -> asyncio.Future[None]:
        done: asyncio.Future[None] = self._loop.create_future()
        with self._lock:
            if self._closing and not closing:
                raise PublisherClosedError("lease publisher is closed")
            if closing and self._closing:
                raise PublisherClosedError("lease publisher is already closed")
            if closing:
                self._closing = True
            # Markers wait for room by not counting against it: they are never dropped.
            self._queue.append(done)
            if closing:
                self._queue.append(None)
            wake = self._idle
            self._idle = False
        if wake:
            self._wake_task()
        return done

    async def flush(self) -> None:
        """Resolves once every event queued before the call is out and the client flushed it.

        Durable: once every one of them is acknowledged. Waits while the server is
        unreachable; bound it with ``asyncio.wait_for``. Raises :class:`FlushError` when the
        client could not flush, :class:`PublisherClosedError` once closed.
        """
        await self._marker(closing=False)

    async def close(self) -> PublisherStats:
        """Stops taking events, delivers everything queued, flushes, ends the task.

        Returns the final counters (``pending == 0``). Waits while the server is unreachable.
        """
        done = self._marker(closing=True)
        try:
            await done
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.stats()

    # ------------------------------------------------------------------------------------
    # The task.

    async def _run(self) -> None:
        queue = self._queue
        lock = self._lock
        taken: list[_Item] = []
        while True:
            with lock:
                for _ in range(min(len(queue), MAX_TAKE)):
                    item = queue.popleft()
                    if type(item) is tuple:
                        self._events_queued -= 1
                    taken.append(item)
                if not taken:
                    self._idle = True
                    self._wake.clear()
            if not taken:
                deadline = self._linger_deadline
                if deadline is None:
                    await self._wake.wait()
                else:
                    timeout = deadline - self._loop.time()
                    if timeout > 0:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), timeout)
                    if self._loop.time() >= deadline:
                        await self._send_open_batches()
                continue
            for item in taken:
                if item is None:
                    taken.clear()
                    await self._send_open_batches()
                    return
                if isinstance(item, asyncio.Future):
                    await self._send_open_batches()
                    # The wait for the client's flush runs beside the task.
                    self._loop.create_task(self._answer_flush(item))
                    continue
                event, stamp = item
                if self._batching is None:
                    await self._send_event(event, stamp)
                else:
                    await self._batch_event(event, stamp, self._batching)
            taken.clear()
            # A queue that never runs dry must not keep the linger from ending.
            deadline = self._linger_deadline
            if deadline is not None and self._loop.time() >= deadline:
                await self._send_open_batches()
            else:
                await asyncio.sleep(0)

    async def _answer_flush(self, done: asyncio.Future[None]) -> None:
        try:
            await self._sink.flush()
        except Exception as err:  # the flush's failure is the caller's answer
            if not done.done():
                done.set_exception(err)
            return
        if not done.done():
            done.set_result(None)

    def _stamp(self, event: LeaseEvent, stamp: int) -> tuple[int, bytes]:
        sequence = self._next_sequence
        self._next_sequence += 1
        return sequence, encode_fields(self.publisher_id, sequence, stamp, event)

    async def _send_event(self, event: LeaseEvent, stamp: int) -> None:
        sequence, payload = self._stamp(event, stamp)
        msg_id = f"{self.publisher_id}-{sequence}" if self._durable else ""
        await self._send_message(self.subject(event.worker_id), payload, msg_id, 1)

    async def _batch_event(self, event: LeaseEvent, stamp: int, batching: Batching) -> None:
        worker_id = event.worker_id
        sequence, payload = self._stamp(event, stamp)
        size = len(payload)
        open_batch = self._open.get(worker_id)
        if open_batch is not None and (
            batch_message_len(len(open_batch.events) + 1, open_batch.body + size)
            > batching.max_bytes
        ):
            await self._send_open_batch(worker_id)
            open_batch = None
        if open_batch is None:
            open_batch = _OpenBatch(self.subject(worker_id), sequence, sequence)
            self._open[worker_id] = open_batch
        open_batch.events.append(payload)
        open_batch.body += size
        open_batch.last_sequence = sequence
        self._open_events += 1
        if self._linger_deadline is None:
            self._linger_deadline = self._loop.time() + batching.linger
        if self._open_events >= MAX_OPEN_BATCH_EVENTS:
            await self._send_open_batches()
        elif len(open_batch.events) >= batching.max_events:
            await self._send_open_batch(worker_id)

    async def _send_open_batches(self) -> None:
        """Sends every open batch, oldest first."""
        self._linger_deadline = None
        if not self._open:
            return
        batches = sorted(self._open.values(), key=lambda b: b.first_sequence)
        self._open.clear()
        self._open_events = 0
        for batch in batches:
            await self._send_batch(batch)

    async def _send_open_batch(self, worker_id: int) -> None:
        batch = self._open.pop(worker_id, None)
        if batch is None:
            return
        self._open_events -= len(batch.events)
        if not self._open:
            self._linger_deadline = None
        await self._send_batch(batch)

    async def _send_batch(self, batch: _OpenBatch) -> None:
        events = len(batch.events)
        if events == 1:
            msg_id = f"{self.publisher_id}-{batch.first_sequence}"
        else:
            msg_id = f"{self.publisher_id}-{batch.first_sequence}-{batch.last_sequence}"
        sent = await self._send_message(batch.subject, encode_batch(batch.events), msg_id, events)
        if sent and events > 1:
            with self._lock:
                self._stats.batches += 1

    async def _send_message(self, subject: str, payload: bytes, msg_id: str, events: int) -> bool:
        """Sends one message of ``events`` events, retrying transient failures; whether sent."""
        attempts = 0
        backoff: _Backoff | None = None
        while True:
            attempts += 1
            try:
                await self._sink.send(subject, payload, msg_id)
            except _SendFailedError as err:
                if err.permanent or attempts >= max(self._retry.max_attempts, 1):
                    with self._lock:
                        self._stats.failed += events
                    log.warning(
                        "publishing lease events failed after %d attempts, %d events dropped "
                        "(msg id %s): %s",
                        attempts,
                        events,
                        msg_id,
                        err,
                    )
                    return False
                if backoff is None:
                    backoff = self._retry.delays()
                with self._lock:
                    self._stats.retries += 1
                await asyncio.sleep(backoff.next_delay())
                continue
            with self._lock:
                self._stats.published += events
            return True


async def connect(servers: str | list[str], **options: object) -> NatsClient:
    """A nats-py connection with the settings a publisher wants, reconnecting for ever.

    ``options`` go to ``nats.connect`` (credentials, TLS, ...) and override these defaults:
    unlimited reconnects every 0.5 s, a PING every 4 s (a dead connection seen within 12 s).
    """
    import nats as nats_module

    settings: dict[str, object] = {
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "ping_interval": 4,
        "max_outstanding_pings": 3,
        "name": "lease-router publisher",
    }
    settings.update(options)
    connect_fn: Callable[..., Awaitable[NatsClient]] = nats_module.connect
    return await connect_fn(servers, **settings)
