"""The `auto` policy's measured step cost (engine/spec/step_cost.py) and the policy's optimality against an
exhaustive search over every per-sequence k (an independent reference: no Dinkelbach, no thresholds)."""

from __future__ import annotations

import itertools
import random

import pytest

from tokenmill.engine.spec.policy import SpecPolicyConfig, SpecSnapshot, StepCost, _goodput, choose_k
from tokenmill.engine.spec.step_cost import SpecStepCost, StepCostConfig


def _true_step_s(n, sum_k, max_k, spec):
    """A cost with the CPU's shape: extra rows are nearly free at small batch, full price at large batch."""
    per_token = 2e-6 if n <= 2 else 6e-5
    return 9e-4 + 1e-4 * n + per_token * sum_k + 2.6e-4 * max_k + 2e-5 * spec


def _feed(cost, shapes, repeats=10):
    for _ in range(repeats):
        for sh in shapes:
            cost.observe(*sh, _true_step_s(*sh))


def test_local_fit_recovers_the_cost_where_it_was_measured():
    cost = SpecStepCost(StepCostConfig(), k_scale=6)
    shapes = []
    for n in (1, 2, 16, 32, 64):
        shapes += [(n, 0, 0, 0), (n, n, 1, n), (n, 2 * n, 2, n), (n, 4 * n, 4, n), (n, 2 * n, 4, n // 2 or 1)]
    _feed(cost, shapes)
    for n in (1, 32, 64):
        c = cost.at(n)
        for sh in [s for s in shapes if s[0] == n]:
            assert c.step_s(*sh) == pytest.approx(_true_step_s(*sh), rel=0.05), (n, sh, c)
    # per drafted token: cheap at batch 1, full price at batch 64 (a global linear fit cannot have both)
    assert 2 * cost.at(1).per_token < cost.at(64).per_token == pytest.approx(6e-5, rel=0.2)


def test_a_steady_shape_does_not_erase_what_exploration_measured():
    """An exponentially forgetting fit loses the per-token slope when every step has one shape; the cells
    keep it: 10,000 steps at k = 2 after a few at k = 1 and 3 leave the marginal cost of a draft intact."""
    cost = SpecStepCost(StepCostConfig(), k_scale=6)
    n = 16
    _feed(cost, [(n, n, 1, n), (n, 3 * n, 3, n), (n, 0, 0, 0)], repeats=3)
    _feed(cost, [(n, 2 * n, 2, n)], repeats=10_000)
    c = cost.at(n)
    for sh in [(n, 0, 0, 0), (n, n, 1, n), (n, 3 * n, 3, n)]:
        assert c.step_s(*sh) == pytest.approx(_true_step_s(*sh), rel=0.05)


def test_unseen_cost_falls_back_to_the_prior_and_bad_config_is_an_error():
    prior = (1e-3, 1e-4, 5e-5, 2e-4, 1e-5)
    c = SpecStepCost(StepCostConfig(prior=prior)).at(8)
    assert (c.base, c.per_seq, c.per_token, c.per_draft_step, c.per_spec_seq) == prior
    with pytest.raises(ValueError, match="cell_decay"):
        StepCostConfig(cell_decay=1.0)
    with pytest.raises(ValueError, match="prior"):
        StepCostConfig(prior=(1.0, 2.0))


def _snap(alphas, caps, cost, prefill=0, prev=None):
    n = len(alphas)
    return SpecSnapshot(alphas=tuple(alphas), caps=tuple(caps), prev_k=(prev,) * n if prev is None else tuple(prev),
                        prefill_tokens=prefill, target=StepCost(cost[0], cost[1], cost[2]), draft_step_s=cost[3],
                        draft_token_s=cost[4], spec_seq_s=cost[5], draft_call_s=cost[6])


@pytest.mark.parametrize("seed", range(12))
def test_policy_is_optimal_per_sequence_against_exhaustive_search(seed):
    """Heterogeneous α and caps, every cost term non-zero: choose_k reaches the best goodput of all
    (k_1..k_n) in [0, cap_i]^n."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    alphas = [rng.uniform(0.05, 0.97) for _ in range(n)]
    caps = [rng.randint(0, 4) for _ in range(n)]
    cost = (rng.uniform(2e-4, 2e-3), rng.uniform(1e-5, 3e-4), rng.uniform(1e-6, 3e-4), rng.uniform(0, 4e-4),
            rng.uniform(0, 5e-5), rng.uniform(0, 1e-4), rng.uniform(0, 2e-4))
    snap = _snap(alphas, caps, cost, prefill=rng.choice([0, 0, 64]))
    best = max(_goodput(snap, alphas, list(ks)) for ks in itertools.product(*[range(c + 1) for c in caps]))
    got = choose_k(snap, SpecPolicyConfig(k_max=4, max_alpha=0.98))
    assert all(0 <= k <= c for k, c in zip(got, caps))
    assert _goodput(snap, alphas, list(got)) >= best * (1 - 1e-9), (got, alphas, caps, cost)


def test_policy_off_under_load_is_cheap_and_exact():
    """At batch 256 with the marginal draft dearer than any α can repay, every k is 0."""
    cost = (1e-3, 1e-4, 1e-4, 2.5e-4, 0.0, 3e-5, 0.0)
    snap = _snap([0.7] * 256, [6] * 256, cost)
    assert set(choose_k(snap)) == {0}
    assert _goodput(snap, snap.alphas, [0] * 256) >= _goodput(snap, snap.alphas, [1] * 256)
