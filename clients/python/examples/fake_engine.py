r"""A worked integration: a gateway and fake engines, the engines publishing through LeaseHook.

Each fake engine stands for one worker process (a vLLM or SGLang server): it keeps a prefix
cache of block hashes (least recently used out), admits requests, runs a "prefill" that is
faster for the cached part, then decodes a token per step, and calls the request-lifecycle
callbacks an engine offers (admitted, first token, each step, finished, engine start and
stop). :class:`lease_router.LeaseHook` turns each callback into the event the wire contract
asks for. The gateway asks the router where each request goes (prefix-aware: it sends the
prompt's token ids) and hands the request to that engine.

Run a router first (``lease-router serve --deployment demo``), then::

    python examples/fake_engine.py --nats-url nats://127.0.0.1:4222 \
        --router-url http://127.0.0.1:9464 --deployment demo --workers 3 --requests 60

It prints one JSON line: requests per worker, prompt tokens and cached tokens in total.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from lease_router import (
    DEFAULT_BLOCK_SIZE,
    AsyncRouteClient,
    Batching,
    LeaseHook,
    LeasePublisher,
    Outcome,
    block_hashes,
    connect,
)


@dataclass
class FakeEngine:
    """An engine with a prefix cache and per-request callbacks (what LeaseHook implements)."""

    worker_id: int
    hook: LeaseHook
    capacity_blocks: int = 4096
    step: float = 0.002
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    served: int = 0
    cached_tokens: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def start(self) -> None:
        """The engine's start-up callback."""
        self.hook.on_engine_start()

    def _cached_prefix(self, hashes: list[int]) -> int:
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        return hit * DEFAULT_BLOCK_SIZE

    def _store(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity_blocks:
            self.cache.popitem(last=False)

    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        """Accepts a request: it runs on the engine's loop, the callbacks fire as it goes."""
        task = asyncio.get_running_loop().create_task(self._run(request_id, prompt, max_tokens))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        hashes = block_hashes(prompt)
        cached = self._cached_prefix(hashes)
        self.served += 1
        self.cached_tokens += cached
        self.hook.on_request_admitted(
            request_id, prompt, expected_output_tokens=max_tokens, cached_tokens=cached
        )
        try:
            # Prefill: the uncached part costs time.
            await asyncio.sleep(self.step * (1 + (len(prompt) - cached) / 512))
            self._store(hashes)
            self.hook.on_first_token(request_id)
            for produced in range(2, max_tokens + 1):
                await asyncio.sleep(self.step)
                self.hook.on_tokens(request_id, produced)
        except asyncio.CancelledError:
            self.hook.on_request_finished(request_id, Outcome.CANCELLED)
            raise
        except Exception:
            self.hook.on_request_finished(request_id, Outcome.FAILED)
            raise
        self.hook.on_request_finished(request_id, Outcome.FINISHED)

    async def stop(self) -> None:
        """Drains the requests, then the engine's shutdown callback."""
        while self.tasks:
            await asyncio.gather(*self.tasks)
        self.hook.on_engine_stop()


def prompts(count: int, seed: int) -> list[list[int]]:
    """Conversations over a few shared system prompts: each turn extends the previous one."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(256)] for _ in range(3)]
    sessions: list[list[int]] = []
    out: list[list[int]] = []
    for _ in range(count):
        if sessions and rng.random() < 0.6:
            session = rng.choice(sessions)
            session += [rng.randrange(50_000) for _ in range(rng.randrange(16, 96))]
        else:
            session = list(rng.choice(systems)) + [rng.randrange(50_000) for _ in range(64)]
            sessions.append(session)
        out.append(list(session))
    return out


async def main() -> None:
    """Runs the gateway and the engines once over ``--requests`` requests."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--router-url", default="http://127.0.0.1:9464")
    parser.add_argument("--token", default=None, help="the router's HTTP bearer token")
    parser.add_argument("--deployment", default="demo")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--first-worker-id", type=int, default=1)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    nc = await connect(args.nats_url)
    # One process, several engines: one publisher for all of them (one `pub`, a subject each).
    publisher = await LeasePublisher.start(nc, args.deployment, batching=Batching())
    engines = {}
    for worker_id in range(args.first_worker_id, args.first_worker_id + args.workers):
        hook = LeaseHook(publisher, worker_id, block_capacity=4096, progress_interval=0.02)
        engines[worker_id] = FakeEngine(worker_id, hook)
        engines[worker_id].start()
    await publisher.flush()

    async with AsyncRouteClient(args.router_url, token=args.token) as gateway:
        # The router learns the workers from their resets.
        for _ in range(200):
            if len((await gateway.workers(args.deployment))["workers"]) == args.workers:
                break
            await asyncio.sleep(0.02)
        for n, prompt in enumerate(prompts(args.requests, args.seed)):
            request_id = f"req-{args.seed}-{n}"
            decision = await gateway.route(
                args.deployment,
                request_id,
                token_ids=prompt,
                expected_output_tokens=args.max_tokens,
            )
            engines[decision.worker_id].submit(request_id, prompt, args.max_tokens)
            await asyncio.sleep(0.005)

    for engine in engines.values():
        await engine.stop()
    stats = await publisher.close()
    await nc.close()
    print(
        json.dumps(
            {
                "requests": {str(w): e.served for w, e in engines.items()},
                "cached_tokens": sum(e.cached_tokens for e in engines.values()),
                "events": stats.published,
                "dropped": stats.dropped_queue_full + stats.failed,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
