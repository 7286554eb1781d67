"""`shared-prefix`: G groups x P prompts; a group's prompts share a long system prompt, each has its own
question (the shape of llm-d's prefix-aware scheduling benchmark). Requests visit the G*P prompts in a
seeded random order, and cycle through them again when more are asked for; with `zipf=s` each request
instead draws its group with probability ∝ 1 / rank**s (skewed popularity) and its question uniformly."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tokenmill.bench.session import Session, Turn
from tokenmill.bench.workloads.registry import Workload, check, register_workload


@dataclass(frozen=True)
class SharedPrefixParams:
    groups: int = 16
    prompts: int = 8  # per group
    system: int = 2048  # tokens of each group's shared system prompt
    question: int = 256  # tokens of each prompt's own question
    output: int = 256
    class_name: str = "interactive"
    zipf: float = 0.0  # > 0: each request draws its group with probability ∝ 1 / rank**zipf (popularity skew)

    def __post_init__(self):
        check(self.groups >= 1 and self.prompts >= 1, "groups and prompts must be >= 1")
        check(self.zipf >= 0, "zipf must be >= 0")
        check(self.system >= 0 and self.question >= 1 and self.output >= 1, "lengths must be positive")


@register_workload("shared-prefix")
class SharedPrefix(Workload):
    Params = SharedPrefixParams

    @cached_property
    def order(self) -> np.ndarray:
        return self.rng("order").permutation(self.params.groups * self.params.prompts)

    @cached_property
    def popularity(self) -> np.ndarray:
        """Zipf weights over the groups (rank 1 = group 0), normalized."""
        w = 1.0 / np.arange(1, self.params.groups + 1) ** self.params.zipf
        return w / w.sum()

    def session(self, index: int) -> Session:
        p: SharedPrefixParams = self.params
        if p.zipf > 0:  # independent draws: group by popularity, prompt uniform within it
            rng = self.rng("zipf", index)
            group, prompt = int(rng.choice(p.groups, p=self.popularity)), int(rng.integers(p.prompts))
        else:
            group, prompt = divmod(int(self.order[index % len(self.order)]), p.prompts)
        system = self.message("system", p.system, "system", group)
        question = self.message("user", p.question, "question", group, prompt)
        return Session(index, p.class_name, (Turn((system, question), p.output),))
