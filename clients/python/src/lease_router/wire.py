"""The wire contract (schemas/README.md, version 1.3): events, their canonical encoding, batches.

Each event is one MessagePack map with string keys: the envelope (``v``, ``pub``, ``seq``,
``ts``, ``kind``) and the event's fields side by side. :func:`encode_event` writes exactly the
bytes the Rust encoder writes (keys in the contract's order, integers in their smallest format,
absent optional fields left out), so the golden fixtures of ``schemas/fixtures`` are reproduced
byte for byte. A batch (wire 1.2) is ``{"v": 1, "kind": "batch", "events": [...]}`` with each
element the event's own encoding (:func:`encode_batch`).

KV events (the engines' stored / removed / cleared blocks) are not part of the contract yet and
are not here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

import msgpack

#: The schema major version every message carries (``v``).
WIRE_VERSION: Final = 1
#: The revision of the contract this package speaks: 1.3 (prefix block hashes on ``admitted``).
CONTRACT_VERSION: Final = "1.4"
#: The most block hashes one ``admitted`` carries (``blk``); a longer prompt sends its first ones.
MAX_BLOCK_HASHES: Final = 256
#: A router's default limit of one event, alone or inside a batch (``max_event_bytes``).
DEFAULT_MAX_EVENT_BYTES: Final = 4096
#: The 22 bytes every canonical batch starts with: ``v``, ``kind``, then the ``events`` key.
BATCH_PREFIX: Final = bytes.fromhex(
    "83 a1 76 01 a4 6b 69 6e 64 a5 62 61 74 63 68 a6 65 76 65 6e 74 73"
)

_U32_MAX: Final = 2**32 - 1
_U64_MAX: Final = 2**64 - 1


class ProgressStage(str, Enum):
    """How far a request has moved (``stage`` of ``progressed``)."""

    PREFILL_DONE = "prefill_done"
    DECODING = "decoding"


class Outcome(str, Enum):
    """How a request ended (``outcome`` of ``completed``)."""

    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


def _check_int(name: str, value: object, maximum: int) -> None:
    # bool is an int in Python but a MessagePack boolean on the wire: refused.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} = {value} is out of range 0..={maximum}")


def _check_u32(name: str, value: object) -> None:
    _check_int(name, value, _U32_MAX)


def _check_u64(name: str, value: object) -> None:
    _check_int(name, value, _U64_MAX)


def _check_request_id(value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"request_id must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError("request_id must not be empty")


@dataclass(frozen=True, slots=True)
class Admitted:
    """A worker accepted request ``request_id`` on rank ``dp_rank`` (``admitted``).

    ``cached_tokens`` (1.1): prompt tokens already in the worker's prefix cache.
    ``block_hashes`` (1.3): the prompt's block hashes from the first block, at most
    :data:`MAX_BLOCK_HASHES` (see :func:`lease_router.block_hashes`); ``block_capacity`` (1.3):
    the blocks this rank's prefix cache holds at most. ``admission_class`` (1.4, ``cls``): the
    request's admission class, the one its route request named; every router replica counts
    the request under it (or under the deployment's default class when it has no such class).
    """

    request_id: str
    worker_id: int
    dp_rank: int
    prompt_tokens: int
    expected_output_tokens: int | None = None
    cached_tokens: int | None = None
    block_hashes: tuple[int, ...] = ()
    block_capacity: int | None = None
    admission_class: str | None = None

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        _check_u64("worker_id", self.worker_id)
        _check_u32("dp_rank", self.dp_rank)
        _check_u32("prompt_tokens", self.prompt_tokens)
        if self.expected_output_tokens is not None:
            _check_u32("expected_output_tokens", self.expected_output_tokens)
        if self.cached_tokens is not None:
            _check_u32("cached_tokens", self.cached_tokens)
        if self.block_capacity is not None:
            _check_u32("block_capacity", self.block_capacity)
        if self.admission_class is not None and not isinstance(self.admission_class, str):
            raise TypeError("admission_class must be a string or None")
        if not isinstance(self.block_hashes, tuple):
            # Accept any sequence, keep an immutable copy.
            object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        if len(self.block_hashes) > MAX_BLOCK_HASHES:
            raise ValueError(
                f"{len(self.block_hashes)} block hashes: at most {MAX_BLOCK_HASHES} "
                "(send the first ones: block_hashes(tokens)[:256])"
            )
        for block_hash in self.block_hashes:
            _check_u64("a block hash", block_hash)

    @property
    def kind(self) -> str:
        """The wire ``kind``."""
        return "admitted"

    def fields(self) -> dict[str, object]:
        """The event's own fields, in the contract's order, optional ones only when set."""
        out: dict[str, object] = {
            "rid": self.request_id,
            "wid": self.worker_id,
            "dp": self.dp_rank,
            "ptok": self.prompt_tokens,
        }
        if self.expected_output_tokens is not None:
            out["etok"] = self.expected_output_tokens
        if self.cached_tokens is not None:
            out["ctok"] = self.cached_tokens
        if self.block_hashes:
            out["blk"] = list(self.block_hashes)
        if self.block_capacity is not None:
            out["bcap"] = self.block_capacity
        if self.admission_class is not None:
            out["cls"] = self.admission_class
        return out


@dataclass(frozen=True, slots=True)
class Progressed:
    """Request ``request_id`` is alive and moving; renews its lease (``progressed``)."""

    request_id: str
    worker_id: int
    dp_rank: int
    stage: ProgressStage
    output_tokens: int

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        _check_u64("worker_id", self.worker_id)
        _check_u32("dp_rank", self.dp_rank)
        object.__setattr__(self, "stage", ProgressStage(self.stage))
        _check_u32("output_tokens", self.output_tokens)

    @property
    def kind(self) -> str:
        """The wire ``kind``."""
        return "progressed"

    def fields(self) -> dict[str, object]:
        """The event's own fields, in the contract's order."""
        return {
            "rid": self.request_id,
            "wid": self.worker_id,
            "dp": self.dp_rank,
            "stage": self.stage.value,
            "otok": self.output_tokens,
        }


@dataclass(frozen=True, slots=True)
class Completed:
    """Request ``request_id`` ended, however; its lease is released (``completed``)."""

    request_id: str
    worker_id: int
    dp_rank: int
    outcome: Outcome

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        _check_u64("worker_id", self.worker_id)
        _check_u32("dp_rank", self.dp_rank)
        object.__setattr__(self, "outcome", Outcome(self.outcome))

    @property
    def kind(self) -> str:
        """The wire ``kind``."""
        return "completed"

    def fields(self) -> dict[str, object]:
        """The event's own fields, in the contract's order."""
        return {
            "rid": self.request_id,
            "wid": self.worker_id,
            "dp": self.dp_rank,
            "outcome": self.outcome.value,
        }


@dataclass(frozen=True, slots=True)
class WorkerReset:
    """The worker is starting, restarting or (``leaving``, 1.1) going away (``worker_reset``).

    Every lease on it is dropped, only those of ``dp_rank`` when it is given.
    """

    worker_id: int
    dp_rank: int | None = None
    leaving: bool = False

    def __post_init__(self) -> None:
        _check_u64("worker_id", self.worker_id)
        if self.dp_rank is not None:
            _check_u32("dp_rank", self.dp_rank)
        if not isinstance(self.leaving, bool):
            raise TypeError("leaving must be a bool")

    @property
    def kind(self) -> str:
        """The wire ``kind``."""
        return "worker_reset"

    def fields(self) -> dict[str, object]:
        """The event's own fields, in the contract's order, optional ones only when set."""
        out: dict[str, object] = {"wid": self.worker_id}
        if self.dp_rank is not None:
            out["dp"] = self.dp_rank
        if self.leaving:
            out["leaving"] = True
        return out


def _block_list(name: str, hashes: object) -> tuple[int, ...]:
    """1 to :data:`MAX_BLOCK_HASHES` u64 hashes, as an immutable tuple."""
    if not isinstance(hashes, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of ints")
    out = tuple(hashes)
    if not 1 <= len(out) <= MAX_BLOCK_HASHES:
        raise ValueError(
            f"{len(out)} block hashes: a KV event holds 1 to {MAX_BLOCK_HASHES} "
            "(split a longer chain; each part's parent is the previous part's last hash)"
        )
    for block_hash in out:
        _check_u64("a block hash", block_hash)
    return out


@dataclass(frozen=True, slots=True)
class KvStored:
    """The engine stored blocks in its KV cache (``kv_stored``, 1.3).

    ``block_hashes``: our hashes (:func:`lease_router.block_hashes`), chain order, 1 to 256;
    ``parent_hash``: our hash of the block before the first, ``None`` for a prompt's first
    block. A rank that sends KV events is exact: routers take only these for what it holds.
    """

    worker_id: int
    dp_rank: int
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None

    def __post_init__(self) -> None:
        _check_u64("worker_id", self.worker_id)
        _check_u32("dp_rank", self.dp_rank)
        object.__setattr__(self, "block_hashes", _block_list("block_hashes", self.block_hashes))
        if self.parent_hash is not None:
            _check_u64("parent_hash", self.parent_hash)

    @property
    def kind(self) -> str:
        """The wire ``kind``."""
        return "kv_stored"

    def fields(self) -> dict[str, object]:
        """The event's own fields, in the contract's order, optional ones only when set."""
        out: dict[str, object] = {
            "wid": self.worker_id,
            "dp": self.dp_rank,
            "blk": list(self.block_hashes),
        }
        if self.parent_hash is not None:
            out["par"] = self.parent_hash
        return out


@dataclass(frozen=True, slots=True)
class KvRemoved:
    """The engine evicted blocks from its KV cache (``kv_removed``, 1.3); 1 to 256 hashes."""

    worker_id: int
    dp_rank: int
    block_hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_u64("worker_id", self.worker_id)
        _check_u32("dp_rank", self.dp_rank)
        object.__setattr__(self, "block_hashes", _block_list("block_hashes", self.block_hashes))

    @property
    def kind(self) -> str:
        """The wire ``kind``."""
        return "kv_removed"

    def fields(self) -> dict[str, object]:
        """The event's own fields, in the contract's order."""
        return {"wid": self.worker_id, "dp": self.dp_rank, "blk": list(self.block_hashes)}


@dataclass(frozen=True, slots=True)
class KvCleared:
    """The engine holds nothing in its KV cache (``kv_cleared``, 1.3).

    Every rank of the worker when ``dp_rank`` is ``None``.
    """

    worker_id: int
    dp_rank: int | None = None

    def __post_init__(self) -> None:
        _check_u64("worker_id", self.worker_id)
        if self.dp_rank is not None:
            _check_u32("dp_rank", self.dp_rank)

    @property
    def kind(self) -> str:
        """The wire ``kind``."""
        return "kv_cleared"

    def fields(self) -> dict[str, object]:
        """The event's own fields, optional ones only when set."""
        out: dict[str, object] = {"wid": self.worker_id}
        if self.dp_rank is not None:
            out["dp"] = self.dp_rank
        return out


#: Any event of the contract.
LeaseEvent = Admitted | Progressed | Completed | WorkerReset | KvStored | KvRemoved | KvCleared


@dataclass(frozen=True, slots=True)
class Envelope:
    """One event stamped by its publisher: publisher id, sequence (from 1), publish time."""

    publisher_id: int
    sequence: int
    published_at_us: int
    event: LeaseEvent

    def __post_init__(self) -> None:
        _check_u64("publisher_id", self.publisher_id)
        _check_u64("sequence", self.sequence)
        if self.sequence == 0:
            raise ValueError("sequence 0 is invalid: a publisher's first event is 1")
        _check_u64("published_at_us", self.published_at_us)

    def to_dict(self) -> dict[str, object]:
        """The flat map the wire carries, keys in the contract's (canonical) order."""
        out: dict[str, object] = {
            "v": WIRE_VERSION,
            "pub": self.publisher_id,
            "seq": self.sequence,
            "ts": self.published_at_us,
            "kind": self.event.kind,
        }
        out.update(self.event.fields())
        return out


def unix_micros_now() -> int:
    """The time now, microseconds since the unix epoch (the contract's ``ts``)."""
    return time.time_ns() // 1000


def encode_event(envelope: Envelope) -> bytes:
    """The canonical MessagePack encoding of one event: the Rust encoder's bytes."""
    return encode_fields(
        envelope.publisher_id, envelope.sequence, envelope.published_at_us, envelope.event
    )


def encode_fields(
    publisher_id: int, sequence: int, published_at_us: int, event: LeaseEvent
) -> bytes:
    """:func:`encode_event` without building an :class:`Envelope` (the publisher's hot path).

    The stamp is not checked: the caller guarantees a u64 publisher id, a sequence from 1 and
    a u64 time.
    """
    out: dict[str, object] = {
        "v": WIRE_VERSION,
        "pub": publisher_id,
        "seq": sequence,
        "ts": published_at_us,
        "kind": event.kind,
    }
    out.update(event.fields())
    packed: bytes = msgpack.packb(out, use_bin_type=True)
    return packed


def array_header(n: int) -> bytes:
    """The MessagePack header of an array of ``n`` elements."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 2**16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def batch_message_len(events: int, body: int) -> int:
    """The size of the message that ``events`` encoded events of ``body`` bytes make.

    One event goes alone, as a plain message; two or more make a batch.
    """
    if events == 0:
        return 0
    if events == 1:
        return body
    return len(BATCH_PREFIX) + len(array_header(events)) + body


def encode_batch(encoded_events: Sequence[bytes]) -> bytes:
    """One message of events already encoded (each exactly as it would be alone).

    A single event is the event itself (a plain message, as the Rust publisher sends it);
    two or more are a canonical batch. At least one event.
    """
    if not encoded_events:
        raise ValueError("a batch holds at least one event")
    if len(encoded_events) == 1:
        return bytes(encoded_events[0])
    return b"".join((BATCH_PREFIX, array_header(len(encoded_events)), *encoded_events))


def decode_message(data: bytes) -> list[dict[str, Any]]:
    """The events of one message as maps (a batch gives each of its events), for tests and tools.

    Nothing is validated beyond MessagePack itself: this is not the router's decoder.
    """
    message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(message, dict):
        raise ValueError("a message is a MessagePack map")
    if message.get("kind") == "batch":
        events = message.get("events")
        if not isinstance(events, list):
            raise ValueError("a batch's events is an array")
        return [dict(e) for e in events]
    return [message]
