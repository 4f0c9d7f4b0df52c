"""Asking lease-router where a request should go: :class:`RouteClient`, :class:`AsyncRouteClient`.

A gateway calls ``route(deployment, request_id, prompt_tokens, ...)`` before it sends the
request to a worker; the answer (:class:`RouteDecision`) names the worker and rank, and the
router has booked the request there at once (the worker's ``admitted`` takes the booking
over). A request that never reaches its worker is released with ``cancel_route``.

The API's errors (JSON ``{"error": "..."}``) are raised as typed exceptions, one class per
status the API answers (:class:`BadRequestError`, :class:`UnauthorizedError`,
:class:`UnknownDeploymentError`, :class:`NoWorkersError`, :class:`PayloadTooLargeError`,
:class:`UnavailableError`), all :class:`RouterApiError`; a router that cannot be reached is a
:class:`RouterConnectionError`. The bearer token (``--http-token``) is sent when given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final
from urllib.parse import quote

import httpx

#: How long one HTTP call may take, by default (seconds).
DEFAULT_TIMEOUT: Final = 5.0


class RouterError(Exception):
    """Anything that kept a call to the router's HTTP API from its answer."""


class RouterConnectionError(RouterError):
    """The router could not be reached (refused, timed out, broken connection)."""


class RouterApiError(RouterError):
    """The router answered with an error: ``status`` and the API's ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        #: The HTTP status.
        self.status = status
        #: The API's ``error`` text.
        self.message = message


class BadRequestError(RouterApiError):
    """400: the body is not JSON, lacks a field, has a wrong type or nonsense sizes."""


class UnauthorizedError(RouterApiError):
    """401: the bearer token is missing or wrong."""


class UnknownDeploymentError(RouterApiError):
    """404: no such deployment (or route) on this router."""


class MethodNotAllowedError(RouterApiError):
    """405: the route exists, the method does not."""


class NoWorkersError(RouterApiError):
    """409: the deployment has no live worker to route to."""


class PayloadTooLargeError(RouterApiError):
    """413: the body is over the API's limit (2 MB)."""


class UnavailableError(RouterApiError):
    """503: leases are full, the router is stopping, or NATS does not answer."""


_ERRORS: Final[dict[int, type[RouterApiError]]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    404: UnknownDeploymentError,
    405: MethodNotAllowedError,
    409: NoWorkersError,
    413: PayloadTooLargeError,
    503: UnavailableError,
}


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker rank the decision weighed."""

    worker_id: int
    dp_rank: int
    #: Its weighted cost with the request on it.
    cost: float
    #: How many of the request's blocks, from the first, the prefix index takes it to hold.
    overlap_blocks: int
    #: The prompt tokens its cost counted as cached.
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where the request goes (booked there provisionally), and the candidates weighed."""

    request_id: str
    worker_id: int
    dp_rank: int
    policy: str
    candidates: tuple[Candidate, ...]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RouteDecision:
        """The decision of the API's JSON answer."""
        return cls(
            request_id=str(body["request_id"]),
            worker_id=int(body["worker_id"]),
            dp_rank=int(body["dp_rank"]),
            policy=str(body["policy"]),
            candidates=tuple(
                Candidate(
                    worker_id=int(c["worker_id"]),
                    dp_rank=int(c["dp_rank"]),
                    cost=float(c["cost"]),
                    overlap_blocks=int(c.get("overlap_blocks", 0)),
                    cached_tokens=int(c.get("cached_tokens", 0)),
                )
                for c in body.get("candidates", ())
            ),
        )


def route_body(
    request_id: str,
    prompt_tokens: int | None = None,
    *,
    cached_tokens: int | None = None,
    expected_output_tokens: int | None = None,
    token_ids: Sequence[int] | None = None,
    block_hashes: Sequence[int] | None = None,
    prompt: str | None = None,
    admission_class: str | None = None,
) -> dict[str, Any]:
    """The JSON body of a route request; fields left ``None`` are left out."""
    body: dict[str, Any] = {"request_id": request_id}
    if prompt_tokens is not None:
        body["prompt_tokens"] = prompt_tokens
    if cached_tokens is not None:
        body["cached_tokens"] = cached_tokens
    if expected_output_tokens is not None:
        body["expected_output_tokens"] = expected_output_tokens
    if token_ids is not None:
        body["token_ids"] = list(token_ids)
    if block_hashes is not None:
        body["block_hashes"] = list(block_hashes)
    if prompt is not None:
        body["prompt"] = prompt
    if admission_class is not None:
        body["class"] = admission_class
    return body


def _path(*parts: str) -> str:
    return "/v1/deployments/" + "/".join(quote(p, safe="") for p in parts)


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
        message = str(body["error"]) if isinstance(body, dict) and "error" in body else ""
    except ValueError:
        message = ""
    if not message:
        message = response.text or response.reason_phrase
    raise _ERRORS.get(response.status_code, RouterApiError)(response.status_code, message)


def _json(response: httpx.Response) -> dict[str, Any]:
    _raise_for(response)
    body = response.json()
    if not isinstance(body, dict):
        raise RouterError(f"unexpected answer: {body!r}")
    return body


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class RouteClient:
    """A blocking client of the router's HTTP API (httpx); use it as a context manager.

    ``base_url`` is the router's HTTP address (``http://127.0.0.1:9464``); ``token`` its
    bearer token, if it has one.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._client = httpx.Client(base_url=base_url, headers=_headers(token), timeout=timeout)

    def __enter__(self) -> RouteClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Closes the connections."""
        self._client.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        try:
            return self._client.request(method, path, json=body)
        except httpx.TransportError as err:
            raise RouterConnectionError(f"{method} {path}: {err!r}") from err

    def route(
        self,
        deployment: str,
        request_id: str,
        prompt_tokens: int | None = None,
        *,
        cached_tokens: int | None = None,
        expected_output_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[int] | None = None,
        prompt: str | None = None,
        admission_class: str | None = None,
    ) -> RouteDecision:
        """A routing decision for one request (``POST /v1/deployments/{name}/route``)."""
        body = route_body(
            request_id,
            prompt_tokens,
            cached_tokens=cached_tokens,
            expected_output_tokens=expected_output_tokens,
            token_ids=token_ids,
            block_hashes=block_hashes,
            prompt=prompt,
            admission_class=admission_class,
        )
        return RouteDecision.from_json(_json(self._call("POST", _path(deployment, "route"), body)))

    def cancel_route(self, deployment: str, request_id: str) -> bool:
        """Releases this router's booking of a request that never reached its worker.

        ``True`` when a booking was released, ``False`` when there was none (harmless).
        """
        answer = _json(self._call("DELETE", _path(deployment, "route", request_id)))
        return bool(answer.get("released"))

    def add_deployment(
        self,
        deployment: str,
        *,
        policy: str | None = None,
        weights: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """Starts a router for ``deployment`` (or sets its routing); the API's answer."""
        body: dict[str, Any] | None = None
        if policy is not None or weights is not None:
            body = {}
            if policy is not None:
                body["policy"] = policy
            if weights is not None:
                body["weights"] = weights
        return _json(self._call("PUT", _path(deployment), body))

    def remove_deployment(self, deployment: str) -> None:
        """Tears ``deployment``'s router down."""
        _raise_for(self._call("DELETE", _path(deployment)))

    def deployment(self, deployment: str) -> dict[str, Any]:
        """One deployment: its summary and ingress counters."""
        return _json(self._call("GET", _path(deployment)))

    def workers(self, deployment: str) -> dict[str, Any]:
        """The deployment's member workers with their load, and the least loaded one."""
        return _json(self._call("GET", _path(deployment, "workers")))


class AsyncRouteClient:
    """The asyncio twin of :class:`RouteClient` (``httpx.AsyncClient``)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._client = httpx.AsyncClient(
            base_url=base_url, headers=_headers(token), timeout=timeout
        )

    async def __aenter__(self) -> AsyncRouteClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the connections."""
        await self._client.aclose()

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        try:
            return await self._client.request(method, path, json=body)
        except httpx.TransportError as err:
            raise RouterConnectionError(f"{method} {path}: {err!r}") from err

    async def route(
        self,
        deployment: str,
        request_id: str,
        prompt_tokens: int | None = None,
        *,
        cached_tokens: int | None = None,
        expected_output_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[int] | None = None,
        prompt: str | None = None,
        admission_class: str | None = None,
    ) -> RouteDecision:
        """A routing decision for one request (see :meth:`RouteClient.route`)."""
        body = route_body(
            request_id,
            prompt_tokens,
            cached_tokens=cached_tokens,
            expected_output_tokens=expected_output_tokens,
            token_ids=token_ids,
            block_hashes=block_hashes,
            prompt=prompt,
            admission_class=admission_class,
        )
        response = await self._call("POST", _path(deployment, "route"), body)
        return RouteDecision.from_json(_json(response))

    async def cancel_route(self, deployment: str, request_id: str) -> bool:
        """Releases this router's booking of a request (see :meth:`RouteClient.cancel_route`)."""
        response = await self._call("DELETE", _path(deployment, "route", request_id))
        return bool(_json(response).get("released"))

    async def add_deployment(
        self,
        deployment: str,
        *,
        policy: str | None = None,
        weights: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """Starts a router for ``deployment`` (or sets its routing); the API's answer."""
        body: dict[str, Any] | None = None
        if policy is not None or weights is not None:
            body = {}
            if policy is not None:
                body["policy"] = policy
            if weights is not None:
                body["weights"] = weights
        return _json(await self._call("PUT", _path(deployment), body))

    async def remove_deployment(self, deployment: str) -> None:
        """Tears ``deployment``'s router down."""
        _raise_for(await self._call("DELETE", _path(deployment)))

    async def deployment(self, deployment: str) -> dict[str, Any]:
        """One deployment: its summary and ingress counters."""
        return _json(await self._call("GET", _path(deployment)))

    async def workers(self, deployment: str) -> dict[str, Any]:
        """The deployment's member workers with their load, and the least loaded one."""
        return _json(await self._call("GET", _path(deployment, "workers")))
