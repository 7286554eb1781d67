"""`mix:chat=0.6,agent=0.3,batch=0.1`: each session is drawn from one of several workloads (their default
params) with the given weights; every class keeps its own SLO."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tokenmill.bench.session import Session
from tokenmill.bench.workloads.registry import WORKLOADS, Workload, make_workload, register_workload


@dataclass(frozen=True)
class MixParams:
    weights: tuple[tuple[str, float], ...]  # (workload name, weight)

    def __post_init__(self):
        if not self.weights:
            raise ValueError("give weights: mix:chat=0.7,batch=0.3")
        for name, w in self.weights:
            if name not in WORKLOADS or WORKLOADS[name].finite or name == "mix":
                raise ValueError(f"{name!r} cannot be mixed; choose from "
                                 f"{', '.join(n for n, c in WORKLOADS.items() if not c.finite and n != 'mix')}")
            if not w > 0:
                raise ValueError(f"weight of {name} must be > 0")


@register_workload("mix")
class Mix(Workload):
    Params = MixParams

    @classmethod
    def parse_params(cls, raw: dict[str, str]) -> MixParams:
        try:
            return MixParams(tuple((name.replace("_", "-"), float(w)) for name, w in raw.items()))
        except ValueError as e:
            raise ValueError(f"weights must be numbers ({e})") from None

    @cached_property
    def parts(self) -> list[tuple[Workload, float]]:
        total = sum(w for _, w in self.params.weights)
        return [(make_workload(name, self.vocab, self.seed), w / total) for name, w in self.params.weights]

    @property
    def mean_turns(self) -> float:
        return sum(part.mean_turns * w for part, w in self.parts)

    @property
    def classes(self) -> set[str]:
        return set().union(*(part.classes for part, _ in self.parts))

    def session(self, index: int) -> Session:
        probs = np.array([w for _, w in self.parts])
        part = self.parts[int(self.rng("pick", index).choice(len(probs), p=probs))][0]
        return part.session(index)

    def describe(self) -> dict:
        return {"name": self.name, "params": {name: w for name, w in self.params.weights},
                "parts": [part.describe() for part, _ in self.parts]}
