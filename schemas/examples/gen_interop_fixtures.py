"""Writes schemas/fixtures/interop/python_*.msgpack: events and batches (1.2) as a Python
publisher encodes them.

Run from the repository root with the `msgpack` package installed:

    python3 schemas/examples/gen_interop_fixtures.py

Each `<name>.msgpack` is what `msgpack.packb` produces for a dict built the way a Python worker
would build it (its own key order, an extra field the router does not know); `<name>.json` is the
envelope the router must decode it to, in the canonical form of the golden fixtures (for a
batch: `{"v": 1, "kind": "batch", "events": [...]}` with each event in that form).
tests/wire_contract.rs checks both.
"""

import json
import pathlib

import msgpack

OUT = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "interop"

PUBLISHER_ID = 0x8F3A6C2E91D4B705
TS = 1_700_000_000_123_456

CASES = {
    # Key order of a worker that builds the event first and stamps it last, an unknown key, and
    # `etok` as None (msgpack nil): "not known".
    "python_admitted": (
        {
            "kind": "admitted",
            "rid": "req-py-1",
            "wid": 12,
            "dp": 0,
            "ptok": 1000,
            "etok": None,
            "trace": {"span": "a1b2", "sampled": True},
            "v": 1,
            "pub": PUBLISHER_ID,
            "seq": 7,
            "ts": TS,
        },
        {
            "v": 1,
            "pub": PUBLISHER_ID,
            "seq": 7,
            "ts": TS,
            "kind": "admitted",
            "rid": "req-py-1",
            "wid": 12,
            "dp": 0,
            "ptok": 1000,
        },
    ),
    "python_progressed": (
        {
            "v": 1,
            "pub": PUBLISHER_ID,
            "seq": 8,
            "ts": TS + 5,
            "kind": "progressed",
            "rid": "req-py-1",
            "wid": 12,
            "dp": 0,
            "stage": "prefill_done",
            "otok": 0,
            "gpu_util": 0.83,
        },
        {
            "v": 1,
            "pub": PUBLISHER_ID,
            "seq": 8,
            "ts": TS + 5,
            "kind": "progressed",
            "rid": "req-py-1",
            "wid": 12,
            "dp": 0,
            "stage": "prefill_done",
            "otok": 0,
        },
    ),
    # `dp` as None in a reset: every rank.
    "python_worker_reset": (
        {"v": 1, "pub": PUBLISHER_ID, "seq": 9, "ts": TS + 9, "kind": "worker_reset", "wid": 12, "dp": None},
        {"v": 1, "pub": PUBLISHER_ID, "seq": 9, "ts": TS + 9, "kind": "worker_reset", "wid": 12},
    ),
    # 1.1's optional fields: `ctok` on an admission (nil would mean none), `leaving` on a reset
    # (None or False would mean a restart, and is left out of the canonical form).
    "python_admitted_cached": (
        {
            "kind": "admitted", "rid": "req-py-2", "wid": 12, "dp": 0, "ptok": 2048,
            "ctok": 1536, "etok": 64, "v": 1, "pub": PUBLISHER_ID, "seq": 10, "ts": TS + 10,
        },
        {
            "v": 1, "pub": PUBLISHER_ID, "seq": 10, "ts": TS + 10, "kind": "admitted",
            "rid": "req-py-2", "wid": 12, "dp": 0, "ptok": 2048, "etok": 64, "ctok": 1536,
        },
    ),
    # 1.3's optional fields of an admission: `blk` (its hashes in every unsigned width msgpack
    # picks for them, from fixint to uint 64) and `bcap`.
    "python_admitted_blocks": (
        {
            "bcap": 25000, "blk": [0, 127, 128, 65535, 2**32, 2**64 - 1], "kind": "admitted",
            "rid": "req-py-blk", "wid": 12, "dp": 0, "ptok": 100, "v": 1, "pub": PUBLISHER_ID,
            "seq": 20, "ts": TS + 20,
        },
        {
            "v": 1, "pub": PUBLISHER_ID, "seq": 20, "ts": TS + 20, "kind": "admitted",
            "rid": "req-py-blk", "wid": 12, "dp": 0, "ptok": 100,
            "blk": [0, 127, 128, 65535, 2**32, 2**64 - 1], "bcap": 25000,
        },
    ),
    "python_worker_leaving": (
        {"leaving": True, "v": 1, "pub": PUBLISHER_ID, "seq": 11, "ts": TS + 11, "kind": "worker_reset", "wid": 12, "dp": None},
        {"v": 1, "pub": PUBLISHER_ID, "seq": 11, "ts": TS + 11, "kind": "worker_reset", "wid": 12, "leaving": True},
    ),
    # 1.2 batches. The batch map in another key order (`events` first), an unknown key, and
    # events as separate dicts of their own key orders; one `admitted` with `etok` as None.
    "python_batch": (
        {
            "events": [
                {
                    "kind": "admitted", "rid": "req-py-3", "wid": 12, "dp": 1, "ptok": 300,
                    "etok": None, "v": 1, "pub": PUBLISHER_ID, "seq": 12, "ts": TS + 12,
                },
                {
                    "v": 1, "pub": PUBLISHER_ID, "seq": 13, "ts": TS + 13, "kind": "progressed",
                    "rid": "req-py-2", "wid": 12, "dp": 0, "stage": "decoding", "otok": 40,
                    "gpu_util": 0.5,
                },
                {
                    "v": 1, "pub": PUBLISHER_ID, "seq": 14, "ts": TS + 14, "kind": "completed",
                    "rid": "req-py-1", "wid": 12, "dp": 0, "outcome": "cancelled",
                },
            ],
            "host": "gpu-node-12",
            "kind": "batch",
            "v": 1,
        },
        {
            "v": 1,
            "kind": "batch",
            "events": [
                {
                    "v": 1, "pub": PUBLISHER_ID, "seq": 12, "ts": TS + 12, "kind": "admitted",
                    "rid": "req-py-3", "wid": 12, "dp": 1, "ptok": 300,
                },
                {
                    "v": 1, "pub": PUBLISHER_ID, "seq": 13, "ts": TS + 13, "kind": "progressed",
                    "rid": "req-py-2", "wid": 12, "dp": 0, "stage": "decoding", "otok": 40,
                },
                {
                    "v": 1, "pub": PUBLISHER_ID, "seq": 14, "ts": TS + 14, "kind": "completed",
                    "rid": "req-py-1", "wid": 12, "dp": 0, "outcome": "cancelled",
                },
            ],
        },
    ),
    # A batch may hold a single event. Built in the canonical key order, it packs to exactly the
    # bytes the Rust encoder writes.
    "python_batch_single": (
        {
            "v": 1,
            "kind": "batch",
            "events": [
                {"v": 1, "pub": PUBLISHER_ID, "seq": 15, "ts": TS + 15, "kind": "worker_reset", "wid": 12, "leaving": True},
            ],
        },
        {
            "v": 1,
            "kind": "batch",
            "events": [
                {"v": 1, "pub": PUBLISHER_ID, "seq": 15, "ts": TS + 15, "kind": "worker_reset", "wid": 12, "leaving": True},
            ],
        },
    ),
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (sent, decoded) in CASES.items():
        (OUT / f"{name}.msgpack").write_bytes(msgpack.packb(sent, use_bin_type=True))
        (OUT / f"{name}.json").write_text(json.dumps(decoded, indent=2) + "\n")


if __name__ == "__main__":
    main()
