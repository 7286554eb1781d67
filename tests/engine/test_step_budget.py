"""The step-time model behind the per-step token budget: fitted from observed steps, checked by hand."""

import numpy as np
import pytest

from tokenmill.engine.step_budget import StepBudget, StepBudgetConfig


def test_fit_recovers_a_linear_step_time_and_budgets_by_hand():
    sb = StepBudget(StepBudgetConfig(headroom=0.8, min_prefill_tokens=16))
    rng = np.random.default_rng(0)
    base, per_decode, per_prefill = 0.004, 0.0008, 0.00005
    for _ in range(300):
        d, p = int(rng.integers(0, 64)), int(rng.integers(0, 2048))
        sb.observe(d, p, base + per_decode * d + per_prefill * p)
    assert sb.coef == pytest.approx([base, per_decode, per_prefill], rel=0.02)
    # 10 decodes, TPOT SLO 100 ms: room = 0.08 - 0.004 - 0.008 = 0.068 s -> 1360 prefill tokens
    assert sb.token_budget(10, 0.1, 4096) == pytest.approx(10 + 1360, abs=30)
    assert sb.token_budget(10, 0.1, 512) == 512  # never above the configured maximum
    assert sb.token_budget(10, None, 4096) == 4096  # no TPOT promised: the maximum
    # decodes alone exceed the SLO: the floor keeps prefill moving
    assert sb.token_budget(200, 0.1, 4096) == 200 + 16


def test_bad_samples_are_ignored_and_config_validated():
    sb = StepBudget()
    before = sb.coef.copy()
    sb.observe(0, 0, 0.1)
    sb.observe(4, 10, float("nan"))
    sb.observe(4, 10, -1.0)
    assert np.array_equal(sb.coef, before) and sb.samples == 0
    with pytest.raises(ValueError, match="headroom"):
        StepBudgetConfig(headroom=0)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        StepBudgetConfig(min_prefill_tokens=0)
    assert StepBudget(StepBudgetConfig(enabled=False)).token_budget(1, 0.01, 777) == 777


class _EagerStepBudget:
    """The fit as it was first written: numpy normal equations, solved after every observed step."""

    def __init__(self, c: StepBudgetConfig):
        self.c = c
        prior = np.array([c.prior_base_s, c.prior_decode_s, c.prior_prefill_s])
        xs = np.array([[1.0, 0.0, 0.0], [1.0, 16.0, 0.0], [1.0, 0.0, 512.0]])
        self.a = c.prior_weight * sum(np.outer(x, x) for x in xs)
        self.b = c.prior_weight * sum(x * float(x @ prior) for x in xs)
        self.coef = prior.copy()

    def observe(self, d, p, s):
        if d + p <= 0 or not (s > 0 and np.isfinite(s)):
            return
        x = np.array([1.0, float(d), float(p)])
        for i in range(3):
            for j in range(3):
                self.a[i, j] = self.c.decay * self.a[i, j] + x[i] * x[j]
            self.b[i] = self.c.decay * self.b[i] + x[i] * s
        self.coef = np.maximum(np.linalg.solve(self.a, self.b), [0.0, 0.0, 1e-7])


def test_coef_solved_when_read_equals_solving_after_every_step():
    """`coef` is solved lazily (on read) from Python-float normal equations: bit for bit the coefficients and
    budgets of solving after every observed step, with reads, observe_many runs and bad samples interleaved."""
    rng = np.random.default_rng(3)
    cfg = StepBudgetConfig()
    sb, ref = StepBudget(cfg), _EagerStepBudget(cfg)
    for _ in range(3000):
        d, p = int(rng.integers(0, 40)), int(rng.integers(0, 3)) * int(rng.integers(0, 2048))
        if rng.random() < 0.2:
            secs = [float(x) for x in rng.uniform(0.001, 0.05, size=int(rng.integers(1, 30)))]
            sb.observe_many(d, p, secs)
            for s in secs:
                ref.observe(d, p, s)
        else:
            s = float(rng.uniform(0.001, 0.05)) if rng.random() > 0.02 else float("nan")
            sb.observe(d, p, s)
            ref.observe(d, p, s)
        if rng.random() < 0.3:
            assert sb.coef.tolist() == ref.coef.tolist()
            slo = float(rng.uniform(0.01, 0.2))
            assert sb.token_budget(d, slo, 2048) == min(2048, d + max(cfg.min_prefill_tokens, int(
                r / ref.coef[2]) if (r := cfg.headroom * slo - ref.coef[0] - ref.coef[1] * d) > 0 else 0))
    assert sb.coef.tolist() == ref.coef.tolist()


def test_singular_fit_keeps_the_last_solved_coefficients():
    """The prior decayed to underflow and one step shape since: a · coef = b is exactly singular. np.linalg.solve
    raises there; `coef` (whose fast path calls the solve's gufunc directly, which gives nan and a warning
    instead) keeps the last solved value, as before, without a warning, and token_budget reads it."""
    import warnings

    cfg = StepBudgetConfig(decay=1e-200)
    sb = StepBudget(cfg)
    sb.observe(4, 0, 0.01)
    sb.observe(4, 0, 0.01)  # the prior (and the first step) decayed to 0: a = x x^T, rank 1
    with pytest.raises(np.linalg.LinAlgError):
        np.linalg.solve(np.array(sb._a), np.array(sb._b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the singular system never reaches the bare gufunc (_well_posed)
        before = sb.coef.tolist()
        assert before == [cfg.prior_base_s, cfg.prior_decode_s, cfg.prior_prefill_s]  # never solved: the prior
        sb.observe(4, 0, 0.01)
        assert sb.coef.tolist() == before
        assert sb.token_budget(4, 0.1, 4096) == min(4096, 4 + max(cfg.min_prefill_tokens, int(
            (cfg.headroom * 0.1 - before[0] - before[1] * 4) / before[2])))


def test_well_posed_guard():
    """_well_posed: a regular fit's normal equations take the direct gufunc call; singular and nearly singular
    ones do not (a mutation returning True always fails the singular-fit test above with a RuntimeWarning)."""
    from tokenmill.engine.step_budget import _well_posed

    sb = StepBudget()
    assert _well_posed(sb._a)
    assert not _well_posed([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 1.0, 1.0]])
    assert not _well_posed([[1.0, 1.0, 0.0], [1.0, 1.0 + 1e-12, 0.0], [0.0, 0.0, 1.0]])
