"""An engine hook: the request-lifecycle callbacks of a serving engine, turned into lease events.

Serving engines call back at each step of a request (vLLM's and SGLang's servers at
admission, after prefill, per output step, at the end, and at start-up and shutdown of the
engine). :class:`LeaseHook` takes those calls and publishes the event the wire contract asks
for at each:

==========================  ============================================================
engine callback             event published
==========================  ============================================================
:meth:`~LeaseHook.on_engine_start`   ``worker_reset`` (every rank, or each rank given)
:meth:`~LeaseHook.on_request_admitted`  ``admitted`` with the prompt's size, the cached
                            tokens the engine found, the first 256 block hashes and the
                            cache's capacity in blocks
:meth:`~LeaseHook.on_first_token`    ``progressed`` at ``prefill_done``
:meth:`~LeaseHook.on_tokens`         ``progressed`` at ``decoding``, at most once per
                            ``progress_interval`` (2 s): it renews the lease, it is not one
                            event per token
:meth:`~LeaseHook.on_request_finished`  ``completed`` (``finished``, ``cancelled`` or
                            ``failed``), exactly once per request
:meth:`~LeaseHook.on_engine_stop`    ``worker_reset`` with ``leaving``
==========================  ============================================================

Every callback is synchronous and never blocks (it only queues the event), so it can run on
the engine's own loop or thread. Wire it to the engine's callbacks as the engine names them:
``examples/fake_engine.py`` shows one with a fake engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .blocks import DEFAULT_BLOCK_SIZE, block_hashes
from .publisher import LeasePublisher
from .wire import MAX_BLOCK_HASHES, Outcome, ProgressStage

#: Seconds between two ``progressed`` of one decoding request, by default.
DEFAULT_PROGRESS_INTERVAL = 2.0


@dataclass(slots=True)
class _Live:
    dp_rank: int
    output_tokens: int
    last_progress: float


class LeaseHook:
    """Publishes one worker's request lifecycle through a :class:`LeasePublisher`.

    ``worker_id`` is this engine's worker id (the subject's last token); ``block_size`` the
    engine's KV block size (the router's ``--block-size``); ``block_capacity`` the KV cache's
    block count (``bcap``), if known. ``clock`` is for tests.
    """

    def __init__(
        self,
        publisher: LeasePublisher,
        worker_id: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        block_capacity: int | None = None,
        progress_interval: float = DEFAULT_PROGRESS_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.publisher = publisher
        self.worker_id = worker_id
        self.block_size = block_size
        self.block_capacity = block_capacity
        self.progress_interval = progress_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}

    @property
    def live_requests(self) -> int:
        """Requests admitted and not finished yet."""
        with self._lock:
            return len(self._live)

    def on_engine_start(self, dp_ranks: Sequence[int] | None = None) -> None:
        """The engine starts (or restarted): ``worker_reset``, before any ``admitted``."""
        with self._lock:
            self._live.clear()
        if dp_ranks is None:
            self.publisher.worker_reset(self.worker_id)
        else:
            for rank in dp_ranks:
                self.publisher.worker_reset(self.worker_id, rank)

    def on_request_admitted(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        dp_rank: int = 0,
        expected_output_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> bool:
        """The engine accepted a request: ``admitted``; whether the event was queued.

        ``cached_tokens``: the prompt tokens the engine found in its prefix cache (vLLM:
        the request's computed tokens at scheduling). The block hashes of the prompt's
        first 256 blocks go with it, so every router learns what this rank now caches.
        """
        now = self._clock()
        hashes = block_hashes(
            prompt_token_ids[: MAX_BLOCK_HASHES * self.block_size], self.block_size
        )
        with self._lock:
            self._live[request_id] = _Live(dp_rank, 0, now)
        return self.publisher.admitted(
            request_id,
            self.worker_id,
            dp_rank,
            len(prompt_token_ids),
            expected_output_tokens,
            cached_tokens=cached_tokens,
            block_hashes=hashes,
            block_capacity=self.block_capacity,
        )

    def on_first_token(self, request_id: str, output_tokens: int = 1) -> bool:
        """Prefill is done (the first token is out): ``progressed`` at ``prefill_done``."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return False
            live.output_tokens = max(live.output_tokens, output_tokens)
            live.last_progress = self._clock()
            rank, tokens = live.dp_rank, live.output_tokens
        return self.publisher.progressed(
            request_id, self.worker_id, rank, ProgressStage.PREFILL_DONE, tokens
        )

    def on_tokens(self, request_id: str, output_tokens: int) -> bool:
        """An output step: ``output_tokens`` produced so far.

        Publishes ``progressed`` at ``decoding`` when ``progress_interval`` has passed since
        the request's last one; whether it published.
        """
        now = self._clock()
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return False
            live.output_tokens = max(live.output_tokens, output_tokens)
            if now - live.last_progress < self.progress_interval:
                return False
            live.last_progress = now
            rank, tokens = live.dp_rank, live.output_tokens
        return self.publisher.progressed(
            request_id, self.worker_id, rank, ProgressStage.DECODING, tokens
        )

    def on_request_finished(self, request_id: str, outcome: Outcome = Outcome.FINISHED) -> bool:
        """The request ended, however: ``completed``, once (a second call does nothing)."""
        with self._lock:
            live = self._live.pop(request_id, None)
        if live is None:
            return False
        return self.publisher.completed(request_id, self.worker_id, live.dp_rank, outcome)

    def on_engine_stop(self) -> None:
        """A clean shutdown: ``worker_reset`` with ``leaving`` (it drops every lease left)."""
        with self._lock:
            self._live.clear()
        self.publisher.worker_left(self.worker_id)
