"""Arrival processes for open-loop load, registered by name: the gaps between session starts."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

# name -> gaps(rate, burstiness, rng): an endless iterator of inter-arrival times in seconds
ArrivalProcess = Callable[[float, float, np.random.Generator], Iterator[float]]
ARRIVALS: dict[str, ArrivalProcess] = {}


def register_arrival(name: str):
    def wrap(fn: ArrivalProcess) -> ArrivalProcess:
        ARRIVALS[name] = fn
        return fn

    return wrap


@register_arrival("poisson")
def poisson(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Exponential gaps: memoryless arrivals (burstiness is ignored)."""
    while True:
        yield float(rng.exponential(1.0 / rate))


@register_arrival("gamma")
def gamma(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Gamma gaps with shape = burstiness and mean 1/rate: < 1 burstier than Poisson, > 1 smoother
    (squared coefficient of variation of the gaps = 1 / burstiness)."""
    while True:
        yield float(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


@register_arrival("constant")
def constant(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    return itertools.repeat(1.0 / rate)


def arrival_times(name: str, rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Session start times in seconds: the first at 0, then cumulative gaps. Same seed, same times."""
    gaps = ARRIVALS[name](rate, burstiness, np.random.default_rng([seed, 0xA77]))
    return itertools.accumulate(gaps, initial=0.0)
