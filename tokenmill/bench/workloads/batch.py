"""`batch`: single requests with long outputs and no latency SLO (offline summarization, evals)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.bench.session import Session, Turn
from tokenmill.bench.workloads.registry import Workload, check, length, register_workload


@dataclass(frozen=True)
class BatchParams:
    prompt: int = 512
    output: int = 1024
    spread: float = 0.5
    class_name: str = "batch"

    def __post_init__(self):
        check(self.prompt >= 1 and self.output >= 1, "prompt and output must be >= 1")
        check(self.spread >= 0, "spread must be >= 0")


@register_workload("batch")
class Batch(Workload):
    Params = BatchParams

    def session(self, index: int) -> Session:
        p: BatchParams = self.params
        rng = self.rng("session", index)
        n_prompt, n_out = length(rng, p.prompt, p.spread), length(rng, p.output, p.spread)
        prompt = self.message("user", n_prompt, "user", index)
        return Session(index, p.class_name, (Turn((prompt,), n_out),))
