"""The `auto` speculation length: k per sequence per step (0 = off), chosen to maximize expected accepted
tokens per second. A pure function of a snapshot (no clock, no state): the engine and the simulator both
call it. In the engine it now picks the first k a batch-size bucket probes; the goodput guard
(spec/guard.py) then keeps the k whose *measured* tokens/s is best, since this model's choices were
measured below off (session 7: k = 0 for n-gram at batch 1 where a fixed k = 4 is 1.3x faster).

With per-sequence acceptance rate α_i (the chance a drafted token is kept, measured), k_i drafted tokens
yield E(α, k) = (1 − α^(k+1)) / (1 − α) tokens in expectation (the kept drafts plus the target's own token).
The step costs, from the engine's measurements of its own steps at the current batch size
(engine/spec/step_cost.py),

    T(k) = base + s · n + t · (Σk_i + prefill) + d_step · max_i k_i + d_tok · Σk_i + e · #{k_i > 0}
           + d_call · [any k > 0]

and the policy maximizes G(k) = Σ_i E(α_i, k_i) / T(k), a ratio: Dinkelbach's iteration solves it exactly
(λ ← G(k); for every cap K = max k_i, each sequence independently maximizes E(α_i, k) − λ·(c·k + e·[k>0]),
c = t + d_tok the marginal cost of one drafted token; then the best K including its d_step · K). When
drafting is slow or the batch is large, λ·c exceeds every α and k = 0: speculation turns itself off under
load. That case is found in O(n) before any iteration (no α_i beats λ₀·c with λ₀ = G(all zeros)), so the
policy costs little when it says "off".

Hysteresis: the previous step's choice is kept unless the new one's predicted goodput is higher by more
than `hysteresis` (relative), so measurement noise does not flip k back and forth.
"""

from __future__ import annotations

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
    spec_seq_s: float = 0.0  # cost per speculating sequence (proposal and verification bookkeeping)


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k) = (1 − α^(k+1)) / (1 − α): tokens a step yields with k drafts kept at rate α (α = 1: k + 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _cost(snap: SpecSnapshot, ks) -> float:
    t = snap.target
    sk = sum(ks)
    if not sk:
        return t.base + t.per_seq * len(ks) + t.per_token * snap.prefill_tokens
    return (t.base + t.per_seq * len(ks) + t.per_token * (sk + snap.prefill_tokens)
            + snap.draft_step_s * max(ks) + snap.draft_token_s * sk + snap.draft_call_s
            + snap.spec_seq_s * sum(1 for k in ks if k))


def _goodput(snap: SpecSnapshot, alphas, ks) -> float:
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks)) / max(_cost(snap, ks), 1e-12)


def choose_k(snap: SpecSnapshot, cfg: SpecPolicyConfig = SpecPolicyConfig()) -> tuple[int, ...]:
    n = len(snap.alphas)
    if n == 0:
        return ()
    hi = cfg.max_alpha
    alphas = [a if 0.0 <= a <= hi else (0.0 if a < 0 else hi) for a in snap.alphas]
    kmax = cfg.k_max
    caps = [c if 0 <= c <= kmax else (0 if c < 0 else kmax) for c in snap.caps]
    zeros = (0,) * n
    g0 = n / max(_cost(snap, zeros), 1e-12)
    c = snap.target.per_token + snap.draft_token_s  # marginal cost of one more drafted token
    e = snap.spec_seq_s
    best_ks, best_g = zeros, g0
    hopeful = [a for a, cap in zip(alphas, caps) if cap]
    if hopeful and max(hopeful) > g0 * c:  # else no sequence's first draft is worth its marginal cost: all off
        # E_i(k) - 1 = α + α² + ... + α^k: prefix sums per sequence, computed once
        gains = []
        for a, cap in zip(alphas, caps):
            row, acc, p = [0.0], 0.0, 1.0
            for _ in range(cap):
                p *= a
                acc += p
                row.append(acc)
            gains.append(row)
        lam = g0
        for _ in range(cfg.iterations):
            # for each cap K: every sequence's best k <= K for this λ (independent), then the step's value
            cur = [0] * n  # best k so far per sequence, as K grows
            val = [0.0] * n  # its value E - 1 - λ(ck + e)
            lc, le = lam * c, lam * e
            round_best, round_obj = zeros, 0.0  # objective Σ(E_i - 1 - λ cost_i) - λ fixed(K); K = 0 gives 0
            for K in range(1, kmax + 1):
                changed = False
                for i in range(n):
                    row = gains[i]
                    if K < len(row):
                        v = row[K] - lc * K - le
                        if v > val[i]:
                            val[i], cur[i] = v, K
                            changed = True
                if not changed and K > 1:
                    continue
                obj = sum(val) - lam * (snap.draft_step_s * max(cur) + snap.draft_call_s) if any(cur) else 0.0
                if obj > round_obj + 1e-15:
                    round_best, round_obj = tuple(cur), obj
            if round_obj <= 0:
                break
            g = _goodput(snap, alphas, round_best)
            if g <= best_g * (1 + 1e-12):
                break
            best_ks, best_g, lam = round_best, g, g
    if any(p is not None for p in snap.prev_k):
        keep = tuple(min(p, cap) if p is not None else k for p, cap, k in zip(snap.prev_k, caps, best_ks))
        if keep != best_ks and best_g <= _goodput(snap, alphas, keep) * (1 + cfg.hysteresis):
            return keep
    return best_ks
