"""The route client against a real router: decisions, typed errors, the bearer token."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Router, free_port, metric, wait_until
from nats.aio.client import Client as NatsClient

from lease_router import (
    AsyncRouteClient,
    BadRequestError,
    LeasePublisher,
    MethodNotAllowedError,
    NoWorkersError,
    PayloadTooLargeError,
    RouteClient,
    RouteDecision,
    RouterApiError,
    RouterConnectionError,
    UnauthorizedError,
    UnknownDeploymentError,
    block_hashes,
)
from lease_router.route import _raise_for


async def two_workers(router: Router, nc: NatsClient, d: str, prompt: list[int]) -> None:
    """Workers 1 and 2 on `d`; worker 2 holds `prompt`'s blocks."""
    publisher = await LeasePublisher.start(nc, d)
    publisher.worker_reset(1)
    publisher.worker_reset(2)
    publisher.admitted("warm", 2, 0, len(prompt), block_hashes=block_hashes(prompt)[:256])
    publisher.completed("warm", 2, 0, "finished")  # type: ignore[arg-type]
    await publisher.close()
    await wait_until(
        "two workers",
        lambda: len(router.get(f"/v1/deployments/{d}/workers")["workers"]) == 2,
    )


async def test_route_answers_a_typed_decision_and_errors_are_typed(
    make_router: Any, nc: NatsClient
) -> None:
    d = "routes"
    router: Router = make_router([d])
    with RouteClient(router.url) as client:
        with pytest.raises(NoWorkersError) as no_workers:
            client.route(d, "r0", 100)
        assert no_workers.value.status == 409 and no_workers.value.message

        prompt = list(range(5000, 5000 + 64))
        await two_workers(router, nc, d, prompt)

        decision = client.route(d, "r1", 100, expected_output_tokens=10)
        assert isinstance(decision, RouteDecision)
        assert decision.request_id == "r1" and decision.worker_id in (1, 2)
        assert decision.policy == "weighted_cost" and decision.dp_rank == 0
        assert {c.worker_id for c in decision.candidates} == {1, 2}

        # Prefix-aware: the worker holding the prompt's blocks, from token ids or hashes.
        by_tokens = client.route(d, "r2", token_ids=prompt)
        assert by_tokens.worker_id == 2
        chosen = next(c for c in by_tokens.candidates if c.worker_id == 2)
        assert chosen.overlap_blocks == 4 and chosen.cached_tokens == 64
        by_hashes = client.route(d, "r3", 64, block_hashes=block_hashes(prompt))
        assert by_hashes.worker_id == 2

        assert client.cancel_route(d, "r2") is True
        assert client.cancel_route(d, "r2") is False

        with pytest.raises(UnknownDeploymentError) as unknown:
            client.route("nosuch", "r", 10)
        assert unknown.value.status == 404 and "nosuch" in unknown.value.message
        with pytest.raises(BadRequestError):
            client.route(d, "r", 0)
        with pytest.raises(BadRequestError):
            client.route(d, "r", 10, cached_tokens=11)
        with pytest.raises(BadRequestError):
            client.route(d, "r", 3, token_ids=[1, 2])
        with pytest.raises(PayloadTooLargeError):
            client.route(d, "r", token_ids=[7] * 1_200_000)  # 2.4 MB of JSON
        assert isinstance(client.deployment(d), dict)
        assert client.workers(d)["workers"]

        created = client.add_deployment("extra", policy="round_robin")
        assert created  # the answer shows the routing in force
        client.remove_deployment("extra")
        with pytest.raises(UnknownDeploymentError):
            client.remove_deployment("extra")
        with pytest.raises(BadRequestError):
            client.add_deployment("bad.name")
        with pytest.raises(BadRequestError):
            client.add_deployment("x", policy="nonsense")

    dead_url = f"http://127.0.0.1:{free_port()}"
    with RouteClient(dead_url, timeout=1) as dead, pytest.raises(RouterConnectionError):
        dead.route(d, "r", 1)


async def test_method_not_allowed_is_typed(make_router: Any) -> None:
    router: Router = make_router(["m"])
    with RouteClient(router.url) as client, pytest.raises(MethodNotAllowedError) as err:
        _raise_for(client._call("PATCH", "/v1/deployments/m"))
    assert err.value.status == 405


async def test_the_async_client(make_router: Any, nc: NatsClient) -> None:
    d = "async"
    router: Router = make_router([d])
    prompt = list(range(64))
    await two_workers(router, nc, d, prompt)
    async with AsyncRouteClient(router.url) as client:
        decision = await client.route(d, "a1", token_ids=prompt)
        assert decision.worker_id == 2
        assert await client.cancel_route(d, "a1") is True
        with pytest.raises(UnknownDeploymentError):
            await client.route("nosuch", "a2", 1)
        with pytest.raises(BadRequestError):
            await client.route(d, "a3", 0)
        assert (await client.workers(d))["workers"]


async def test_the_bearer_token(make_router: Any, nc: NatsClient) -> None:
    d = "guarded"
    router: Router = make_router([d], "--http-token", "s3cret", "--http-protect-reads")
    with RouteClient(router.url) as anonymous:
        with pytest.raises(UnauthorizedError) as refused:
            anonymous.route(d, "t1", 10)
        assert refused.value.status == 401
    with RouteClient(router.url, token="wrong") as wrong, pytest.raises(UnauthorizedError):
        wrong.cancel_route(d, "t1")
    publisher = await LeasePublisher.start(nc, d)
    publisher.worker_reset(1)
    await publisher.close()
    with RouteClient(router.url, token="s3cret") as client:
        await wait_until("worker 1", lambda: client.workers(d)["workers"])
        assert client.route(d, "t1", 10).worker_id == 1
        assert client.cancel_route(d, "t1") is True
    async with AsyncRouteClient(router.url, token="s3cret") as aclient:
        assert (await aclient.route(d, "t2", 10)).worker_id == 1
    async with AsyncRouteClient(router.url) as anon:
        with pytest.raises(RouterApiError) as err:
            await anon.route(d, "t3", 10)
        assert isinstance(err.value, UnauthorizedError)
    failures = metric(router.metrics_text("s3cret"), "http_auth_failures_total")
    assert failures == 3  # missing, wrong, missing
