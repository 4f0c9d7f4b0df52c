"""lease-router for Python: publish request-lease events, compute prefix block hashes, route.

- :class:`LeasePublisher` (asyncio, nats-py): the wire contract's events, stamped, batched
  and, in durable mode, acknowledged; ``publish`` never blocks.
- :func:`block_hashes`: the prompt's prefix block hashes, as the router computes them.
- :class:`RouteClient` / :class:`AsyncRouteClient` (httpx): routing decisions over HTTP.
- :class:`LeaseHook`: an engine's request-lifecycle callbacks turned into events.

The package's version is the wire contract's (:data:`CONTRACT_VERSION`) plus its own patch.
"""

from .blocks import DEFAULT_BLOCK_SIZE, block_hashes
from .hooks import LeaseHook
from .publisher import (
    Batching,
    FlushError,
    LeasePublisher,
    PublisherClosedError,
    PublisherStats,
    Retry,
    StreamMissingError,
    connect,
    stream_name,
)
from .route import (
    AsyncRouteClient,
    BadRequestError,
    Candidate,
    MethodNotAllowedError,
    NoWorkersError,
    PayloadTooLargeError,
    RouteClient,
    RouteDecision,
    RouterApiError,
    RouterConnectionError,
    RouterError,
    UnauthorizedError,
    UnavailableError,
    UnknownDeploymentError,
)
from .wire import (
    CONTRACT_VERSION,
    MAX_BLOCK_HASHES,
    WIRE_VERSION,
    Admitted,
    Completed,
    Envelope,
    KvCleared,
    KvRemoved,
    KvStored,
    LeaseEvent,
    Outcome,
    Progressed,
    ProgressStage,
    WorkerReset,
    encode_batch,
    encode_event,
)

__version__ = "1.4.0"

__all__ = [
    "CONTRACT_VERSION",
    "DEFAULT_BLOCK_SIZE",
    "MAX_BLOCK_HASHES",
    "WIRE_VERSION",
    "Admitted",
    "AsyncRouteClient",
    "BadRequestError",
    "Batching",
    "Candidate",
    "Completed",
    "Envelope",
    "FlushError",
    "KvCleared",
    "KvRemoved",
    "KvStored",
    "LeaseEvent",
    "LeaseHook",
    "LeasePublisher",
    "MethodNotAllowedError",
    "NoWorkersError",
    "Outcome",
    "PayloadTooLargeError",
    "ProgressStage",
    "Progressed",
    "PublisherClosedError",
    "PublisherStats",
    "Retry",
    "RouteClient",
    "RouteDecision",
    "RouterApiError",
    "RouterConnectionError",
    "RouterError",
    "StreamMissingError",
    "UnauthorizedError",
    "UnavailableError",
    "UnknownDeploymentError",
    "WorkerReset",
    "__version__",
    "block_hashes",
    "connect",
    "encode_batch",
    "encode_event",
    "stream_name",
]
