"""The prefix block hashes of lease-router (wire 1.3), as a worker or gateway computes them.

A prompt's token ids are cut into blocks of `block_size` tokens (the deployment's setting, 16
by default); only full blocks count, the tokens after the last full block are not hashed.
Each block's hash is XXH3-64 (seed 0) of 8 + 4 x block_size bytes: the previous block's hash
as a little-endian unsigned 64-bit integer (0 before the first block), then each token id of
the block as a little-endian unsigned 32-bit integer. Two prompts that share their first k
full blocks share their first k hashes, and the k-th hash stands for the whole prefix.

Run from the repository root with the `xxhash` package installed (PyPI's xxhash, the binding
to the reference C implementation):

    python3 schemas/examples/block_hashes.py --check   # schemas/fixtures/block_hashes.json
    python3 schemas/examples/block_hashes.py --write   # writes it anew

tests/prefix.rs runs --check, and holds the Rust function to the same file.
"""

import json
import pathlib
import struct
import sys

import xxhash

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "block_hashes.json"
DEFAULT_BLOCK_SIZE = 16
ROOT_PARENT = 0


def block_hashes(token_ids, block_size=DEFAULT_BLOCK_SIZE):
    """The hash of each full block of `token_ids` (ints in 0..2**32), in prompt order."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    hashes = []
    parent = ROOT_PARENT
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        block = token_ids[start : start + block_size]
        data = struct.pack("<Q", parent) + struct.pack(f"<{block_size}I", *block)
        parent = xxhash.xxh3_64_intdigest(data)
        hashes.append(parent)
    return hashes


def cases():
    """The test vectors: edge cases of the cut and of the byte layout."""
    ramp = list(range(100, 200))
    chat = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198] * 10
    return [
        ("empty prompt", 16, []),
        ("shorter than a block: nothing hashed", 16, ramp[:15]),
        ("exactly one block", 16, ramp[:16]),
        ("two blocks and 8 tokens left over", 16, ramp[:40]),
        ("same first two blocks, another tail", 16, ramp[:32] + [7] * 20),
        ("block size 1", 1, [0, 1, 2, 4294967295]),
        ("token ids at the ends of u32", 4, [0, 4294967295, 2147483648, 65536]),
        ("block size 32", 32, chat),
        ("a block of zeros is not the root", 2, [0, 0, 0, 0]),
    ]


def fixture():
    return {
        "scheme": "xxh3-64 seed 0 over (previous block hash, u64 little-endian; 0 before "
        "the first) then the block's token ids (u32 little-endian each); full blocks only",
        "cases": [
            {
                "name": name,
                "block_size": size,
                "token_ids": tokens,
                "block_hashes": [f"{h:016x}" for h in block_hashes(tokens, size)],
            }
            for name, size, tokens in cases()
        ],
    }


def main(argv):
    f = fixture()
    # One case per line: the token lists stay readable.
    rows = ",\n  ".join(json.dumps(c) for c in f["cases"])
    text = f'{{\n "scheme": {json.dumps(f["scheme"])},\n "cases": [\n  {rows}\n ]\n}}\n'
    assert json.loads(text) == f
    if argv[1:] == ["--write"]:
        FIXTURE.write_text(text)
        return 0
    if argv[1:] == ["--check"]:
        stored = json.loads(FIXTURE.read_text())
        for case in stored["cases"]:
            got = [f"{h:016x}" for h in block_hashes(case["token_ids"], case["block_size"])]
            if got != case["block_hashes"]:
                print(f"{case['name']}: {got} != {case['block_hashes']}", file=sys.stderr)
                return 1
        print(f"block_hashes: {len(stored['cases'])} cases reproduced")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
