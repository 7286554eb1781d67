"""Service-level objectives per request class, and their `--slo` syntax."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tokenmill.cli import CLIError


@dataclass(frozen=True)
class SLO:
    """Latency bounds one request must meet to count as good; None = no bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


def _default_slos() -> dict[str, SLO]:
    """The serving side's workload classes (tokenmill/router/classes.py) are the one source of the defaults;
    a sheddable class (batch) has no latency SLO to be judged by: its bounds there only limit how long a
    request is held."""
    from tokenmill.router.classes import DEFAULT_CLASSES

    return {c.name: SLO() if c.sheddable else SLO(ttft_ms=c.ttft_slo_s * 1000.0, tpot_ms=c.tpot_slo_s * 1000.0)
            for c in DEFAULT_CLASSES}


# Defaults per class; documented in docs/benchmarks/bench.md, overridden with --slo.
DEFAULT_SLOS: dict[str, SLO] = _default_slos()

_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms"}


def parse_slo(spec: str) -> tuple[str, dict[str, float | None]]:
    """'interactive:ttft=500,tpot=50' -> ('interactive', {...}); without 'CLASS:' the class is '*' (all)."""
    cls, sep, body = spec.partition(":")
    if not sep:
        cls, body = "*", spec
    cls = cls.strip()
    if not cls or not body.strip():
        raise CLIError(f"--slo {spec!r}: expected CLASS:ttft=MS,tpot=MS[,e2e=MS]")
    bounds: dict[str, float | None] = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS:
            raise CLIError(f"--slo {spec!r}: {item!r} is not KEY=MS with KEY one of ttft, tpot, e2e")
        value = value.strip().lower()
        if value in ("none", "inf", ""):
            bounds[_KEYS[key]] = None
            continue
        try:
            ms = float(value)
        except ValueError:
            raise CLIError(f"--slo {spec!r}: {key}={value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise CLIError(f"--slo {spec!r}: {key} must be a positive number of milliseconds")
        bounds[_KEYS[key]] = ms
    return cls, bounds


def resolve_slos(specs: list[str], classes: set[str]) -> dict[str, SLO]:
    """SLO per class: the defaults, then `--slo` overrides in order ('*' applies to every class)."""
    slos = {c: DEFAULT_SLOS.get(c, SLO()) for c in sorted(classes | set(DEFAULT_SLOS))}
    for spec in specs:
        cls, bounds = parse_slo(spec)
        targets = list(slos) if cls == "*" else [cls]
        for c in targets:
            slos[c] = replace(slos.get(c, SLO()), **bounds)
    return slos
