"""The workload registry, the `NAME:key=value,...` spec syntax, and the base class workloads share."""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

import numpy as np

from tokenmill.bench.session import Message, Session
from tokenmill.bench.tokenizer import PromptVocab
from tokenmill.cli import CLIError

WORKLOADS: dict[str, type[Workload]] = {}


def register_workload(name: str):
    def wrap(cls: type[Workload]) -> type[Workload]:
        cls.name = name
        WORKLOADS[name] = cls
        return cls

    return wrap


class Workload(ABC):
    """Plans sessions deterministically: session i depends only on (seed, i) and the params.

    Subclasses set `Params` (a frozen dataclass whose __post_init__ raises ValueError on bad values)
    and implement `session(i)`. Finite workloads (traces) override `sessions()` and set start times.
    """

    name: ClassVar[str]
    Params: ClassVar[type]
    positional: ClassVar[str | None] = None  # the param a bare spec value sets: trace:FILE -> path
    finite: ClassVar[bool] = False

    def __init__(self, params, vocab: PromptVocab, seed: int):
        self.params = params
        self.vocab = vocab
        self.seed = seed

    @abstractmethod
    def session(self, index: int) -> Session: ...

    @classmethod
    def parse_params(cls, raw: dict[str, str]):
        return parse_dataclass(cls.Params, raw)

    @property
    def mean_turns(self) -> float:
        """Expected requests per session: a request rate R starts sessions at R / mean_turns."""
        return 1.0

    def sessions(self) -> Iterator[Session]:
        return (self.session(i) for i in itertools.count())

    @property
    def classes(self) -> set[str]:
        """Request classes this workload produces (each gets its own SLO)."""
        return {self.params.class_name}

    def rng(self, *key: int | str) -> np.random.Generator:
        """An independent stream per key, so planning one part never shifts another."""
        ints = [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in (self.name, *key)]
        return np.random.default_rng([self.seed, *ints])

    def message(self, role: str, n: int, *key: int | str) -> Message:
        return Message(role, self.vocab.sample(self.rng(*key), n))

    def describe(self) -> dict:
        return {"name": self.name, "params": dataclasses.asdict(self.params)}


def length(rng: np.random.Generator, mean: int, spread: float) -> int:
    """A token count with the given mean: fixed when spread == 0, else lognormal with sigma = spread."""
    if spread <= 0:
        return max(1, int(mean))
    mu = math.log(mean) - spread**2 / 2  # E[lognormal] = exp(mu + sigma^2/2) = mean
    return int(min(max(1, round(rng.lognormal(mu, spread))), 8 * mean))


def check(cond: bool, message: str) -> None:
    """For Params.__post_init__: a bad value becomes a one-line CLI error naming the workload."""
    if not cond:
        raise ValueError(message)


def workload_class(spec: str) -> type[Workload]:
    name = spec.partition(":")[0].strip()
    if name not in WORKLOADS:
        raise CLIError(f"--workload {spec!r}: unknown workload {name!r}; choose from {', '.join(sorted(WORKLOADS))}"
                       " (trace:FILE, mix:chat=0.7,batch=0.3)")
    return WORKLOADS[name]


def make_workload(spec: str, vocab: PromptVocab, seed: int) -> Workload:
    """'shared-prefix:groups=4,system=1024' -> a Workload; 'trace:FILE,time_scale=0.5' for the positional."""
    cls = workload_class(spec)
    body = spec.partition(":")[2]
    raw: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            if cls.positional is None or cls.positional in raw:
                raise CLIError(f"--workload {spec!r}: {item!r} should be key=value")
            key, value = cls.positional, item
        raw[key.strip().replace("-", "_")] = value.strip()
    try:
        params = cls.parse_params(raw)
    except (TypeError, ValueError) as e:
        raise CLIError(f"--workload {spec!r}: {e}") from None
    return cls(params, vocab, seed)


def parse_dataclass(params_cls: type, raw: dict[str, str]) -> object:
    """Build a Params dataclass from strings, converting by field type; unknown keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key not in fields:
            raise ValueError(f"unknown parameter {key!r}; known: {', '.join(fields)}")
        kind = str(fields[key].type).split("|")[0].strip()
        try:
            values[key] = {"int": int, "float": float}.get(kind, str)(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a valid {kind}") from None
    return params_cls(**values)
