"""A fake vLLM engine's KV event side, for cli/tests/relay.rs: vLLM's ZmqEventPublisher
(vllm/distributed/kv_events.py) without the engine. A PUB socket sends [topic, seq (8 bytes,
big-endian, from 0), MessagePack KVEventBatch]; a ROUTER replay socket answers an 8-byte
start seq with [seq, payload] for each buffered batch from it, then [-1, b""].

The batch is encoded as vLLM's msgspec structs encode it: with `--layout array` (0.10 / 0.11:
array_like structs, so [ts, events, data_parallel_rank], events [tag, fields...] with
trailing default fields omitted), `--layout array-0.9` ([ts, events], BlockStored of five
fields, BlockRemoved of one) or `--layout map` (later versions: plain structs, maps with a
"type" tag). msgpack-python packs ints, floats (float64), strings and arrays in the same
shortest forms as msgspec, so the bytes are the engine's. Block hashes are ints (signed
64-bit, as Python's hash gives) or, with `--hashes bytes`, 32-byte digests.

Driven by JSON lines on stdin, one answer line on stdout each ({"seq": last seq used}):

  {"op": "store", "tokens": [...], "from": K}   BlockStored of the full blocks K.. of tokens
                                                (parent: the engine hash of block K-1)
  {"op": "remove", "tokens": [...], "blocks": [i...]}  BlockRemoved of those blocks
  {"op": "clear"}                               AllBlocksCleared
  {"op": "noop"}                                a batch of no events
  {"op": "batch", "items": [op...]}             several events in one batch
  any of these with "drop": "pub"               in the replay buffer only (a lost message)
                    or "drop": "both"           in neither (a loss replay cannot fill)
  {"op": "malformed", "kind": "frames" | "seq" | "payload"}
                                                two frames; a 4-byte seq; a payload that is
                                                not MessagePack (a seq is spent on it)
  {"op": "blast", "count": N, "blocks": B}     N batches of one store of B blocks, at once
  {"op": "quit"}

Prints {"ready": true} once both sockets are bound.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # vLLM's high-water mark.
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(args.pub)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(args.replay)
        self.topic = args.topic.encode("utf-8")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.packer = msgpack.Packer(use_bin_type=True)

    def engine_hash(self, prefix: list[int]) -> object:
        digest = hashlib.sha256(
            self.args.seed.encode() + b"".join(t.to_bytes(4, "little") for t in prefix)
        ).digest()
        if self.args.hashes == "bytes":
            return digest
        return int.from_bytes(digest[:8], "big", signed=True)

    def block_keys(self, tokens: list[int], indexes: list[int]) -> list[object]:
        bs = self.args.block_size
        return [self.engine_hash(tokens[: (i + 1) * bs]) for i in indexes]

    def event(self, item: dict) -> object:
        op = item["op"]
        bs = self.args.block_size
        layout = self.args.layout
        if op == "store":
            tokens = item["tokens"]
            first = item.get("from", 0)
            full = len(tokens) // bs
            keys = self.block_keys(tokens, list(range(first, full)))
            parent = self.block_keys(tokens, [first - 1])[0] if first > 0 else None
            stored = tokens[first * bs : full * bs]
            if layout == "map":
                return {
                    "type": "BlockStored",
                    "block_hashes": keys,
                    "parent_block_hash": parent,
                    "token_ids": stored,
                    "block_size": bs,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            fields = ["BlockStored", keys, parent, stored, bs, None]
            if layout == "array":
                # medium, lora_name; extra_keys and group_idx are left at None, so omitted.
                fields += ["GPU", None]
            return fields
        if op == "remove":
            keys = self.block_keys(item["tokens"], item["blocks"])
            if layout == "map":
                return {"type": "BlockRemoved", "block_hashes": keys, "medium": "GPU"}
            if layout == "array":
                return ["BlockRemoved", keys, "GPU"]
            return ["BlockRemoved", keys]
        if op == "clear":
            return (
                {"type": "AllBlocksCleared"}
                if layout == "map"
                else ["AllBlocksCleared"]
            )
        raise ValueError(f"unknown op {op}")

    def batch(self, events: list) -> bytes:
        ts = time.time()
        if self.args.layout == "map":
            value: object = {
                "ts": ts,
                "events": events,
                "data_parallel_rank": self.args.dp_rank,
            }
        elif self.args.layout == "array":
            value = [ts, events, self.args.dp_rank]
        else:
            value = [ts, events]
        return self.packer.pack(value)

    def send(self, payload: bytes, drop: str | None) -> None:
        seq = self.seq
        self.seq += 1
        if drop != "both":
            self.buffer.append((seq, payload))
        if drop is None:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def serve_replay(self) -> None:
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    self.replay.send_multipart(
                        (client, b"", seq.to_bytes(8, "big"), payload)
                    )
            self.replay.send_multipart((client, b"", END_SEQ, b""))

    def command(self, cmd: dict) -> dict:
        op = cmd["op"]
        drop = cmd.get("drop")
        if op == "malformed":
            kind = cmd["kind"]
            if kind == "frames":
                self.pub.send_multipart((self.topic, b"\x00" * 8))
            elif kind == "seq":
                self.pub.send_multipart((self.topic, b"\x00" * 4, self.batch([])))
            elif kind == "payload":
                self.send(b"\xc1 not a batch", None)
            else:
                raise ValueError(f"unknown kind {kind}")
        elif op == "blast":
            # `count` batches of one BlockStored of `blocks` blocks each (distinct prompts),
            # encoded first, then sent back to back: the relay's throughput.
            bs = self.args.block_size
            blocks = cmd.get("blocks", 4)
            payloads = []
            for i in range(cmd["count"]):
                tokens = [(i * 7919 + j) % 150_000 for j in range(blocks * bs)]
                payloads.append(
                    self.batch([self.event({"op": "store", "tokens": tokens})])
                )
            started = time.perf_counter()
            for payload in payloads:
                self.send(payload, None)
            return {"seq": self.seq - 1, "send_seconds": time.perf_counter() - started}
        elif op == "noop":
            self.send(self.batch([]), drop)
        elif op == "batch":
            self.send(self.batch([self.event(item) for item in cmd["items"]]), drop)
        else:
            self.send(self.batch([self.event(cmd)]), drop)
        return {"seq": self.seq - 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pub", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--topic", default="kv-events")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument(
        "--layout", choices=["array", "array-0.9", "map"], default="array"
    )
    parser.add_argument("--hashes", choices=["int", "bytes"], default="int")
    parser.add_argument("--seed", default=str(time.time_ns()))
    args = parser.parse_args()
    engine = Engine(args)
    print(json.dumps({"ready": True}), flush=True)
    poller = zmq.Poller()
    poller.register(engine.replay, zmq.POLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    pending = b""

    while True:
        ready = dict(poller.poll(1000))
        if engine.replay in ready:
            engine.serve_replay()
        if stdin in ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.strip():
                    continue
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    return
                try:
                    answer = engine.command(cmd)
                except (
                    ValueError,
                    KeyError,
                    TypeError,
                ) as error:  # the test fails on it
                    answer = {"error": repr(error)}
                print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
