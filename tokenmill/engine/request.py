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
        return (self.priority, self.arrival_seq)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
