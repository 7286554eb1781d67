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
