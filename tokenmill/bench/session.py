"""The planned workload: sessions of turns, each turn one request. Plain data, no I/O, no clock."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Message:
    """One message of a prompt. Messages are shared (by reference) between the turns of a session."""

    role: str  # "system" | "user" | "assistant"
    tokens: np.ndarray  # [n] int64 prompt-vocabulary ids (token ids with a tokenizer, word ids without)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class NamedPrompt:
    """A prompt known by the names of its fixed-size token blocks instead of its token ids: a Mooncake trace's
    `hash_ids` (one per `block_size` tokens, the last block cut to `length`). Only the simulator replays these
    (`tokenmill sim --token-free`: engine/kv/named_tokens.py); the bench sends token ids."""

    names: tuple[int, ...]
    length: int
    block_size: int


@dataclass(frozen=True, eq=False)
class Turn:
    """One request: the whole context to send, how many tokens to generate, and the think time before it."""

    messages: tuple[Message, ...]
    max_tokens: int
    think_s: float = 0.0  # wait after the previous turn's reply before sending this one; 0 for the first
    named: NamedPrompt | None = None  # instead of messages: the prompt by block names (simulator only)

    @property
    def prompt_tokens(self) -> int:
        return self.named.length if self.named is not None else sum(len(m) for m in self.messages)

    def flat_tokens(self) -> np.ndarray:
        if self.named is not None:
            raise ValueError("a token-free turn (named blocks) has no token ids: only `tokenmill sim` replays it")
        return np.concatenate([m.tokens for m in self.messages])

    def digest(self) -> str:
        """The request's identity in records (plan_digest): of its token ids, or of its block names (a
        token-free turn: a different value than its token ids would give)."""
        h = hashlib.sha1(self.max_tokens.to_bytes(8, "little"))
        if self.named is not None:
            n = self.named
            h.update(b"named-blocks")
            h.update(np.asarray((n.length, n.block_size, *n.names), dtype=np.int64).tobytes())
            return h.hexdigest()[:16]
        for m in self.messages:
            h.update(m.role.encode())
            h.update(np.ascontiguousarray(m.tokens, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class Session:
    """A sequence of turns sent one after another (each waits for the previous reply plus think time)."""

    index: int
    class_name: str
    turns: tuple[Turn, ...]
    start_s: float | None = None  # fixed start time (trace replay); None: the arrival process decides

    def truncated(self, num_turns: int) -> Session:
        return Session(self.index, self.class_name, self.turns[:num_turns], self.start_s)
