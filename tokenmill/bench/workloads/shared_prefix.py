"""`shared-prefix`: G groups x P prompts; a group's prompts share a long system prompt, each has its own
question (the shape of llm-d's prefix-aware scheduling benchmark). Requests visit the G*P prompts in a
seeded random order, and cycle through them again when more are asked for."""

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

    def __post_init__(self):
        check(self.groups >= 1 and self.prompts >= 1, "groups and prompts must be >= 1")
        check(self.system >= 0 and self.question >= 1 and self.output >= 1, "lengths must be positive")


@register_workload("shared-prefix")
class SharedPrefix(Workload):
    Params = SharedPrefixParams

    @cached_property
    def order(self) -> np.ndarray:
        return self.rng("order").permutation(self.params.groups * self.params.prompts)

    def session(self, index: int) -> Session:
        p: SharedPrefixParams = self.params
        group, prompt = divmod(int(self.order[index % len(self.order)]), p.prompts)
        system = self.message("system", p.system, "system", group)
        question = self.message("user", p.question, "question", group, prompt)
        return Session(index, p.class_name, (Turn((system, question), p.output),))
