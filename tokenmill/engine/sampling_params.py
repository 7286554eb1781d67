"""Per-request sampling parameters (validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1 -> off
    seed: int | None = None  # per-request generator: same seed -> same tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob + top-k alternatives
    min_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, param: str):
            raise InvalidRequestError(msg, param=param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int):
            bad(f"top_k must be an integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            bad(f"seed must fit in 64 bits, got {self.seed}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings", "stop")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}", "logprobs")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens!r}", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
