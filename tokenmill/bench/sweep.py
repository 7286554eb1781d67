"""`--sweep`: the highest request rate whose SLO attainment is >= the target (DistServe's goodput).

Bracketing: from the start rate, double while the attainment holds (or halve while it does not) until a
passing rate lo and a failing rate hi bracket the answer; then bisect until (hi - lo) / hi <= rel_tol or
the trials run out. Attainment is assumed to fall as the rate rises; every trial is kept for the curve.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenmill.cli import CLIError


@dataclass(frozen=True)
class SweepConfig:
    target: float = 0.9  # SLO attainment a rate must reach
    start_rate: float = 1.0  # requests/s of the first trial
    max_trials: int = 8
    rel_tol: float = 0.1  # stop bisecting when (hi - lo) / hi <= rel_tol
    min_rate: float = 0.01
    max_rate: float = 10_000.0

    def __post_init__(self):
        if not 0 < self.target <= 1:
            raise CLIError("--sweep-target must be in (0, 1]")
        if not self.min_rate <= self.start_rate <= self.max_rate:
            raise CLIError(f"--rate (the sweep's start) must be within [{self.min_rate}, {self.max_rate}]")
        if self.max_trials < 1:
            raise CLIError("--sweep-trials must be >= 1")
        if not 0 < self.rel_tol < 1:
            raise CLIError("--sweep-tol must be in (0, 1)")


@dataclass(frozen=True)
class SweepPoint:
    rate: float  # offered, requests/s
    attainment: float
    goodput: float  # requests/s


@dataclass(frozen=True)
class SweepOutcome:
    max_rate: float  # highest passing rate found; 0.0 when even min_rate fails
    bracketed: bool  # a failing rate above max_rate was found (otherwise max_rate is a lower bound)
    points: list[SweepPoint]  # in trial order


async def find_max_rate(trial: Callable[[float], Awaitable[SweepPoint]], cfg: SweepConfig) -> SweepOutcome:
    lo: float | None = None  # highest passing rate
    hi: float | None = None  # lowest failing rate
    points: list[SweepPoint] = []
    rate = cfg.start_rate
    for _ in range(cfg.max_trials):
        point = await trial(rate)
        points.append(point)
        if point.attainment >= cfg.target:
            lo = rate if lo is None else max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
        if hi is None:
            rate *= 2
            if rate > cfg.max_rate:
                break
        elif lo is None:
            rate /= 2
            if rate < cfg.min_rate:
                break
        elif (hi - lo) / hi <= cfg.rel_tol:
            break
        else:
            rate = (lo + hi) / 2
    return SweepOutcome(max_rate=lo or 0.0, bracketed=hi is not None, points=points)
