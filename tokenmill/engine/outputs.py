"""Typed contracts between the engine's stages and its callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.spec.stats import SpecStats


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-k alternatives: token id -> logprob


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta), or the final state when finished.

    new_token_ids / new_text are the tokens/text generated in this step; text is the whole output so far
    (stop strings removed). finish_reason: None while running, else "stop" | "length" | "abort" | "error".
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    text: str
    output_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (at first schedule)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine's state for metrics, routing and admission (no clock inside)."""

    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    waiting_uncached_prompt_tokens: int  # leading indicator: prefill work queued
    prefix_cache_queries_tokens: int  # cumulative
    prefix_cache_hits_tokens: int  # cumulative
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    kv_tiers: dict[str, dict[str, float]] = field(default_factory=dict)  # tier name -> counters (KVTiers.stats)
    kv_tiers_engine: dict[str, float] = field(default_factory=dict)  # the tiers as a whole (KVTiers.engine_stats)
    spec: "SpecStats | None" = None  # speculative decoding counters (None: off); engine/spec/stats.py
    kv_blocks_cached: int = 0  # blocks holding prefix-cache content (in use or free); at most kv_blocks_total
    kv_evictions_total: int = 0  # cached blocks whose content was evicted for reuse (cumulative)
    batch_invariant: bool = False  # EngineConfig.batch_invariant as resolved (auto: on for bf16 with own kernels)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
