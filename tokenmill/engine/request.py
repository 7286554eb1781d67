"""Request: the engine's state for one generation request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower first
    arrival_seq: int = 0  # FCFS tie-break among equal priority (a counter, not a clock)
    ttft_deadline: float = float("inf")  # first token due by then (the caller's clock; inf: none): EDF order
    tpot_slo_s: float | None = None  # time per output token it was promised: caps the step's prefill tokens
    rank: int = 0  # within a priority level, lower ranks are admitted first (then EDF); the server ranks cheap prompts 0
    max_total_tokens: int = 0  # prompt + output may not exceed this (max_model_len)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (after the scheduled step)
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache at first schedule (-1: not yet)
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    stop_reason: str | int | None = None

    def __post_init__(self):
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Running requests (and preemption victims) are ordered by this: priority, then arrival."""
        return (self.priority, self.arrival_seq)

    @property
    def waiting_key(self) -> tuple[int, int, float, int]:
        """Waiting requests: priority, rank, then earliest TTFT deadline (EDF; all-inf deadlines are FCFS), then
        arrival."""
        return (self.priority, self.rank, self.ttft_deadline, self.arrival_seq)

    def late(self, now: float | None) -> bool:
        """Its first token can no longer come by its deadline (a preempted request that streamed is never late)."""
        return now is not None and not self.output_token_ids and now > self.ttft_deadline

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
