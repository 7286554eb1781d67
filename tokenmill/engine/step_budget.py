"""How many tokens a step may batch so that the requests decoding in it keep their TPOT.

A decoding request gets one token per step, so its TPOT is the step time. A step that also carries a long
prefill chunk is slower for every decoder in it: with a 2048-token budget on a CPU one such step can take
longer than a whole interactive TPOT SLO. The step-time model, fitted online from the steps the engine
ran,

    step_s ≈ base_s + decode_s · decode_seqs + prefill_s · prefill_tokens

gives the prefill tokens that fit in `headroom` x the tightest TPOT SLO among the requests decoding:

    prefill_tokens = (headroom · tpot_slo_s - base_s - decode_s · decode_seqs) / prefill_s

floored at `min_prefill_tokens` (prefill must progress even when decodes alone fill the budget: the
admission control, not the chunk size, is what keeps that from lasting). No SLO among the decoders: the
configured maximum. The model is exponentially-forgetting least squares over (1, decode_seqs,
prefill_tokens) with a weak prior; nothing here reads a clock (the caller measures the step and calls
`observe`), so a simulator can drive it with modelled step times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
try:  # numpy's private gufunc module: absent in some release, `coef` takes np.linalg.solve alone (the same values)
    from numpy.linalg import _umath_linalg
except ImportError:  # pragma: no cover - depends on the numpy release
    _umath_linalg = None

_SOLVE1 = getattr(_umath_linalg, "solve1", None)  # the gufunc np.linalg.solve(a, b) calls for a 1-d b


@dataclass(frozen=True)
class StepBudgetConfig:
    enabled: bool = True
    headroom: float = 0.8  # a step may use this share of the tightest TPOT SLO among the decoders
    min_prefill_tokens: int = 32  # prefill tokens a step may always carry
    decay: float = 0.98  # per observed step: memory ~50 steps
    prior_weight: float = 2.0  # in steps
    prior_base_s: float = 0.005
    prior_decode_s: float = 0.0005
    prior_prefill_s: float = 0.0001

    def __post_init__(self):
        if not 0 < self.headroom <= 1:
            raise ValueError(f"step budget headroom must be in (0, 1], got {self.headroom}")
        if self.min_prefill_tokens < 1:
            raise ValueError(f"step budget min_prefill_tokens must be >= 1, got {self.min_prefill_tokens}")
        if not 0 < self.decay < 1 or self.prior_weight <= 0:
            raise ValueError("step budget needs decay in (0, 1) and prior_weight > 0")


def step_composition(sched) -> tuple[int, int]:
    """(decode_seqs, prefill_tokens) of a scheduled step (a SchedulerOutput) as the step-time model counts
    them: a decode is a sequence of one token with its logit; every other token batched is prefill. The one
    definition for the engine (LLMEngine.step) and the simulator (sim/worker.py)."""
    decodes = sum(1 for s in sched.seqs if len(s.token_ids) == 1 and s.num_logits)
    return decodes, sched.num_batched_tokens - decodes


WELL_POSED = 1e-9  # |det a| / (product of its rows' 1-norms) above this: the direct gufunc call (coef)


def _well_posed(a: list[list[float]]) -> bool:
    """Whether the 3x3 system is far from singular: |det| over the product of the rows' 1-norms (Hadamard's
    bound: <= 1) above WELL_POSED: far from singular, so LU meets no zero pivot and the gufunc np.linalg.solve calls
    gives a finite solution without a warning; otherwise `coef` goes through np.linalg.solve itself (which
    raises LinAlgError on a singular system). Only which of two calls of the same gufunc is used depends on
    it, never the value."""
    if _SOLVE1 is None:
        return False
    (a00, a01, a02), (a10, a11, a12), (a20, a21, a22) = a
    det = a00 * (a11 * a22 - a12 * a21) - a01 * (a10 * a22 - a12 * a20) + a02 * (a10 * a21 - a11 * a20)
    norms = (abs(a00) + abs(a01) + abs(a02)) * (abs(a10) + abs(a11) + abs(a12)) * (abs(a20) + abs(a21) + abs(a22))
    return abs(det) > WELL_POSED * norms


class StepBudget:
    def __init__(self, cfg: StepBudgetConfig | None = None):
        self.cfg = c = cfg or StepBudgetConfig()
        prior = np.array([c.prior_base_s, c.prior_decode_s, c.prior_prefill_s])
        # the prior as pseudo-observations: one step of each pure kind at typical sizes
        xs = np.array([[1.0, 0.0, 0.0], [1.0, 16.0, 0.0], [1.0, 0.0, 512.0]])
        # the normal equations a · coef = b, kept as Python floats (3x3 and 3): updated per observed step
        self._a: list[list[float]] = (c.prior_weight * sum(np.outer(x, x) for x in xs)).tolist()
        self._b: list[float] = (c.prior_weight * sum(x * float(x @ prior) for x in xs)).tolist()
        self._coef = prior.copy()
        self._coef_f: list[float] = self._coef.tolist()  # the same values as Python floats (token_budget's)
        self._stale = False  # observed since the last solve: `coef` solves on its next read
        self.samples = 0

    @property
    def coef(self) -> np.ndarray:
        """(base_s, decode_s, prefill_s): the least-squares solution of the steps observed so far. Solved when
        read, not per observed step: the same value as solving after every `observe` (a · coef = b has one
        solution per state), at one solve per step that reads it (`token_budget` with a TPOT SLO) instead of
        one per step observed. `a` is the decayed prior (positive definite) plus outer products; only when the
        prior has decayed to underflow (tens of thousands of steps of one shape) can it be exactly singular:
        then the last solved value is kept -- per step that was the last state solved, here the last one read."""
        if self._stale:
            self._stale = False
            coef = _SOLVE1(self._a, self._b, signature="dd->d") if _well_posed(self._a) else None
            if coef is None or not np.isfinite(coef).all():
                # np.linalg.solve: the same gufunc on the same float64 arrays (so the same bits), plus its
                # argument checks and error state (~6 us a call), needed only to tell a singular system
                # (LinAlgError; the gufunc alone gives nan and a RuntimeWarning) from a finite solution
                try:
                    coef = np.linalg.solve(np.array(self._a), np.array(self._b))
                except np.linalg.LinAlgError:
                    return self._coef
            self._coef = np.maximum(coef, [0.0, 0.0, 1e-7])  # a step never gets cheaper with more work
            self._coef_f = self._coef.tolist()
        return self._coef

    def observe(self, decode_seqs: int, prefill_tokens: int, seconds: float) -> None:
        """One step ran `decode_seqs` decode tokens and `prefill_tokens` prompt tokens in `seconds`."""
        self.observe_many(decode_seqs, prefill_tokens, (seconds,))

    def observe_many(self, decode_seqs: int, prefill_tokens: int, seconds) -> None:
        """Consecutive steps of the same shape that ran in `seconds` (one per step): the same state as one
        `observe` per step, in the same float operations (the simulator's fast-forward of decode-only steps
        relies on that); the solve waits for the next read of `coef`."""
        x = (1.0, float(decode_seqs), float(prefill_tokens))
        if decode_seqs + prefill_tokens <= 0:
            return
        d = self.cfg.decay
        (a0, a1, a2), b = self._a, self._b
        x0, x1, x2 = x
        # a[i][j] <- d·a[i][j] + x[i]·x[j];  b[i] <- d·b[i] + x[i]·s  (written out: the per-step update)
        p00, p01, p02, p10, p11, p12, p20, p21, p22 = (x0 * x0, x0 * x1, x0 * x2, x1 * x0, x1 * x1, x1 * x2,
                                                       x2 * x0, x2 * x1, x2 * x2)
        n = 0
        # the entries as locals through the loop (written back once): the same operations per entry and step
        a00, a01, a02 = a0
        a10, a11, a12 = a1
        a20, a21, a22 = a2
        b0, b1, b2 = b
        for s in seconds:
            if not (s > 0 and math.isfinite(s)):
                continue
            a00, a01, a02 = d * a00 + p00, d * a01 + p01, d * a02 + p02
            a10, a11, a12 = d * a10 + p10, d * a11 + p11, d * a12 + p12
            a20, a21, a22 = d * a20 + p20, d * a21 + p21, d * a22 + p22
            b0, b1, b2 = d * b0 + x0 * s, d * b1 + x1 * s, d * b2 + x2 * s
            n += 1
        if n:
            a0[:] = a00, a01, a02
            a1[:] = a10, a11, a12
            a2[:] = a20, a21, a22
            b[:] = b0, b1, b2
            self._stale = True
            self.samples += n

    def predict_s(self, decode_seqs: int, prefill_tokens: int) -> float:
        base, per_decode, per_prefill = self.coef
        return float(base + per_decode * decode_seqs + per_prefill * prefill_tokens)

    def budget_for(self, scheduler, max_tokens: int) -> int:
        """token_budget for the next step of `scheduler` (a Scheduler, or an engine with the same two methods):
        its decoding requests and their tightest TPOT SLO (the engine's step loop and the simulator's worker
        both size steps through this)."""
        return self.token_budget(scheduler.num_decoding(), scheduler.tightest_tpot_slo_s(), max_tokens)

    def token_budget(self, decode_seqs: int, tpot_slo_s: float | None, max_tokens: int) -> int:
        """Tokens (decodes included) the next step may batch."""
        if not self.cfg.enabled or tpot_slo_s is None:
            return max_tokens
        if self._stale:
            self.coef  # noqa: B018 - solves
        # Python floats: the same IEEE double operations as on the array's float64 scalars, a few us cheaper
        base, per_decode, per_prefill = self._coef_f
        room_s = self.cfg.headroom * tpot_slo_s - base - per_decode * decode_seqs
        prefill = int(room_s / per_prefill) if room_s > 0 else 0
        return min(max_tokens, decode_seqs + max(self.cfg.min_prefill_tokens, prefill))
