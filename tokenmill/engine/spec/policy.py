"""The `auto` speculation length: k per sequence per step (0 = off), chosen to maximize expected accepted
tokens per second. A pure function of a snapshot (no clock, no state): the engine and the simulator both
call it.

With per-sequence acceptance rate α_i (the chance a drafted token is kept, measured), k_i drafted tokens
yield E(α, k) = (1 − α^(k+1)) / (1 − α) tokens in expectation (the kept drafts plus the target's own token).
The step costs, from the engine's online fits of its own measured step times,

    T(k) = base + s · n + t · (Σk_i + prefill tokens)  +  d_call · [any k > 0] + d_step · max_i k_i + d_tok · Σk_i

and the policy maximizes G(k) = Σ_i E(α_i, k_i) / T(k), a ratio: Dinkelbach's iteration solves it exactly
for a given cap K = max k_i (λ ← G(k); k_i ← argmax E(α_i, k) − λ·c·k, which is the largest k with
α_i^k > λ·c, c the marginal cost of one drafted token), over every K in 0..k_max. When drafting is slow or
the batch is large, λ·c exceeds every α and k = 0: speculation turns itself off under load.

Hysteresis: the previous step's choice is kept unless the new one's predicted goodput is higher by more
than `hysteresis` (relative), so measurement noise does not flip k back and forth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecPolicyConfig:
    k_max: int = 6
    hysteresis: float = 0.05  # a new plan must beat the previous one's predicted goodput by this (relative)
    max_alpha: float = 0.98  # α is clamped to this (α → 1 makes every k look free)
    iterations: int = 6

    def __post_init__(self):
        if not 1 <= self.k_max <= 16:
            raise ValueError(f"spec policy k_max must be in [1, 16], got {self.k_max}")
        if self.hysteresis < 0:
            raise ValueError(f"spec policy hysteresis must be >= 0, got {self.hysteresis}")


@dataclass(frozen=True)
class StepCost:
    """Seconds: base + per_seq · decoding seqs + per_token · other tokens (drafts to verify, prefill); an online
    least-squares fit of the steps the runner ran (engine/step_budget.py's model)."""

    base: float
    per_seq: float
    per_token: float


@dataclass(frozen=True)
class SpecSnapshot:
    alphas: tuple[float, ...]  # per decoding sequence: measured acceptance rate (EMA)
    caps: tuple[int, ...]  # per sequence: the most drafts it may take (remaining tokens, context)
    prev_k: tuple[int | None, ...]  # per sequence: last step's k (None: new)
    prefill_tokens: int  # other tokens in the step (prefill chunks)
    target: StepCost
    draft_step_s: float  # cost of one draft step (a batched draft forward), paid max(k) times
    draft_token_s: float  # cost per drafted token
    draft_call_s: float = 0.0  # fixed cost of a proposal round (paid once when any k > 0)


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k) = (1 − α^(k+1)) / (1 − α): tokens a step yields with k drafts kept at rate α (α = 1: k + 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _goodput(snap: SpecSnapshot, alphas, ks) -> float:
    n = len(ks)
    sk = sum(ks)
    t = snap.target
    cost = (t.base + t.per_seq * n + t.per_token * (sk + snap.prefill_tokens)
            + snap.draft_step_s * max(ks, default=0) + snap.draft_token_s * sk + (snap.draft_call_s if sk else 0.0))
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks)) / max(cost, 1e-9)


def _largest_k(log_alpha: float, thr: float, cap: int) -> int:
    """The largest k <= cap with α^k > thr (k = 0 always qualifies)."""
    if thr <= 0:
        return cap
    if thr >= 1 or log_alpha == -math.inf:
        return 0
    r = math.log(thr) / log_alpha  # α^k > thr  <=>  k < r
    return min(cap, max(0, math.ceil(r) - 1))


def choose_k(snap: SpecSnapshot, cfg: SpecPolicyConfig = SpecPolicyConfig()) -> tuple[int, ...]:
    n = len(snap.alphas)
    if n == 0:
        return ()
    alphas = [min(max(a, 0.0), cfg.max_alpha) for a in snap.alphas]
    caps = [max(0, min(c, cfg.k_max)) for c in snap.caps]
    c = snap.target.per_token + snap.draft_token_s  # marginal cost of one more drafted token
    best_ks, best_g = [0] * n, _goodput(snap, alphas, [0] * n)
    lam = best_g
    logs = [math.log(a) if a > 0 else -math.inf for a in alphas]
    for _ in range(cfg.iterations):
        # k_i* = largest k with α_i^k > λ·c  (the marginal tokens of the k-th draft beat its marginal cost)
        thr = lam * c
        kstar = [_largest_k(lg, thr, cap) for lg, cap in zip(logs, caps)]
        round_best, round_g = None, -1.0
        for K in range(0, max(kstar, default=0) + 1):
            ks = [min(k, K) for k in kstar]
            g = _goodput(snap, alphas, ks)
            if g > round_g:
                round_best, round_g = ks, g
        if round_g <= best_g * (1 + 1e-9):
            break
        best_ks, best_g, lam = round_best, round_g, round_g
    if any(p is not None for p in snap.prev_k):
        keep = [min(p, cap) if p is not None else k for p, cap, k in zip(snap.prev_k, caps, best_ks)]
        if keep != best_ks and best_g <= _goodput(snap, alphas, keep) * (1 + cfg.hysteresis):
            return tuple(keep)
    return tuple(best_ks)
