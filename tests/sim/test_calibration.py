"""The calibrated cost model's serving overhead (session 13, AVX2): what a served engine loses per step, per
streamed token and per request, fitted from the engine core's step trace of the calibration's own serving runs;
and the grid fit on per-cell medians (robust to another process's burst on a shared machine)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.bench.runner import LoadConfig
from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.cli import CLIError
from tokenmill.sim.calibrate import GAP_CAP_S, cell_medians, fit_serving, fit_serving_kinds, serving_excess
from tokenmill.sim.cost_model import KIND_TERMS, STEP_KINDS, Calibrated, Roofline, StepShape, nnls, step_kind
from tokenmill.sim.hardware import CATALOG as HW
from tokenmill.sim.models import CATALOG as MODELS
from tokenmill.model.row_buckets import onednn_rows

from .test_sim import profile, sim

COEF = [0.004, 1e-4, 0.0, 1e-7, 7e-7, 1e-4]


def test_step_shape_counts_the_requests_scheduled_for_the_first_time():
    kv = KVCacheManager(64, 16, True)
    s = Scheduler(SchedulerConfig(256, 16, 64), kv)
    for i in range(3):
        s.add(Request(f"r{i}", list(range(1 + i, 41 + i)), SamplingParams(max_tokens=4, ignore_eos=True)))
    first = s.schedule(0.0, 100)  # r0, r1 whole and 20 tokens of r2: all three start here
    assert StepShape.of(first).new_requests == 3
    for r in list(s.running):
        if r.num_computed_tokens < r.num_tokens:
            continue
        r.append_output(7)
    second = s.schedule(0.0, 100)  # the decodes of r0, r1 and the rest of r2: nothing new
    assert StepShape.of(second).new_requests == 0


def test_per_request_overhead_is_charged_once_per_new_request_and_never_to_the_roofline():
    serving = {"step_s": 5e-4, "per_seq_s": 2e-4, "per_request_s": 3e-3}
    cal, plain = Calibrated(COEF, {"serving": serving}), Calibrated(COEF, {"serving": {**serving, "per_request_s": 0}})
    shape = StepShape(tokens=300, prefill_tokens=296, decode_seqs=4, attn_pairs=5e4, decode_ctx=800, logits=6)
    for k in (1, 2, 5):
        with_k = StepShape(**{**shape.__dict__, "new_requests": k})
        assert cal.step_s(with_k) == pytest.approx(plain.step_s(with_k) + k * 3e-3)
    assert cal.step_s(shape) == plain.step_s(shape)
    assert cal.engine_step_s(StepShape(**{**shape.__dict__, "new_requests": 5})) == cal.engine_step_s(shape)
    roof = Roofline(MODELS["llama-3.1-8b"], HW["h100"])
    assert roof.step_s(StepShape(**{**shape.__dict__, "new_requests": 5})) == roof.step_s(shape)
    with pytest.raises(Exception, match="per_request_s"):
        Calibrated(COEF, {"serving": {"per_request_s": -1.0}})


def test_per_request_overhead_adds_to_a_lone_requests_ttft_once(tmp_path):
    """Hand computation: a 10 ms step, 4 ms before the engine, 3 ms per new request: the first token at
    4 + (10 + 3) ms, every next one 10 ms later (the request is new in its first step only)."""
    hw = profile(tmp_path, [0.010, 0, 0, 0, 0, 0],
                 serving={"step_s": 0, "per_seq_s": 0, "per_request_s": 0.003, "request_s": 0.004})
    result, _ = sim(tmp_path, hw, "batch:prompt=100,output=20,spread=0", LoadConfig("concurrency", concurrency=1,
                    num_requests=3))
    for r in result.runs[0].records:
        assert r.ttft_s == pytest.approx(0.017)
        assert r.tpot_s == pytest.approx(0.010)


def _trace(rng, n_steps, decodes, new_every, terms, fit):
    """A synthetic step trace whose steps + pauses exceed the fit by the serving terms (per step, per token,
    per new request, per prefill token), with idle pauses (> GAP_CAP_S) between bursts that must not count."""
    a, b, r, q = terms
    t, steps = 0.0, []
    for i in range(n_steps):
        new = 1 if i % new_every == 0 else 0
        chunk = int(rng.integers(20, 400)) * new
        d = dict(tokens=decodes + chunk, prefill_tokens=chunk, decode_seqs=decodes, attn_pairs=1000.0,
                 decode_ctx=100 * decodes, prefill_ctx=0, logits=decodes + new, new_requests=new)
        shape = StepShape(**d)
        excess = a + b * shape.logits + r * new + q * chunk
        gap = excess * float(rng.uniform(0.2, 0.6))  # part of the loss shows as the pause before the next step
        dur = fit(shape) + excess - gap
        d.update(t0=t, t1=t + dur)
        steps.append(d)
        t += dur + (1.0 if i % 97 == 96 else gap)  # now and then the engine idles a second instead
    return steps


def test_serving_fit_recovers_per_step_token_request_and_prefill_costs():
    cal = Calibrated(COEF, {})
    terms = (0.8e-3, 0.3e-3, 6e-3, 20e-6)
    rng = np.random.default_rng(0)
    runs = [serving_excess(_trace(rng, n, d, k, terms, cal.engine_step_s), cal.engine_step_s)
            for n, d, k in ((700, 1, 64), (300, 4, 16), (300, 16, 4), (300, 8, 2))]
    got = fit_serving(runs)
    assert list(got) == ["step_s", "per_seq_s", "per_request_s", "per_prefill_token_s"]
    # the steps before an idle second lose their pause (and its share of the excess): a small bias
    assert list(got.values()) == pytest.approx(terms, rel=0.05)
    served = Calibrated(COEF, {"serving": got})
    shape = StepShape(tokens=208, prefill_tokens=200, decode_seqs=8, attn_pairs=3e4, decode_ctx=900, logits=9,
                      new_requests=1)
    want = terms[0] + 9 * terms[1] + terms[2] + 200 * terms[3]
    assert served.step_s(shape) - cal.step_s(shape) == pytest.approx(want, rel=0.05)


def test_serving_excess_leaves_idle_pauses_out():
    cal = Calibrated(COEF, {})
    base = dict(tokens=1, prefill_tokens=0, decode_seqs=1, attn_pairs=100.0, decode_ctx=100, prefill_ctx=0, logits=1)
    f = cal.engine_step_s(StepShape(**base))
    steps = [dict(base, t0=0.0, t1=f + 0.001), dict(base, t0=f + 0.002, t1=2 * f + 0.003),
             dict(base, t0=2 * f + 0.003 + GAP_CAP_S + 0.5, t1=3 * f + 0.503 + GAP_CAP_S)]
    r = serving_excess(steps, cal.engine_step_s)
    assert r["excess_s"] == pytest.approx(0.001 + 0.001 + 0.001 + 0.0)  # step, pause, step; the idle pause: no
    assert [e for _, e in r["rows"]] == pytest.approx([0.002, 0.001, 0.0])


def test_cell_medians_ignore_a_burst_in_one_repeat():
    """Four repeats per cell from a known linear model, one repeat of each cell 3x slower (another process
    took a core): the fit on per-cell medians recovers the model; the fit on every repeat does not."""
    rng = np.random.default_rng(1)
    true = np.array([*COEF, 2e-4])  # with a mixed-step cost per decode
    samples, cells = [], []
    for c in (64, 256, 768):
        for d in (1, 4, 16, 64):
            for p in (0, 16, 256):
                cell = (c, d, p)
                slow = int(rng.integers(0, 4))
                for k in range(4):
                    shape = StepShape(tokens=d + p, prefill_tokens=p, decode_seqs=d, attn_pairs=d * c + p * (c + p / 2),
                                      decode_ctx=d * (c + k), prefill_ctx=c * (p > 0), logits=d + (p > 0))
                    t = float(shape.features() @ true) * (3.0 if k == slow else 1.0)
                    samples.append((shape, t))
                    cells.append(cell)
    x, y = cell_medians(samples, cells)
    assert len(y) == 36
    robust = nnls(x, y, weights=1 / y)
    xa = np.array([s.features() for s, _ in samples])
    ya = np.array([t for _, t in samples])
    naive = nnls(xa, ya, weights=1 / ya)
    probe = np.array([1.0, 64, 16, 16 * 300 + 64 * 332, 16 * 300, 17, 16])  # 16 decodes at 300 beside a 64-token chunk
    assert probe @ robust == pytest.approx(probe @ true, rel=0.03)
    assert abs(probe @ naive / (probe @ true) - 1) > 0.05


def test_mixed_decodes_cost_only_in_steps_with_prefill_and_old_profiles_keep_their_times(tmp_path):
    decode = StepShape(tokens=8, decode_seqs=8, attn_pairs=2000.0, decode_ctx=1992, logits=8)
    mixed = StepShape(tokens=72, prefill_tokens=64, decode_seqs=8, attn_pairs=4080.0, decode_ctx=1992, logits=9)
    prefill = StepShape(tokens=64, prefill_tokens=64, attn_pairs=2080.0, logits=1)
    assert (decode.mixed_decodes, mixed.mixed_decodes, prefill.mixed_decodes) == (0, 8, 0)
    assert list(mixed.features()) == [1.0, 64, 8, 4080.0, 1992, 9, 8]
    v1 = Calibrated(COEF, {})  # a profile from before the feature: coefficient 0, the step times of then
    assert v1.coef[-1] == 0.0
    for s in (decode, mixed, prefill):
        old = COEF[0] + COEF[1] * s.prefill_tokens + COEF[2] * s.decode_seqs + COEF[3] * s.attn_pairs \
            + COEF[4] * s.decode_ctx + COEF[5] * s.logits
        assert v1.step_s(s) == old
    v2 = Calibrated([*COEF, 5e-4], {})
    assert v2.step_s(mixed) == pytest.approx(v1.step_s(mixed) + 8 * 5e-4)
    assert v2.step_s(decode) == v1.step_s(decode) and v2.step_s(prefill) == v1.step_s(prefill)
    assert v2.engine_step_s(mixed) == pytest.approx(v2.step_s(mixed))
    old_file = profile(tmp_path, COEF)  # written with the six features of then
    import json

    data = json.loads(open(old_file).read())
    data["features"] = data["features"][:6]
    open(old_file, "w").write(json.dumps(data))
    assert Calibrated.load(old_file).step_s(mixed) == v1.step_s(mixed)


# serving terms per step kind (session 14): (step_s, scale, per_seq_s, per_request_s) -- decode-only steps lose a
# little per step and per token, mixed and prefill-only steps a share of their time (as the AVX2 server's trace)
KINDS = {"decode": (0.4e-3, 0.05, 0.25e-3, 0.0), "mixed": (1.5e-3, 0.30, 0.1e-3, 2e-3),
         "prefill": (0.5e-3, 0.40, 0.0, 4e-3)}


def _kind_trace(rng, n_steps, kinds, fit):
    """A synthetic open-loop step trace of decode-only, mixed and prefill-only steps whose steps + pauses exceed
    the engine fit by each kind's own terms, part of it as the pause after the step."""
    t, steps = 0.0, []
    for i in range(n_steps):
        kind = STEP_KINDS[int(rng.choice(3, p=[0.7, 0.2, 0.1]))]
        d = 0 if kind == "prefill" else int(rng.integers(1, 25))
        chunk = 0 if kind == "decode" else int(rng.integers(16, 600))
        new = 0 if kind == "decode" else int(rng.integers(0, 3))
        logits = d + (0 if kind == "decode" else int(rng.integers(0, 3)))
        ctx = int(rng.integers(50, 800))
        dd = dict(tokens=d + chunk, prefill_tokens=chunk, decode_seqs=d, attn_pairs=float(d * ctx + chunk * chunk / 2),
                  decode_ctx=d * ctx, prefill_ctx=0, logits=logits, new_requests=new)
        shape = StepShape(**dd)
        a, scale, q, r = kinds[kind]
        excess = a + scale * fit(shape) + q * logits + r * new
        gap = excess * float(rng.uniform(0.1, 0.5))
        dur = fit(shape) + excess - gap
        dd.update(t0=t, t1=t + dur)
        steps.append(dd)
        t += dur + gap  # (idle pauses: test_serving_excess_leaves_idle_pauses_out)
    return steps


def test_serving_fit_per_step_kind_recovers_each_kinds_terms():
    cal = Calibrated([*COEF, 3e-4], {})
    rng = np.random.default_rng(1)
    traces = [_kind_trace(rng, 1500, KINDS, cal.engine_step_s) for _ in range(2)]
    runs = [serving_excess(t, cal.engine_step_s) for t in traces]
    got = fit_serving_kinds(runs, fixed={})  # every term free (the default holds mixed steps' per_seq_s at 0)
    assert list(got) == list(STEP_KINDS) and all(list(t) == list(KIND_TERMS) for t in got.values())
    held = fit_serving_kinds(runs)
    assert held["mixed"]["per_seq_s"] == 0.0 and held["decode"] == pytest.approx(got["decode"])
    for kind, want in KINDS.items():
        for term, w, g in zip(KIND_TERMS, want, got[kind].values()):
            assert g == pytest.approx(w, rel=0.01, abs=1e-6), (kind, term)
    counts = {k: sum(r["by_kind"][k]["steps"] for r in runs) for k in STEP_KINDS}
    assert sum(counts.values()) == 3000 and min(counts.values()) > 200
    # the profile with these terms predicts each served step; one set of terms for every step (the method
    # before) misses steps of some kind by more
    served = Calibrated([*COEF, 3e-4], {"serving": {"kinds": got}})
    pooled = Calibrated([*COEF, 3e-4], {"serving": fit_serving(runs)})
    pooled_err = {}
    for kind in STEP_KINDS:
        shapes = [StepShape(**{k: v for k, v in d.items() if k not in ("t0", "t1")}) for t in traces for d in t
                  if step_kind(d["prefill_tokens"], d["decode_seqs"]) == kind]
        a, scale, q, r = KINDS[kind]
        want = np.array([cal.engine_step_s(x) * (1 + scale) + a + q * x.logits + r * x.new_requests for x in shapes])
        assert np.array([served.step_s(x) for x in shapes]) == pytest.approx(want, rel=0.01), kind
        pooled_err[kind] = float(np.percentile(np.abs(np.array([pooled.step_s(x) for x in shapes]) / want - 1), 90))
    assert max(pooled_err.values()) > 0.05, pooled_err  # p90 per step: one set of terms cannot fit them all


def test_profile_with_terms_per_step_kind_charges_each_kind_its_own():
    coef = [*COEF, 3e-4]
    kinds = {k: dict(zip(KIND_TERMS, v)) for k, v in KINDS.items()}
    cal, plain = Calibrated(coef, {"serving": {"kinds": kinds, "request_s": 0.005}}), Calibrated(coef, {})
    decode = StepShape(tokens=8, decode_seqs=8, attn_pairs=2000.0, decode_ctx=1992, logits=8)
    mixed = StepShape(tokens=72, prefill_tokens=64, decode_seqs=8, attn_pairs=4080.0, decode_ctx=1992, logits=9,
                      new_requests=1)
    prefill = StepShape(tokens=64, prefill_tokens=64, attn_pairs=2080.0, logits=1, new_requests=1)
    for shape, kind in ((decode, "decode"), (mixed, "mixed"), (prefill, "prefill")):
        a, scale, q, r = KINDS[kind]
        f = plain.step_s(shape)
        assert cal.step_s(shape) == pytest.approx(f * (1 + scale) + a + q * shape.logits + r * shape.new_requests)
        assert cal.engine_step_s(shape) == pytest.approx(f)  # the engine alone stays the in-process fit
    assert cal.request_overhead_s == 0.005


@pytest.mark.parametrize("serving,match", [
    ({"kinds": {"decode": {}, "mixed": {}}}, "exactly the step kinds"),
    ({"kinds": {"decode": {}, "mixed": {}, "prefill": {}, "spec": {}}}, "exactly the step kinds"),
    ({"kinds": {"decode": {"per_token_s": 1e-3}, "mixed": {}, "prefill": {}}}, "unknown terms"),
    ({"kinds": {"decode": {"scale": -0.1}, "mixed": {}, "prefill": {}}}, ">= 0"),
    ({"kinds": {"decode": {}, "mixed": {}, "prefill": {}}, "step_s": 1e-3}, "both `kinds`")])
def test_terms_per_step_kind_that_the_model_does_not_understand_are_errors(serving, match):
    with pytest.raises(CLIError, match=match):
        Calibrated([*COEF, 0.0], {"serving": serving})


def test_serving_fit_per_step_kind_does_not_split_a_cost_over_regressors_it_cannot_tell_apart():
    """Prefill-only steps of one-chunk prompts: every step starts one request and streams one token, so the fit
    cannot split the cost between per step, per token and per request; it keeps it on the first of them
    (was: NNLS spread it evenly, e.g. 4.8 ms per step + 4.8 per token + 4.8 per request)."""
    cal = Calibrated([*COEF, 3e-4], {})
    rng = np.random.default_rng(3)
    t, steps = 0.0, []
    for _ in range(200):
        chunk = int(rng.integers(16, 600))
        d = dict(tokens=chunk, prefill_tokens=chunk, decode_seqs=0, attn_pairs=chunk * (chunk + 1) / 2,
                 decode_ctx=0, prefill_ctx=0, logits=1, new_requests=1)
        dur = cal.engine_step_s(StepShape(**d)) * 1.3 + 0.006
        steps.append(dict(d, t0=t, t1=t + dur))
        t += dur + 0.001
    got = fit_serving_kinds([serving_excess(steps, cal.engine_step_s)])
    # (the last step has no pause after it: a small bias)
    assert got["prefill"]["step_s"] == pytest.approx(0.007, rel=0.02)
    assert got["prefill"]["scale"] == pytest.approx(0.3, rel=0.02)
    assert got["prefill"]["per_seq_s"] == got["prefill"]["per_request_s"] == 0.0
    assert got["decode"] == got["mixed"] == dict.fromkeys(KIND_TERMS, 0.0)  # no steps of theirs: the fit alone


# --- session 15: decode-only steps' serving excess as a table over the decode batch size ---------------------

def _decode_trace(rng, n_steps, excess_of_d, noise=0.3e-3, hit_every=0, hit_cost=0.0):
    """A synthetic open-loop trace of decode-only steps (batch sizes 1..40, more small ones, as at light load)
    whose step + pause exceed the engine fit by excess_of_d(d) + noise; every `hit_every`-th step also starts one
    request (a full prefix-cache hit) costing hit_cost more."""
    cal = Calibrated([*COEF, 3e-4], {})
    t, steps = 0.0, []
    for i in range(n_steps):
        d = int(min(40, 1 + rng.geometric(0.08)))
        ctx = int(rng.integers(50, 800))
        new = 1 if hit_every and i % hit_every == 0 else 0
        dd = dict(tokens=d, prefill_tokens=0, decode_seqs=d, attn_pairs=float(d * ctx), decode_ctx=d * ctx,
                  prefill_ctx=0, logits=d, new_requests=new)
        excess = excess_of_d(d) + float(rng.normal(0, noise)) + hit_cost * new
        gap = max(0.0, excess) * 0.3
        dur = cal.engine_step_s(StepShape(**dd)) + excess - gap
        steps.append(dict(dd, t0=t, t1=t + dur))
        t += dur + gap
    return steps, cal


def test_decode_table_recovers_a_non_linear_excess_and_its_own_knots_are_stable():
    """A concave excess (as the AVX2 server's decode steps: a linear per-token term fitted at small batches
    over-charges large ones) is recovered within 0.15 ms at every batch size the trace has many steps of, by two
    independent traces alike; the per-request cost of full prefix-cache hits comes out on its own term."""
    from tokenmill.sim.calibrate import fit_decode_table
    from tokenmill.sim.cost_model import table_excess

    truth = lambda d: 0.4e-3 + 1.5e-3 * np.log1p(d)  # noqa: E731
    tables = []
    for seed in (11, 12):
        steps, cal = _decode_trace(np.random.default_rng(seed), 6000, truth, hit_every=25, hit_cost=2e-3)
        got = fit_decode_table([serving_excess(steps, cal.engine_step_s)])
        assert got["step_s"] == got["scale"] == got["per_seq_s"] == 0.0
        assert got["per_request_s"] == pytest.approx(2e-3, abs=0.15e-3)
        xs = [k[0] for k in got["table"]]
        assert xs == sorted(xs) and len(xs) >= 8 and min(got["table_steps"]) >= 60
        assert 0 < got["table_slope_s"] < 1.5e-3  # the curve still rises beyond the last knot, less than at d=0
        counts = np.bincount([s["decode_seqs"] for s in steps if not s["new_requests"]])
        for d in range(1, 41):
            if counts[d] >= 60:
                assert table_excess(got["table"], got["table_slope_s"], d) == pytest.approx(truth(d), abs=0.15e-3), d
        tables.append(got)
    for d in (1, 4, 16, 30):  # two calibrations of the same server agree
        a, b = (table_excess(t["table"], t["table_slope_s"], d) for t in tables)
        assert a == pytest.approx(b, abs=0.15e-3), d
    # the linear per-kind terms fitted on the same steps (session 14's method) miss the curve by more somewhere
    steps, cal = _decode_trace(np.random.default_rng(11), 6000, truth)
    lin = fit_serving_kinds([serving_excess(steps, cal.engine_step_s)])["decode"]
    linear_err = max(abs(lin["step_s"] + lin["scale"] * cal.engine_step_s(StepShape(tokens=d, decode_seqs=d,
                     attn_pairs=400.0 * d, decode_ctx=400 * d, logits=d)) + lin["per_seq_s"] * d - truth(d))
                     for d in (1, 2, 40))
    assert linear_err > 0.3e-3


def test_profile_with_a_decode_table_charges_decode_steps_by_batch_size_only():
    from tokenmill.sim.cost_model import CostModel

    coef = [*COEF, 3e-4]
    kinds = {k: dict(zip(KIND_TERMS, v)) for k, v in KINDS.items()}
    table = [[1.0, 0.5e-3], [4.0, 1.1e-3], [10.0, 2.0e-3], [24.5, 2.6e-3]]
    kinds["decode"] = {**kinds["decode"], "table": table, "table_slope_s": 2e-5, "table_steps": [80, 90, 100, 70]}
    cal = Calibrated(coef, {"serving": {"kinds": kinds}})
    lin = Calibrated(coef, {"serving": {"kinds": {k: dict(zip(KIND_TERMS, v)) for k, v in KINDS.items()}}})
    for d in (1, 2, 3, 4, 7, 10, 20, 24, 25, 40, 64, 2000):
        shape = StepShape(tokens=d, decode_seqs=d, attn_pairs=300.0 * d, decode_ctx=300 * d, logits=d)
        want = float(np.interp(d, [k[0] for k in table], [k[1] for k in table])) if d <= 24.5 else \
            2.6e-3 + 2e-5 * (d - 24.5)  # an independent reference: numpy's interpolation, and the slope beyond
        assert cal.step_s(shape) - lin.step_s(shape) == pytest.approx(want, rel=1e-9, abs=1e-12), d
        n = 50
        assert cal.decode_run_s(shape, n) == CostModel.decode_run_s(cal, shape, n)  # bit for bit, step by step
    mixed = StepShape(tokens=72, prefill_tokens=64, decode_seqs=8, attn_pairs=4080.0, decode_ctx=1992, logits=9)
    prefill = StepShape(tokens=64, prefill_tokens=64, attn_pairs=2080.0, logits=1, new_requests=1)
    assert cal.step_s(mixed) == lin.step_s(mixed) and cal.step_s(prefill) == lin.step_s(prefill)


@pytest.mark.parametrize("decode,other,match", [
    ({"table": [[4.0, 1e-3], [2.0, 2e-3]]}, {}, "strictly"),
    ({"table": [[0.0, 1e-3]]}, {}, ">= 1"),
    ({"table": [[1.0, 1e-3]], "table_slope_s": -1e-5}, {}, "table_slope_s >= 0"),
    ({"table": [[1.0, float("nan")]]}, {}, "finite"),
    ({"table": [1.0, 2.0]}, {}, "must be"),
    ({"table_slope_s": 1e-5}, {}, "without a table"),
    ({}, {"table": [[1.0, 1e-3]]}, "unknown terms")])
def test_decode_tables_the_model_does_not_understand_are_errors(decode, other, match):
    with pytest.raises(CLIError, match=match):
        Calibrated([*COEF, 0.0], {"serving": {"kinds": {"decode": decode, "mixed": other, "prefill": {}}}})


# --- session 16: the serving runs' loads from the measured capacity; the per-request path measured directly ---


def _closed_loop_ends(rng, rate: float, n: int, sessions: int) -> list[float]:
    """Completion times of a saturating closed loop of `sessions` sessions: their first replies come together
    after the shared first prefills (the start), then completions at `rate` (Poisson), then the last `sessions`
    draining ever slower (the tail: fewer and fewer sessions left)."""
    t = 2.0 + np.sort(rng.uniform(0, 0.3, sessions))
    steady = t[-1] + np.cumsum(rng.exponential(1 / rate, n - 2 * sessions))
    tail = steady[-1] + np.cumsum([rng.exponential(sessions / (rate * k)) for k in range(sessions, 0, -1)])
    return [*t, *steady, *tail]


def test_capacity_from_a_closed_loop_leaves_its_start_and_tail_out():
    from tokenmill.sim.calibrate import CAPACITY_PROBE, capacity_from_ends

    sessions, n = CAPACITY_PROBE
    errs, naive = [], []
    for seed, rate in enumerate((3.0, 7.0, 20.0, 7.0, 7.0, 7.0)):
        ends = _closed_loop_ends(np.random.default_rng(seed), rate, n, sessions)
        errs.append(capacity_from_ends(list(reversed(ends))) / rate - 1)  # any order
        naive.append((n - 1) / (max(ends) - min(ends)) / rate - 1)  # completions over the whole run
    assert max(abs(e) for e in errs) < 0.2 and np.mean(np.abs(errs)) < 0.1, errs
    assert np.mean(np.abs(naive)) > 2 * np.mean(np.abs(errs)), (naive, errs)
    with pytest.raises(CLIError):
        capacity_from_ends([1.0, 2.0, 3.0])
    with pytest.raises(CLIError):
        capacity_from_ends([5.0] * 10)


def test_open_loop_rates_follow_the_measured_capacity_not_fixed_numbers():
    """The calibration's open-loop runs at fractions of the capacity: a 3x faster server gets 3x the rates (the
    fixed 1.5 / 4 / 6.5 req/s before session 16 gave the same on every machine); each run its own seed."""
    from tokenmill.sim.calibrate import (SERVING_LOAD_FRACTIONS, SERVING_REQUESTS, SERVING_WORKLOAD, open_loop_plan,
                                         rates_from_capacity)

    plans = {}
    for cap in (2.4, 7.2):
        plan = open_loop_plan(rates_from_capacity(cap, SERVING_LOAD_FRACTIONS), SERVING_WORKLOAD, SERVING_REQUESTS, 7)
        rates = [float(flags[flags.index("--rate") + 1]) for _, flags, _ in plan]
        assert rates == pytest.approx([f * cap for f in SERVING_LOAD_FRACTIONS], rel=5e-3)
        assert [m["rate"] for _, _, m in plan] == rates
        seeds = [flags[flags.index("--seed") + 1] for _, flags, _ in plan]
        assert len(set(seeds)) == len(seeds)
        assert [flags[flags.index("--num-requests") + 1] for _, flags, _ in plan] == [str(n) for n in SERVING_REQUESTS]
        plans[cap] = rates
    assert plans[7.2] == pytest.approx([3 * r for r in plans[2.4]], rel=1e-2)
    assert max(SERVING_LOAD_FRACTIONS) >= 0.85  # the top run loads the server at least as the fidelity check does
    assert rates_from_capacity(6.0, (0.3, 0.55, 0.85)) == (1.8, 3.3, 5.1)
    for bad in ((0.0,), (-0.5,), (3.0,), ()):
        with pytest.raises(CLIError):
            rates_from_capacity(6.0, bad)
    with pytest.raises(CLIError):
        rates_from_capacity(0.0, (0.5,))
    with pytest.raises(CLIError):
        open_loop_plan((1.0, 2.0), SERVING_WORKLOAD, (100,), 7)


def _one_stream(rng, n: int, in_s: float, out_s: float, pause_s: float):
    """A one-stream closed loop: per request, the front-end's in-path, a prefill step, a pause, decode steps; the
    first token reaches the client out_s after its step. Step times scatter; the bench clock is offset."""
    offset = 1234.5
    t, steps, recs = 100.0, [], []
    for k in range(n):
        sent = t
        path_in = in_s[k] if isinstance(in_s, (list, tuple)) else in_s
        t += path_in
        dur = float(rng.uniform(0.008, 0.02))
        steps.append(dict(t0=t, t1=t + dur, tokens=128, prefill_tokens=128, decode_seqs=0, attn_pairs=8256.0,
                          decode_ctx=0, prefill_ctx=0, logits=1, new_requests=1))
        ttft = path_in + dur + out_s
        t += dur + pause_s
        for _ in range(5):
            steps.append(dict(t0=t, t1=t + 0.002, tokens=1, prefill_tokens=0, decode_seqs=1, attn_pairs=130.0,
                              decode_ctx=130, prefill_ctx=0, logits=1, new_requests=0))
            t += 0.0022
        recs.append(dict(status="ok", sent_s=sent - offset, ttft_s=ttft))
        t += 0.01
    return steps, recs


def test_first_token_path_is_measured_from_the_trace_whatever_the_step_model_says():
    from tokenmill.sim.calibrate import first_token_path_s

    steps, recs = _one_stream(np.random.default_rng(5), 12, in_s=1.7e-3, out_s=2.6e-3, pause_s=1.1e-3)
    got = first_token_path_s(steps, list(reversed(recs)))
    # the sim charges the pause after a step inside the step: what is left per request is in + out - pause
    assert got == pytest.approx(1.7e-3 + 2.6e-3 - 1.1e-3, abs=1e-9)
    assert first_token_path_s(steps, recs[:-1]) is None  # not paired
    two = [dict(s, decode_seqs=1, tokens=129) if s["new_requests"] else s for s in steps]  # not one stream
    assert first_token_path_s(two, recs) is None


def test_first_token_path_is_the_mean_of_a_path_that_falls_in_two_groups():
    """As measured on the AMX machine (session 18): per request ~0.9 or ~2.6 ms outside the steps, 5 of 12 in the
    slow group. The sim charges one constant per request, and TTFT means add it up: the mean (1.6 ms here); the
    median (0.9 ms) flips to the other group with one request more or less in it."""
    from tokenmill.sim.calibrate import first_token_path_s

    ins = [0.9e-3] * 7 + [2.6e-3] * 5
    order = list(np.random.default_rng(2).permutation(12))
    steps, recs = _one_stream(np.random.default_rng(6), 12, in_s=[ins[i] for i in order], out_s=0.0, pause_s=0.0)
    assert first_token_path_s(steps, recs) == pytest.approx(float(np.mean(ins)), abs=1e-9)


# -- wide steps (session 18, AMX): more rows than the small-row kernels take, and the first one of a row count ------

WIDE = {"decode": {}, "mixed": {"new_shape_s": 0.006}, "prefill": {"new_shape_s": 0.006}}


@pytest.mark.parametrize("wide_rows,first_extra", [(64, 0.006), (128, 0.0)])
def test_the_first_wide_step_of_a_row_count_costs_new_shape_s_once_per_worker(tmp_path, wide_rows, first_extra):
    """Hand computation: a 10 ms step, 4 ms before the engine; prompts of 100 tokens. With wide_rows 64 the first
    request's prefill is the worker's first step of 100 rows: its first token at 4 + 10 + 6 ms; the next requests'
    prefills (100 rows again) at 4 + 10 ms. With wide_rows 128 no step is wide: 14 ms for every request."""
    hw = profile(tmp_path, [0.010, 0, 0, 0, 0, 0], serving={"kinds": WIDE, "wide_rows": wide_rows,
                                                             "request_s": 0.004})
    result, _ = sim(tmp_path, hw, "batch:prompt=100,output=20,spread=0", LoadConfig("concurrency", concurrency=1,
                    num_requests=4))
    recs = sorted(result.runs[0].records, key=lambda r: r.sent_s)
    assert len(recs) == 4 and all(r.ok for r in recs)
    assert recs[0].ttft_s == pytest.approx(0.014 + first_extra)
    for r in recs[1:]:
        assert r.ttft_s == pytest.approx(0.014)
    for r in recs:
        assert r.tpot_s == pytest.approx(0.010)  # decode steps of 1 row: never wide


def _prefill_trace(rng, n_steps, fit, scale, wide_rows, wide_scale, new_shape_s):
    """Prefill-only steps of 16-599 rows in a served engine's order: each loses scale x its fit, a wide one (>
    wide_rows) wide_scale x its fit more, and the first wide step of each row count new_shape_s more."""
    t, steps, seen = 0.0, [], set()
    for _ in range(n_steps):
        n = int(rng.integers(16, 600))
        d = dict(tokens=n, prefill_tokens=n, decode_seqs=0, attn_pairs=float(n * (n + 1) / 2), decode_ctx=0,
                 prefill_ctx=0, logits=1, new_requests=1)
        f = fit(StepShape(**d))
        wide = n > wide_rows
        rows = onednn_rows(n)  # the engine buckets wide oneDNN calls: the setup is once per bucket
        excess = scale * f + (wide_scale * f + (new_shape_s if rows not in seen else 0.0) if wide else 0.0)
        seen.add(rows)
        gap = excess * float(rng.uniform(0.1, 0.4))
        d.update(t0=t, t1=t + f + excess - gap)
        steps.append(d)
        t = d["t1"] + gap
    return steps


def test_serving_fit_recovers_the_first_wide_step_cost_that_one_scale_spreads_over_every_step():
    """mark_new_shapes + serving_excess(wide_rows) + fit_serving_kinds recover scale, wide_scale and new_shape_s
    from a trace of prefill steps whose first wide step of each oneDNN row bucket costs 8 ms more; the profile then
    predicts each step within 1%. Without them (one scale per kind: the fit before session 18) the first-time
    cost is spread over every step: a new wide one under-predicted."""
    from tokenmill.sim.calibrate import mark_new_shapes

    cal = Calibrated([*COEF, 0.0], {})
    rng = np.random.default_rng(4)
    steps = _prefill_trace(rng, 1200, cal.engine_step_s, 0.05, 256, 0.2, 0.008)
    # one new shape per 64-row bucket above 256 (320 ... 640): the engine's oneDNN row counts (onednn_rows)
    assert sum(1 for d in mark_new_shapes([dict(d) for d in steps]) if d["new_shape"] and d["tokens"] > 256) == 6
    got = fit_serving_kinds([serving_excess(mark_new_shapes(steps), cal.engine_step_s, 256)])["prefill"]
    assert got["scale"] == pytest.approx(0.05, rel=0.02)
    assert got["wide_scale"] == pytest.approx(0.2, rel=0.02)
    assert got["new_shape_s"] == pytest.approx(0.008, rel=0.02)
    served = Calibrated([*COEF, 0.0], {"serving": {"wide_rows": 256, "kinds": {
        "decode": {}, "mixed": {}, "prefill": got}}})
    old = Calibrated([*COEF, 0.0], {"serving": {"kinds": fit_serving_kinds(
        [serving_excess(steps, cal.engine_step_s)])}})  # no wide rows, no new shapes: the fit before
    narrow = StepShape(tokens=200, prefill_tokens=200, attn_pairs=200 * 201 / 2, logits=1, new_requests=1)
    wide = StepShape(tokens=400, prefill_tokens=400, attn_pairs=400 * 401 / 2, logits=1, new_requests=1)
    f_n, f_w = cal.engine_step_s(narrow), cal.engine_step_s(wide)
    assert served.step_s(narrow) == pytest.approx(1.05 * f_n, rel=0.01)
    assert served.step_s(wide) + served.new_shape_s(wide) == pytest.approx(1.25 * f_w + 0.008, rel=0.01)
    assert served.new_shape_s(narrow) == 0.0 and old.new_shape_s(wide) == 0.0
    # the fit before, the first-time cost spread over every step: a new wide step too short (with the engine's
    # 64-row buckets only ~6 such steps in 1,200, so the spread is small; per row count it was 20%+ on narrow steps)
    assert old.step_s(wide) < 1.25 * f_w + 0.008


@pytest.mark.parametrize("serving,match", [
    ({"kinds": {**WIDE}}, "without serving.wide_rows"),
    ({"kinds": {**WIDE, "mixed": {"wide_scale": 0.2}}, "wide_rows": 0}, "positive integer"),
    ({"kinds": {**WIDE}, "wide_rows": "256"}, "positive integer"),
    ({"kinds": {**WIDE, "prefill": {"new_shape_s": -1e-3}}, "wide_rows": 256}, ">= 0")])
def test_wide_step_terms_the_model_does_not_understand_are_errors(serving, match):
    with pytest.raises(CLIError, match=match):
        Calibrated([*COEF, 0.0], {"serving": serving})


def test_new_shapes_are_the_engines_onednn_row_buckets():
    """mark_new_shapes marks a step new when its oneDNN row count (linear's bucket rule) is new: 300 and 310 rows
    run as 320, 330 as 384; narrow steps (<= 256) are their own row counts."""
    from tokenmill.sim.calibrate import mark_new_shapes

    steps = [dict(tokens=n) for n in (300, 310, 330, 384, 100, 100, 101)]
    assert [d["new_shape"] for d in mark_new_shapes(steps)] == [True, False, True, False, True, False, True]
    assert [onednn_rows(n) for n in (1, 256, 257, 320, 321)] == [1, 256, 320, 320, 384]


def test_open_loop_paths_are_ttft_less_hand_over_to_step_end_and_the_pause():
    """Hand computation (session 25): a request handed over at enq, first scheduled in a step ending at t1, with a
    pause p after it: its path outside the engine is TTFT - (t1 - enq) - p; paired in sent order with the trace's
    `enq` times; a chunked prompt (more than its step's budget) is left out; unpaired counts give []."""
    from tokenmill.sim.calibrate import open_loop_paths_s

    steps = [{"t0": 100.000, "t1": 100.010, "budget": 512, "enq": [99.999]},
             {"t0": 100.011, "t1": 100.013, "budget": 512, "enq": []},
             {"t0": 100.014, "t1": 100.030, "budget": 512, "enq": [100.012, 100.0125]},
             {"t0": 100.031, "t1": 100.032, "budget": 512}]
    recs = [{"status": "ok", "sent_s": 5.0, "ttft_s": 0.0150, "prompt_tokens": 100, "cached_tokens": 0},
            {"status": "ok", "sent_s": 5.013, "ttft_s": 0.0230, "prompt_tokens": 200, "cached_tokens": 0},
            {"status": "failed", "sent_s": 5.0131, "ttft_s": None, "prompt_tokens": 9000},
            {"status": "ok", "sent_s": 5.0135, "ttft_s": 0.0300, "prompt_tokens": 900, "cached_tokens": 100}]
    got = open_loop_paths_s(steps, list(reversed(recs)))
    assert got == pytest.approx([0.015 - 0.011 - 0.001, 0.023 - 0.018 - 0.001], abs=1e-9)  # the 800-token one: chunked
    assert open_loop_paths_s(steps, recs[:1]) == []
    assert open_loop_paths_s([{k: v for k, v in s.items() if k != "enq"} for s in steps], recs) == []
