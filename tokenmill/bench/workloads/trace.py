"""`trace:FILE`: replay a recorded trace with its timestamps and lengths.

Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`): each hash id maps to one
seeded block of 512 tokens, so prompts are identical exactly where the ids are equal; the last block is
cut so the prompt has exactly `input_length` tokens. A block's first token is its index among the blocks
that follow the same prefix, so prompts share exactly k*512 tokens when their first k ids are equal, as
long as no prefix has more than V (vocabulary size) distinct successors; beyond that (e.g. 2,211 distinct
first blocks in the Mooncake sample vs a 390-word approximate vocabulary) siblings may share the first
few tokens of a block, never a whole block. `exact_sharing` in the report says which case holds.
Azure CSV (`TIMESTAMP, ContextTokens, GeneratedTokens`): lengths only; every prompt is unique.
"""

from __future__ import annotations

import copy
import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

import numpy as np

from tokenmill.bench.session import Message, NamedPrompt, Session, Turn
from tokenmill.bench.workloads.registry import Workload, check, register_workload

BLOCK_TOKENS = 512  # Mooncake's hash block size
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class TraceRow:
    time_s: float  # since the trace's first request
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None  # Mooncake only


@dataclass(frozen=True)
class TraceParams:
    path: str = ""
    time_scale: float = 1.0  # multiplies the trace's timestamps: 0.5 replays twice as fast
    class_name: str = "interactive"

    def __post_init__(self):
        check(bool(self.path), "give the trace file: trace:FILE")
        check(Path(self.path).is_file(), f"trace file {self.path} not found")
        check(self.time_scale > 0, "time_scale must be > 0")


def read_trace(path: str) -> list[TraceRow]:
    """Mooncake JSONL or Azure CSV, by extension; times start at 0 in seconds."""
    try:
        rows = _read_mooncake(path) if path.endswith((".jsonl", ".json")) else _read_azure(path)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a Mooncake JSONL or Azure CSV trace ({type(e).__name__}: {e})") from None
    if not rows:
        raise ValueError(f"{path}: the trace is empty")
    t0 = rows[0].time_s
    return [TraceRow(r.time_s - t0, r.input_length, max(1, r.output_length), r.hash_ids) for r in rows]


def _read_mooncake(path: str) -> list[TraceRow]:
    rows = []
    with open(path) as f:
        for line in filter(str.strip, f):
            d = json.loads(line)
            ids = tuple(int(h) for h in d["hash_ids"])
            if len(ids) != math.ceil(d["input_length"] / BLOCK_TOKENS):
                raise ValueError(f"hash_ids has {len(ids)} blocks for input_length {d['input_length']}")
            rows.append(TraceRow(d["timestamp"] / 1000, int(d["input_length"]), int(d["output_length"]), ids))
    return rows


def _read_azure(path: str) -> list[TraceRow]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    times = [_azure_time(r["TIMESTAMP"]) for r in rows]
    return [TraceRow((t - times[0]).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for t, r in zip(times, rows)]


def _azure_time(stamp: str) -> datetime:
    whole, _, frac = stamp.strip().partition(".")  # 7 fractional digits: more than %f accepts
    return datetime.fromisoformat(f"{whole}.{(frac + '000000')[:6]}")


@register_workload("trace")
class Trace(Workload):
    Params = TraceParams
    positional = "path"
    finite = True

    @cached_property
    def rows(self) -> list[TraceRow]:
        return read_trace(self.params.path)

    @property
    def native_rate(self) -> float:
        """Requests per second of the trace as recorded (times time_scale)."""
        span = self.rows[-1].time_s * self.params.time_scale
        return (len(self.rows) - 1) / span if span > 0 else float("inf")

    @cached_property
    def _block_codes(self) -> dict[int, tuple[int, int]]:
        """hash id -> (its index among the blocks that follow the same prefix, digits for that level)."""
        children: dict[int | None, dict[int, None]] = {}  # parent -> successors in order of appearance
        for row in self.rows:
            for parent, h in zip((None, *(row.hash_ids or ())), row.hash_ids or ()):
                children.setdefault(parent, {})[h] = None
        codes = {}
        for siblings in children.values():
            digits = max(1, math.ceil(math.log(len(siblings), self.vocab.size))) if len(siblings) > 1 else 1
            codes.update((h, (i, digits)) for i, h in enumerate(siblings))
        return codes

    @property
    def exact_sharing(self) -> bool:
        """Blocks after a common prefix differ in their first token (every fan-out <= vocabulary size)."""
        return all(digits == 1 for _, digits in self._block_codes.values())

    @cached_property
    def _block_key(self) -> np.uint64:
        return np.uint64(int.from_bytes(self.rng("block").bytes(8), "little"))

    def blocks(self, hash_ids) -> np.ndarray:
        """The 512 tokens of each hash block, [len(hash_ids), 512]: its index among its siblings in base V
        (least significant digit first, so siblings differ in the first token whenever there are at most V of
        them), then tokens drawn by a counter-based hash of (seed, hash id, position) -- a pure function of the
        id, computed for all of a prompt's blocks in one vectorized pass (a seeded Generator per block cost
        ~50 us, most of a trace replay's planning)."""
        h = _mix(np.asarray(hash_ids, dtype=np.uint64) ^ self._block_key)
        x = _mix(h[:, None] + np.arange(1, BLOCK_TOKENS + 1, dtype=np.uint64) * _GOLDEN)
        tokens = self.vocab.ids[(x % np.uint64(self.vocab.size)).astype(np.int64)]
        size = self.vocab.size
        for row, hash_id in zip(tokens, hash_ids):
            code, digits = self._block_codes[hash_id]
            if digits == 1:
                row[0] = self.vocab.ids[code % size]
            else:
                row[:digits] = self.vocab.ids[[(code // size**i) % size for i in range(digits)]]
        return tokens

    def block(self, hash_id: int) -> np.ndarray:
        """The 512 tokens of one hash block (see blocks)."""
        return self.blocks([hash_id])[0]

    named_prompts = False  # sessions carry the hash ids as named blocks, no token ids (`named()`)

    def named(self) -> Trace:
        """This trace with token-free prompts: each turn names its 512-token blocks by the row's hash_ids
        (bench/session.NamedPrompt) instead of carrying their synthesized token ids. For the simulator only
        (`tokenmill sim --token-free`); a Mooncake trace's, an Azure trace has no block names."""
        if self.rows[0].hash_ids is None:
            raise ValueError(f"{self.params.path}: token-free prompts need a Mooncake trace (hash_ids); "
                             "an Azure trace has lengths only")
        other = copy.copy(self)
        other.named_prompts = True
        return other

    def session(self, index: int) -> Session:
        row = self.rows[index]
        if self.named_prompts:
            turn = Turn((), row.output_length, named=NamedPrompt(row.hash_ids, row.input_length, BLOCK_TOKENS))
            return Session(index, self.params.class_name, (turn,), start_s=row.time_s * self.params.time_scale)
        if row.hash_ids is None:
            tokens = self.vocab.sample(self.rng("prompt", index), row.input_length)
        else:
            tokens = self.blocks(row.hash_ids).reshape(-1)[: row.input_length]
        turn = Turn((Message("user", tokens),), row.output_length)
        return Session(index, self.params.class_name, (turn,), start_s=row.time_s * self.params.time_scale)

    def sessions(self):
        return (self.session(i) for i in range(len(self.rows)))

    def describe(self) -> dict:
        return {**super().describe(), "requests": len(self.rows), "native_rate": self.native_rate,
                "format": "mooncake" if self.rows[0].hash_ids is not None else "azure",
                "exact_sharing": self.exact_sharing if self.rows[0].hash_ids is not None else None}
