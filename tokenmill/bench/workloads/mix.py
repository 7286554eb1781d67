"""A mix of workloads: each session is drawn from one part with the part's weight; every class keeps its
own SLO. Two spellings: `mix:chat=0.7,batch=0.3` (parts with default params), or several `--workload`
flags, `--workload chat:think_s=0@0.7 --workload batch:output=64@0.3` (weights after `@`, default 1)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tokenmill.bench.session import Session
from tokenmill.bench.tokenizer import PromptVocab
from tokenmill.bench.workloads.registry import WORKLOADS, Workload, make_workload, register_workload
from tokenmill.cli import CLIError


@dataclass(frozen=True)
class MixParams:
    parts: tuple[tuple[str, float], ...]  # (workload spec, weight)

    def __post_init__(self):
        if not self.parts:
            raise ValueError("give weights: mix:chat=0.7,batch=0.3")
        mixable = [n for n, c in WORKLOADS.items() if not c.finite and n != "mix"]
        for spec, w in self.parts:
            if spec.partition(":")[0] not in mixable:
                raise ValueError(f"{spec!r} cannot be mixed; choose from {', '.join(mixable)}")
            if not w > 0:
                raise ValueError(f"weight of {spec} must be > 0")


@register_workload("mix")
class Mix(Workload):
    Params = MixParams

    @classmethod
    def parse_params(cls, raw: dict[str, str]) -> MixParams:
        try:
            return MixParams(tuple((name.replace("_", "-"), float(w)) for name, w in raw.items()))
        except ValueError as e:
            raise ValueError(f"weights must be numbers ({e})") from None

    @staticmethod
    def of_specs(specs: list[str], vocab: PromptVocab, seed: int) -> Mix:
        """Several --workload SPEC[@WEIGHT] flags as one mix."""
        parts = []
        for item in specs:
            spec, at, weight = item.rpartition("@") if "@" in item else (item, "", "1")
            try:
                parts.append((spec, float(weight)))
            except ValueError:
                raise CLIError(f"--workload {item!r}: the weight after @ must be a number") from None
        try:
            return Mix(MixParams(tuple(parts)), vocab, seed)
        except ValueError as e:
            raise CLIError(f"--workload: {e}") from None

    @cached_property
    def parts(self) -> list[tuple[Workload, float]]:
        total = sum(w for _, w in self.params.parts)
        return [(make_workload(spec, self.vocab, self.seed), w / total) for spec, w in self.params.parts]

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
        return {"name": self.name, "params": {spec: w for spec, w in self.params.parts},
                "parts": [part.describe() for part, _ in self.parts]}
