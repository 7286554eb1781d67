"""What speculative decoding measured: vLLM's spec-decode counters, the chosen-k distribution and switches,
and the acceptance rates (EMAs per request and per proposer) the `auto` policy reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Cumulative counters (a snapshot for metrics: vllm:spec_decode_*)."""

    proposer: str
    num_drafts: int = 0  # sequence-steps that verified at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j
    chosen_k: dict[int, int] = field(default_factory=dict)  # k -> decoding sequence-steps that chose it
    num_k_switches: int = 0  # a decoding sequence's k differed from its previous step's

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: accepted drafts + the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> "SpecStats":
        return SpecStats(self.proposer, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_pos), dict(self.chosen_k), self.num_k_switches)


class Acceptance:
    """α, the chance that a drafted token is kept, as exponentially decayed counts: per request (decay
    `req_decay` per verification) shrunk toward the proposer's (decay `prop_decay`) with `prior_weight`
    pseudo-trials; the proposer's starts at
    `prop_prior` (0.6 with the weight of 8 trials)."""

    def __init__(self, req_decay: float = 0.95, prop_decay: float = 0.995, prior_weight: float = 3.0,
                 prop_prior: tuple[float, float] = (0.6, 8.0)):
        self.req_decay, self.prop_decay, self.prior_weight = req_decay, prop_decay, prior_weight
        # (α, pseudo-trials): a couple of early rejections must not switch a proposer off before it is measured
        self.prop_prior = prop_prior
        self.prop = [0.0, 0.0]  # accepted, tried
        self.reqs: dict[str, list[float]] = {}

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        tried = num_accepted + (1 if num_accepted < num_drafts else 0)  # positions after a rejection were not tried
        for c, d in ((self.prop, self.prop_decay), (self.reqs.setdefault(request_id, [0.0, 0.0]), self.req_decay)):
            c[0] = d * c[0] + num_accepted
            c[1] = d * c[1] + tried

    @property
    def proposer_alpha(self) -> float:
        a, w = self.prop_prior
        return (self.prop[0] + a * w) / (self.prop[1] + w)

    def alphas(self, request_ids: list[str]) -> tuple[float, ...]:
        """alpha() of each request (one proposer estimate for all: the policy's snapshot)."""
        pw = self.prior_weight
        prior = pw * self.proposer_alpha
        get = self.reqs.get
        zero = (0.0, 0.0)
        return tuple((c[0] + prior) / (c[1] + pw) for c in (get(r, zero) for r in request_ids))

    def alpha(self, request_id: str) -> float:
        a, t = self.reqs.get(request_id, (0.0, 0.0))
        return (a + self.prior_weight * self.proposer_alpha) / (t + self.prior_weight)

    def forget(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)
