"""Tier keys: the chained block hash extended by a model fingerprint, 128 bits, stable across processes.

key(block i) = blake2b-128(key(block i-1) || token ids of block i), key(block -1) = the model fingerprint.
The fingerprint digests what decides the bytes of a KV block: the architecture and config, the weights
(full content), the compute dtype, the KV storage dtype, the quantization, the block size and the block's
tensor layout. Two models (or one model at two precisions) thus never share a key: a block can never be
read by another model or precision. No Python hash() anywhere (it is salted per process).
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from pathlib import Path

from tokenmill.engine.kv.hashing import chain

FORMAT_VERSION = 1
KEY_BYTES = 16


def weights_digest(model_path: str | os.PathLike) -> bytes:
    """blake2b over config.json and every *.safetensors file (names, sizes and full contents)."""
    root = Path(model_path)
    h = hashlib.blake2b(digest_size=32, person=b"tm-weights")
    files = sorted([p for p in root.glob("*.safetensors")] + [root / "config.json"])
    for p in files:
        if not p.is_file():
            continue
        h.update(p.name.encode() + b"\0" + p.stat().st_size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.digest()


def model_fingerprint(weights: bytes, architecture: str, dtype: str, kv_dtype: str, block_size: int,
                      quantization: str, layout: list, sliding_window: int | None = None) -> bytes:
    """The root of every key chain (16 bytes)."""
    desc = json.dumps({"v": FORMAT_VERSION, "arch": architecture, "dtype": dtype, "kv_dtype": kv_dtype,
                       "block_size": block_size, "quantization": quantization, "layout": layout,
                       "sliding_window": sliding_window}, sort_keys=True).encode()
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tm-kv-model")
    h.update(weights)
    h.update(desc)
    return h.digest()


def chain_key(parent: bytes, token_ids) -> bytes:
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_keys(fingerprint: bytes, token_ids: list[int], block_size: int, start: list[bytes] | None = None) -> list[bytes]:
    """Keys of every full block of token_ids; `start` = already known keys of the leading blocks."""
    return chain(chain_key, fingerprint, token_ids, block_size, start)
