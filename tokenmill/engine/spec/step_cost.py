"""SpecStepCost: what a decode step costs as a function of its shape, measured, for the `auto` policy.

A step's shape is (n, Σk, K, s): n decoding sequences, Σk drafted tokens to verify, K = max k (a draft model
runs K forwards), s sequences speculating. The engine measures each decode-only step from plan() to the end
of postprocess (the proposal, the target's verify, the bookkeeping: everything speculation changes) and
calls `observe` with the shape. Nothing here reads a clock.

Why not one online least-squares fit over all steps (the first `auto`, engine/step_budget.py's model): at a
steady load every step has the same shape, so an exponentially forgetting fit cannot tell the base from the
per-token cost, and a global linear model is wrong at both ends anyway (on a CPU a few more rows through a
weight-bound matmul are nearly free at batch 1 and cost their share at batch 64: that is the reversal).

So measurements are kept per shape (a cell: an EMA of its step times, never forgotten because the shape
stopped occurring) and the coefficients for the current n are a *local* fit: weighted least squares of

    T ≈ base + per_seq · n + per_token · Σk + per_draft_step · K + per_spec_seq · s

over the cells, each weighted by its sample count (capped) and by how close its n is to the current n
(Gaussian in log n), plus a ridge toward a prior so that shapes never seen are priced by the prior. The
fit at one n is cached until `refit_every` new observations arrived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCostConfig:
    cell_decay: float = 0.8  # EMA of a cell's step times (weight of the old mean per new sample)
    max_cell_weight: float = 8.0  # samples a cell counts as, at most
    max_cells: int = 512
    log_n_width: float = 0.3  # locality: a cell at n' weighs exp(-(ln(n'/n))^2 / (2 width^2))
    prior_weight: float = 0.5  # ridge strength toward the prior, in cells
    refit_every: int = 16
    # prior seconds: base, per decoding sequence, per drafted token, per draft step, per speculating sequence
    prior: tuple[float, float, float, float, float] = (8e-4, 1e-4, 5e-5, 2.5e-4, 3e-5)

    def __post_init__(self):
        if not 0 <= self.cell_decay < 1:
            raise ValueError(f"step cost cell_decay must be in [0, 1), got {self.cell_decay}")
        if self.max_cells < 8 or self.refit_every < 1 or self.log_n_width <= 0 or self.prior_weight <= 0:
            raise ValueError("step cost needs max_cells >= 8, refit_every >= 1, log_n_width > 0, prior_weight > 0")
        if len(self.prior) != 5 or min(self.prior) < 0:
            raise ValueError(f"step cost prior must be 5 seconds >= 0, got {self.prior}")


@dataclass(frozen=True)
class LocalCost:
    """Seconds per step at one n: base (incl. per_seq · n), per drafted token, per draft step, per spec seq."""

    base: float
    per_seq: float
    per_token: float
    per_draft_step: float
    per_spec_seq: float

    def step_s(self, n: int, sum_k: int, max_k: int, spec_seqs: int) -> float:
        return (self.base + self.per_seq * n + self.per_token * sum_k + self.per_draft_step * max_k
                + self.per_spec_seq * spec_seqs)


class SpecStepCost:
    def __init__(self, cfg: StepCostConfig | None = None, k_scale: int = 4):
        self.cfg = cfg or StepCostConfig()
        self.k_scale = max(1, k_scale)
        self.cells: dict[tuple[int, int, int, int], list[float]] = {}  # shape -> [mean s, samples, last seen]
        self.num_obs = 0
        self._fit: tuple[int, int, LocalCost] | None = None  # (n, num_obs at fit, coefficients)

    def observe(self, n: int, sum_k: int, max_k: int, spec_seqs: int, seconds: float) -> None:
        if n <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        self.num_obs += 1
        key = (n, sum_k, max_k, spec_seqs)
        c = self.cells.get(key)
        if c is None:
            if len(self.cells) >= self.cfg.max_cells:  # forget the shape seen longest ago
                del self.cells[min(self.cells, key=lambda k: self.cells[k][2])]
            self.cells[key] = [seconds, 1.0, float(self.num_obs)]
            self._fit = None  # a new shape: refit at the next query
            return
        d = self.cfg.cell_decay
        c[0] = d * c[0] + (1 - d) * seconds if c[1] >= 1 else seconds
        c[1] = min(c[1] + 1, self.cfg.max_cell_weight)
        c[2] = float(self.num_obs)

    def samples(self, n: int, sum_k: int, max_k: int, spec_seqs: int) -> float:
        c = self.cells.get((n, sum_k, max_k, spec_seqs))
        return c[1] if c is not None else 0.0

    def at(self, n: int) -> LocalCost:
        f = self._fit
        if f is not None and f[0] == n and self.num_obs - f[1] < self.cfg.refit_every:
            return f[2]
        cost = self._solve(n)
        self._fit = (n, self.num_obs, cost)
        return cost

    def _solve(self, n: int) -> LocalCost:
        cfg = self.cfg
        prior = np.array(cfg.prior)
        if not self.cells:
            return LocalCost(*prior.tolist())
        # features scaled to O(1) at this n so that one ridge strength fits all coefficients
        scale = np.array([1.0, max(n, 1), max(n, 1) * self.k_scale, self.k_scale, max(n, 1)])
        keys = list(self.cells)
        x = np.array([(1.0, kn, sk, mk, ss) for kn, sk, mk, ss in keys]) / scale
        vals = np.array([self.cells[k][:2] for k in keys])
        dist = np.log(np.array([k[0] for k in keys], dtype=float) / max(n, 1))
        w = vals[:, 1] * np.exp(-dist * dist / (2 * cfg.log_n_width ** 2))
        y = vals[:, 0]
        xw = x * w[:, None]
        ridge = cfg.prior_weight * np.eye(5)
        b0 = prior * scale  # the prior in scaled units: the ridge pulls toward it, not toward zero
        a = xw.T @ x + ridge
        b = xw.T @ y + ridge @ b0
        try:
            beta = np.linalg.solve(a, b) / scale
        except np.linalg.LinAlgError:
            return LocalCost(*prior.tolist())
        beta = np.maximum(beta, [0.0, 0.0, 1e-7, 0.0, 0.0])  # more work never makes a step cheaper
        return LocalCost(*beta.tolist())
