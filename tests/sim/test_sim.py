"""tokenmill sim: the real scheduler / router code on a virtual clock, cost models, catalogs, CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.runner import LoadConfig
from tokenmill.cli import CLIError, main
from tokenmill.router.config import RouterConfig
from tokenmill.sim.cost_model import FEATURES, PROFILE_KIND, Calibrated, Roofline, StepShape, nnls
from tokenmill.sim.hardware import CATALOG as HW
from tokenmill.sim.models import CATALOG as MODELS
from tokenmill.sim.simulation import SimConfig, run_simulation


def profile(tmp_path: Path, coef, serving=None, model="demo", name="p.json") -> str:
    data = {"kind": PROFILE_KIND, "model": model, "features": list(FEATURES), "coef": list(coef),
            "engine": {"kv_cache_bytes": 64 << 20, "max_num_batched_tokens": 2048, "kv_bytes_per_value": 2.0}}
    if serving:
        data["serving"] = serving
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def sim(tmp_path, hardware, workload, load, workers=1, policy="round-robin", admission="off", **kw):
    router = RouterConfig(policy=policy)
    router = replace(router, admission=replace(router.admission, mode=admission))
    cfg = SimConfig(model=kw.pop("model", "demo"), hardware=hardware, out=tmp_path / "out", workers=workers,
                    router=router, workloads=(workload,), load=load, plots=False, **kw)
    return run_simulation(cfg)


# -- against hand-computed references ---------------------------------------------------------------

def test_constant_step_closed_loop_matches_hand_computation(tmp_path):
    """One worker, one stream, a 10 ms step whatever it holds and 4 ms before the engine: the first token
    comes with the one prefill step (14 ms after sending), every next token one step later."""
    hw = profile(tmp_path, [0.010, 0, 0, 0, 0, 0], serving={"step_s": 0, "per_seq_s": 0, "request_s": 0.004})
    result, _ = sim(tmp_path, hw, "batch:prompt=100,output=20,spread=0", LoadConfig("concurrency", concurrency=1,
                    num_requests=5))
    recs = sorted(result.runs[0].records, key=lambda r: r.session)
    assert len(recs) == 5 and all(r.ok for r in recs)
    for r in recs:
        assert r.ttft_s == pytest.approx(0.014)
        assert r.tpot_s == pytest.approx(0.010)
        assert r.e2e_s == pytest.approx(0.014 + 19 * 0.010)
        assert r.output_tokens == 20
    assert recs[1].sent_s == pytest.approx(recs[0].end_s)  # closed loop: the next session starts at the reply


def test_two_streams_share_steps_and_prefill_is_chunked(tmp_path):
    """Per-token cost 1 ms per prefill token + 5 ms per step; budget 64 tokens: a 150-token prompt takes
    3 chunked steps (64 + 64 + 22 tokens) = 5+64, 5+64, 5+22 ms."""
    hw = profile(tmp_path, [0.005, 0.001, 0, 0, 0, 0])
    result, _ = sim(tmp_path, hw, "batch:prompt=150,output=4,spread=0", LoadConfig("concurrency", concurrency=1,
                    num_requests=1), max_num_batched_tokens=64, step_budget=False)
    (r,) = result.runs[0].records
    assert r.ttft_s == pytest.approx(0.069 + 0.069 + 0.027)
    assert r.tpot_s == pytest.approx(0.005)


def test_roofline_matches_datasheet_arithmetic():
    """Llama-3.1-8B on one H100: decode at batch 1 is bandwidth bound (16.06 GB of bf16 weights at
    3.35 TB/s x 0.8), an 8k prefill compute bound (2 x 7.5 G non-embedding-active FLOPs/token at 989 TF x 0.5)."""
    m, hw = MODELS["llama-3.1-8b"], HW["h100"]
    rf = Roofline(m, hw)
    fixed = 0.002 + 32 * 10e-6
    weights = 2 * (8.030e9 - 128256 * 4096)  # bf16, the input embedding is not read by a matmul
    decode = rf.step_s(StepShape(tokens=1, decode_seqs=1, attn_pairs=1, decode_ctx=1, logits=1))
    assert decode == pytest.approx(weights / (3.35e12 * 0.8) + fixed, rel=0.01)
    prefill = rf.step_s(StepShape(tokens=8192, prefill_tokens=8192, attn_pairs=8192 * 8193 / 2, logits=1))
    linear = 2 * (7.5047e9 - 128256 * 4096) * 8192 + 2 * 128256 * 4096
    attn = 4 * 32 * 32 * 128 * 8192 * 8193 / 2
    assert prefill == pytest.approx((linear + attn) / (989e12 * 0.5) + fixed, rel=0.01)
    # two GPUs (TP): at least the all-reduces on top of half the time
    rf2 = Roofline(m, hw, replace(rf.p, tp=2))
    assert rf2.step_s(StepShape(tokens=8192, prefill_tokens=8192, attn_pairs=8192 * 8193 / 2, logits=1)) < prefill


def test_decode_run_blocks_needed_equals_the_per_step_sum():
    """decode_run.blocks_needed (plan's shortcut: no step-by-step check when the whole run fits the free pool)
    against the sum of plan's per-step decrements, on random runs and block sizes (a block starting at step 0,
    at the run's last step, and steps past n)."""
    from tokenmill.sim.decode_run import blocks_needed

    rng = np.random.default_rng(11)
    for _ in range(3000):
        bs = int(rng.choice([1, 2, 3, 16, 512]))
        by_residue: dict[int, int] = {}
        for c in rng.integers(0, 5000, size=int(rng.integers(1, 12))):
            by_residue[int(c) % bs] = by_residue.get(int(c) % bs, 0) + 1
        n = int(rng.integers(0, 3 * bs + 40))
        assert blocks_needed(by_residue, bs, n) == sum(by_residue.get(-i % bs, 0) for i in range(1, n))


def test_decode_run_times_in_one_pass_equal_step_by_step():
    """CostModel.decode_run_s (numpy, the fast-forward's planner) against the scalar step_s of each step of the
    run (the base class's loop): equal bit for bit, roofline dense / MoE / TP and calibrated (one set of serving
    terms, and terms per step kind: a decode run takes the decode-only terms)."""
    from tokenmill.sim.cost_model import CostModel

    rng = np.random.default_rng(5)
    cal = Calibrated([0.002, 2e-5, 1e-4, 1e-8, 1e-7, 1e-4, 3e-4],
                     {"serving": {"step_s": 1e-4, "per_seq_s": 3e-6, "prefill_scale": 1.3, "per_request_s": 2e-3,
                                  "per_prefill_token_s": 1e-6}})
    kinds = Calibrated([0.002, 2e-5, 1e-4, 1e-8, 1e-7, 1e-4, 3e-4], {"serving": {"kinds": {
        "decode": {"step_s": 4e-4, "scale": 0.15, "per_seq_s": 2e-5, "per_request_s": 0.0},
        "mixed": {"step_s": 1e-3, "scale": 0.3, "per_seq_s": 0.0, "per_request_s": 1e-3},
        "prefill": {"step_s": 0.0, "scale": 0.4, "per_seq_s": 0.0, "per_request_s": 2e-3}}}})
    wide = Calibrated([0.002, 2e-5, 1e-4, 1e-8, 1e-7, 1e-4, 3e-4], {"serving": {"wide_rows": 150, "kinds": {
        "decode": {"step_s": 4e-4, "scale": 0.15, "per_seq_s": 2e-5, "wide_scale": 0.5, "new_shape_s": 8e-3},
        "mixed": {"scale": 0.3}, "prefill": {"scale": 0.4}}}})  # decode runs of > 150 sequences: wide terms
    models = [Roofline(MODELS["llama-3.1-8b"], HW["h100"]), Roofline(MODELS["deepseek-v3"], HW["h200"]),
              Roofline(MODELS["llama-3.1-405b"], HW["b300"], replace(Roofline(MODELS["llama-3.1-8b"], HW["h100"]).p,
                                                                     tp=4, dtype="fp8")), cal, kinds, wide]
    for cost in models:
        for _ in range(40):
            d = int(rng.integers(1, 300))
            ctx = rng.integers(1, 9000, size=d)
            shape = StepShape(tokens=d, decode_seqs=d, attn_pairs=float(sum(ctx + 1)), decode_ctx=int(sum(ctx)),
                              logits=d)
            n = int(rng.integers(0, 400))
            assert cost.decode_run_s(shape, n) == CostModel.decode_run_s(cost, shape, n)
            assert len(cost.decode_run_s(shape, n)) == max(0, n - 1)


@pytest.mark.parametrize("name,total_b,active_b", [
    ("llama-3.1-8b", 8.03, None), ("llama-3.1-70b", 70.6, None), ("llama-3.1-405b", 405.9, None),
    ("qwen3-32b", 32.8, None), ("deepseek-v3", 671, 37)])
def test_model_catalog_parameter_counts_match_published(name, total_b, active_b):
    m = MODELS[name]
    assert m.params_total() / 1e9 == pytest.approx(total_b, rel=0.01)
    if active_b:
        assert m.params_active() / 1e9 == pytest.approx(active_b, rel=0.03)
        # a one-token step reads the dense weights and ~9 experts per MoE layer, not all 256
        assert m.weight_params_read(1) < 0.1 * m.params_total()
        assert m.weight_params_read(10000) == pytest.approx(m.params_total() - m.vocab * m.hidden, rel=0.02)


def test_kv_bytes_per_token():
    assert MODELS["llama-3.1-8b"].kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2  # 128 KiB
    assert MODELS["deepseek-v3"].kv_bytes_per_token() == 61 * (512 + 64) * 2  # MLA latent + rope key
    assert MODELS["deepseek-v3"].kv_bytes_per_token(1) == 61 * 576


def test_model_from_config_json(tmp_path):
    from tokenmill.sim.models import get_model

    cfg = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 12,
           "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert m.kv_bytes_per_token() == 12 * 2 * 4 * 64 * 2 and m.max_position == 4096


def test_nnls_recovers_coefficients():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.uniform(0, 2048, 200), rng.integers(0, 64, 200)])
    true = np.array([0.002, 5e-5, 0.0])
    y = x @ true * rng.uniform(0.98, 1.02, 200)
    coef = nnls(x, y, weights=1 / y)
    assert (coef >= 0).all()
    assert coef[0] == pytest.approx(0.002, rel=0.05) and coef[1] == pytest.approx(5e-5, rel=0.05)


def test_step_shape_from_the_real_scheduler():
    from tokenmill.engine.kv.kv_manager import KVCacheManager
    from tokenmill.engine.request import Request
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.engine.scheduler import Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100), KVCacheManager(64, 16, True))
    s.add(Request("a", list(range(1, 61)), SamplingParams()))
    s.add(Request("b", list(range(100, 180)), SamplingParams()))
    shape = StepShape.of(s.schedule())
    assert (shape.tokens, shape.prefill_tokens, shape.decode_seqs, shape.logits) == (100, 100, 0, 1)
    assert shape.attn_pairs == 60 * 61 / 2 + 40 * 41 / 2


# -- the real code, not a copy ------------------------------------------------------------------------

def test_a_patched_routing_policy_changes_the_simulation(tmp_path, monkeypatch):
    """The sim routes with router.policies itself: a policy that always picks the last worker sends it all."""
    from tokenmill.router import policies

    hw = profile(tmp_path, [0.002, 1e-5, 0, 0, 0, 1e-4])
    load = LoadConfig("rate", rate=20, num_requests=40)
    _, before = sim(tmp_path, hw, "shared-prefix:groups=4,prompts=4,system=256,question=32,output=16", load,
                    workers=3, policy="least-load")
    assert before["levels"][0]["gpus"] == 3  # 3 one-GPU workers

    def last_worker(snap, p):
        w = snap.routable(snap.request.exclude)
        return policies.RouteChoice(w[-1].url, "patched") if w else policies.NO_WORKER

    monkeypatch.setitem(policies.POLICIES, "least-load", last_worker)
    seen = []
    orig = __import__("tokenmill.sim.worker", fromlist=["SimWorker"]).SimWorker.add

    def spy(self, request_id, *a, **k):
        seen.append(self.name)
        return orig(self, request_id, *a, **k)

    monkeypatch.setattr("tokenmill.sim.worker.SimWorker.add", spy)
    sim(tmp_path, hw, "shared-prefix:groups=4,prompts=4,system=256,question=32,output=16", load, workers=3,
        policy="least-load")
    assert len(seen) == 40 and set(seen) == {"http://sim-worker-2"}


def test_a_patched_admission_and_scheduler_change_the_simulation(tmp_path, monkeypatch):
    import tokenmill.router.router as router_mod
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.router.admission import Admission

    hw = profile(tmp_path, [0.002, 1e-5, 0, 0, 0, 1e-4])
    load = LoadConfig("rate", rate=10, num_requests=10)
    calls = []
    orig = Scheduler.schedule

    def counting(self, now=None, token_budget=None):
        calls.append(now)
        return orig(self, now, token_budget)

    monkeypatch.setattr(Scheduler, "schedule", counting)
    result, _ = sim(tmp_path, hw, "batch:prompt=64,output=8", load, workers=2, admission="leading")
    assert all(r.ok for r in result.runs[0].records) and calls  # the real Scheduler stepped, on virtual time
    assert calls == sorted(calls)
    monkeypatch.setattr(router_mod, "admit", lambda *a, **k: Admission("reject", reason="slo", retry_after_s=1.0))
    result, _ = sim(tmp_path, hw, "batch:prompt=64,output=8", load, workers=2, admission="leading")
    assert [r.status for r in result.runs[0].records] == ["rejected"] * 10
    assert {r.http_status for r in result.runs[0].records} == {429}


def test_prefix_aware_routing_hits_the_cache_more(tmp_path):
    hw = profile(tmp_path, [0.002, 2e-5, 0, 1e-8, 1e-7, 1e-4])
    load = LoadConfig("rate", rate=30, num_requests=200)
    wl = "shared-prefix:groups=8,prompts=8,system=512,question=32,output=8"
    kv = 6 << 20  # ~2,000 tokens per worker: about 3 of the 8 groups' prompts (the pool holds all of them)
    rr, _ = sim(tmp_path, hw, wl, load, workers=4, policy="round-robin", kv_cache_bytes=kv)
    pl, _ = sim(tmp_path, hw, wl, load, workers=4, policy="prefix-load", kv_cache_bytes=kv)
    hit = lambda res: res.runs[0].summary.prefix_cache_hit_rate  # noqa: E731
    assert hit(pl) > hit(rr) + 0.1


def test_deterministic(tmp_path):
    hw = profile(tmp_path, [0.002, 2e-5, 0, 1e-8, 1e-7, 1e-4])
    load = LoadConfig("rate", rate=8, num_requests=60)
    a, _ = sim(tmp_path, hw, "chat", load, workers=2, policy="prefix-load", admission="leading")
    b, _ = sim(tmp_path, hw, "chat", load, workers=2, policy="prefix-load", admission="leading")
    assert [r.to_json() for r in a.runs[0].records] == [r.to_json() for r in b.runs[0].records]


# -- command line -----------------------------------------------------------------------------------

def test_cli_writes_the_bench_result_schema(tmp_path, capsys):
    hw = profile(tmp_path, [0.002, 2e-5, 0, 1e-8, 1e-7, 1e-4])
    out = tmp_path / "r"
    rc = main(["sim", "--model", "demo", "--hardware", hw, "--workers", "2", "--workload", "chat", "--rate", "4",
               "--num-requests", "30", "--out", str(out), "--no-plots", "--price-per-hour", "2.5"])
    assert rc == 0
    data = json.loads((out / "result.json").read_text())
    for key in ("schema_version", "summary", "classes", "slos", "load", "workload", "target"):
        assert key in data
    assert data["summary"]["completed"] == 30 and data["summary"]["ttft_ms"]["p50"] > 0
    level = data["sim"]["levels"][0]
    hours = data["summary"]["duration_s"] / 3600
    assert level["cost"]["usd"] == pytest.approx(2.5 * 2 * hours)
    assert (out / "summary.md").is_file() and (out / "requests.jsonl").is_file()
    assert "events/s" in capsys.readouterr().out


def test_cli_sweep_and_catalog_gpu(tmp_path):
    out = tmp_path / "s"
    rc = main(["sim", "--model", "llama-3.1-8b", "--hardware", "h200", "--workers", "1", "--workload",
               "chat", "--sweep", "--rate", "8", "--sweep-trials", "3", "--duration", "20", "--out", str(out),
               "--no-plots"])
    assert rc == 0
    data = json.loads((out / "result.json").read_text())
    assert len(data["sweep"]["points"]) == 3 and data["sim"]["cost_model"]["kind"] == "roofline"


@pytest.mark.parametrize("argv,needle", [
    (["--model", "demo", "--hardware", "a100", "--rate", "1"], "not in the catalog"),
    (["--model", "nope-70b", "--hardware", "h100", "--rate", "1"], "not in the catalog"),
    (["--model", "demo", "--hardware", "h100", "--rate", "1", "--mfu", "2"], "--mfu"),
    (["--model", "llama-3.1-405b", "--hardware", "h100", "--rate", "1"], "does not fit"),
    (["--model", "demo", "--rate", "1"], "--hardware"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, needle):
    rc = main(["sim", *argv, "--out", str(tmp_path / "x"), "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_cli_profile_for_another_model_is_refused(tmp_path, capsys):
    hw = profile(tmp_path, [0.002, 0, 0, 0, 0, 0], model="other")
    assert main(["sim", "--model", "demo", "--hardware", hw, "--rate", "1", "--out", str(tmp_path / "x")]) == 2
    assert "calibrated on model" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_measures_the_real_engine(tmp_path):
    out = tmp_path / "cal.json"
    rc = main(["sim", "calibrate", "--model", "demo", "--out", str(out), "--contexts", "32,256", "--decodes",
               "1,8", "--prefills", "16,128", "--repeats", "2", "--no-serving", "--kv-cache-bytes", "32MiB",
               "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    p = json.loads(out.read_text())
    assert p["kind"] == PROFILE_KIND and p["fit"]["samples"] >= 20 and all(c >= 0 for c in p["coef"])
    assert p["engine"]["device"] == "cpu" and p["engine"]["dtype"] == "float32"
    # every sample's whole StepShape is kept (benchmarks/sim_roofline_check.py), in step with its features
    assert len(p["sample_shapes"]) == len(p["samples"]) == p["fit"]["samples"]
    for shape, row in zip(p["sample_shapes"], p["samples"]):
        assert StepShape(*shape).features().tolist()[1:] == row[:-1]
    cal = Calibrated.load(out)
    small = cal.step_s(StepShape(tokens=16, prefill_tokens=16, attn_pairs=136, logits=1))
    big = cal.step_s(StepShape(tokens=1024, prefill_tokens=1024, attn_pairs=1024 * 1025 / 2, logits=1))
    assert 0 < small < big  # more work costs more on the real engine


def test_sim_takes_every_workload_flag_of_bench():
    from tokenmill.cli import build_parser

    def options(cmd):
        parser = build_parser([cmd])
        sub = next(a for a in parser._actions if a.dest == "command").choices[cmd]
        return {o for a in sub._actions for o in a.option_strings}

    bench, sim_ = options("bench"), options("sim")
    shared = {"--workload", "--rate", "--concurrency", "--sweep", "--arrival", "--burstiness", "--duration",
              "--num-requests", "--slo", "--out", "--seed", "--sweep-target", "--sweep-trials", "--sweep-tol",
              "--no-plots"}
    assert shared <= bench and shared <= sim_


# -- fast-forward of steady decode: exactly the results of stepping ----------------------------------

FF_CASES = [  # workload, load, workers, policy, admission, extra SimConfig
    ("chat", LoadConfig("rate", rate=8, num_requests=80), 2, "prefix-load", "leading", {}),
    ("shared-prefix:groups=4,prompts=4,system=256,question=32,output=64", LoadConfig("rate", rate=20, num_requests=60),
     3, "prefix", "off", {"kv_cache_bytes": 3 << 20}),
    # a KV pool of ~340 tokens for 8 streams: runs end where the pool would run out, preemptions
    ("batch:prompt=64,output=300,spread=0.5", LoadConfig("concurrency", concurrency=8, num_requests=40), 1,
     "round-robin", "off", {"kv_cache_bytes": 1 << 20}),
    ("batch:prompt=64,output=200", LoadConfig("concurrency", concurrency=5, num_requests=30), 1, "round-robin", "off",
     {"block_size": 1}),
]


def test_fast_forward_gives_exactly_the_results_of_stepping(tmp_path):
    """Every request's send, first-token, every token's time, end, status and cached tokens, the steps, busy
    time and output tokens are identical with the steady decode runs fast-forwarded and stepped one by one,
    on four workloads that cover runs cut short by arrivals, runs ended by a full KV pool, preemption and
    one-token blocks; with fast-forward the event count drops."""
    hw = profile(tmp_path, [0.002, 2e-5, 1e-4, 1e-8, 1e-7, 1e-4])
    seen = {"cut": 0, "block_limited": 0}
    for wl, load, workers, policy, admission, kw in FF_CASES:
        (a, la), (b, lb) = [sim(tmp_path, hw, wl, load, workers=workers, policy=policy, admission=admission,
                                fast_forward=ff, **kw) for ff in (False, True)]
        recs_a, recs_b = a.runs[0].records, b.runs[0].records
        assert [r.to_json() for r in recs_a] == [r.to_json() for r in recs_b], wl
        assert all(r.chunk_s for r in recs_b if r.ok and r.output_tokens > 1)
        la, lb = la["levels"][0], lb["levels"][0]
        for key in ("steps", "output_tokens", "mean_worker_busy", "simulated_s"):
            assert la[key] == lb[key], (wl, key)
        assert la["fast_forward"]["runs"] == 0 and lb["fast_forward"]["runs"] > 0
        assert lb["events"] < la["events"]
        for k in seen:
            seen[k] += lb["fast_forward"][k]
    assert seen["cut"] > 0 and seen["block_limited"] > 0  # both ways a run ends early were exercised


def test_skipping_the_step_budget_when_it_cannot_bind_changes_nothing(tmp_path, monkeypatch):
    """The worker sizes the step budget only when it can change the batch (worker.budget_can_bind): with the
    budget sized before every step instead, every record and level statistic is identical, on the
    fast-forward cases (preemption, one-token blocks) and one where the TPOT budget binds, and the shortcut was
    taken (skipping also while a prefill runs with nothing waiting made it fail)."""
    from tokenmill.sim import worker as sim_worker

    hw = profile(tmp_path, [0.002, 2e-5, 1e-4, 1e-8, 1e-7, 1e-4])
    real, skipped = sim_worker.budget_can_bind, [0]

    def counting(s):
        ok = real(s)
        skipped[0] += not ok
        return ok

    # prefill 0.3 ms a token and interactive TPOT SLOs: the budget binds (~260 prefill tokens a step)
    slow = profile(tmp_path, [0.002, 3e-4, 1e-4, 1e-8, 1e-7, 1e-4], name="slow.json")
    cases = [(hw,) + c for c in FF_CASES] + [
        (slow, "shared-prefix:groups=8,prompts=5,system=1000,question=400,output=200",
         LoadConfig("rate", rate=8, num_requests=40), 1, "round-robin", "off", {})]
    for ff in (True, False):
        for hw, wl, load, workers, policy, admission, kw in cases:
            runs = []
            for patch in (counting, lambda s: True):
                monkeypatch.setattr(sim_worker, "budget_can_bind", patch)
                runs.append(sim(tmp_path, hw, wl, load, workers=workers, policy=policy, admission=admission,
                                fast_forward=ff, **kw))
            (a, la), (b, lb) = runs
            assert [r.to_json() for r in a.runs[0].records] == [r.to_json() for r in b.runs[0].records], wl
            timing = ("wall_s", "cpu_s", "events_per_s", "speedup_vs_real_time")
            assert {k: v for k, v in la["levels"][0].items() if k not in timing} == \
                {k: v for k, v in lb["levels"][0].items() if k not in timing}
    assert skipped[0] > 0


def test_step_budget_observe_many_is_bitwise_the_per_step_update():
    """observe_many (one solve) against the numpy recursion written out here: a <- d a + x x^T, b <- d b + x s."""
    from tokenmill.engine.step_budget import StepBudget

    rng = np.random.default_rng(3)
    batch, ref = StepBudget(), StepBudget()
    a, b = np.array(ref._a), np.array(ref._b)
    for _ in range(50):
        d, p = int(rng.integers(0, 40)), int(rng.choice([0, rng.integers(1, 2000)]))
        secs = list(rng.uniform(0.001, 0.05, int(rng.integers(1, 30))))
        batch.observe_many(d, p, secs)
        x = np.array([1.0, d, p])
        for s in secs:
            a, b = 0.98 * a + np.outer(x, x), 0.98 * b + x * s
    assert (np.array(batch._a) == a).all() and (np.array(batch._b) == b).all()
    assert (batch.coef == np.maximum(np.linalg.solve(a, b), [0, 0, 1e-7])).all()


# -- simulated KV block size: the trace's granularity ------------------------------------------------

def _mooncake(tmp_path: Path, rows: int = 24) -> Path:
    """A Mooncake-format trace: every other prompt opens with one of two shared 2-block prefixes."""
    path = tmp_path / "mc.jsonl"
    lines, nxt = [], 1000
    for i in range(rows):
        n = 2 + i % 3
        ids = ([i % 4, 100 + i % 4] if i % 2 == 0 else []) + list(range(nxt, nxt + n))
        nxt += n
        lines.append(json.dumps({"timestamp": 50 * i, "input_length": 512 * len(ids) - 100,
                                 "output_length": 8, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_block_size_defaults_to_the_mooncake_trace_block_and_says_so(tmp_path):
    """No --block-size: a Mooncake trace runs on 512-token KV blocks (and the router's prefix chunks follow),
    any other workload on the engine's 16; the sim section says which and why. An explicit size wins."""
    trace = _mooncake(tmp_path)
    load = LoadConfig("trace")
    res, s = sim(tmp_path, "h100", f"trace:{trace}", load, workers=2, policy="prefix", model="llama-3.1-8b")
    assert s["worker"]["block_size"] == 512 and "Mooncake" in s["block_size_source"]
    assert s["router"]["chunk_tokens"] == 512
    recs = res.runs[0].records
    assert all(r.ok for r in recs)
    # the shared 2-block prefixes are found: the cached tokens are whole 512-token blocks, some of them hits
    assert all((r.cached_tokens or 0) % 512 == 0 for r in recs) and sum(r.cached_tokens or 0 for r in recs) > 0
    _, s16 = sim(tmp_path, "h100", f"trace:{trace}", load, workers=2, policy="prefix", model="llama-3.1-8b",
                 block_size=16)
    assert s16["worker"]["block_size"] == 16 and s16["block_size_source"] == "--block-size"
    assert s16["router"]["chunk_tokens"] == 16
    _, sc = sim(tmp_path, "h100", "chat", LoadConfig("rate", rate=4, num_requests=5), model="llama-3.1-8b")
    assert sc["worker"]["block_size"] == 16 and sc["block_size_source"].startswith("auto")
    with pytest.raises(CLIError, match="--block-size"):
        SimConfig(model="demo", hardware="h100", out=tmp_path, block_size=0)


def test_worker_reuses_the_dispatch_lookup_hashes(tmp_path):
    """The block hashes the dispatch's prefix lookup computed are the request's: equal to hashing its tokens
    from scratch, and the KV manager extends them rather than starting over."""
    from tokenmill.engine.kv.hashing import block_hashes
    from tokenmill.sim.clock import EventLoop
    from tokenmill.sim.cost_model import Calibrated
    from tokenmill.sim.worker import SimWorker, WorkerConfig

    cost = Calibrated.load(profile(tmp_path, [0.002, 1e-5, 0, 0, 0, 0]))
    w = SimWorker("w", WorkerConfig(num_blocks=64, block_size=4, max_model_len=256), cost, EventLoop(),
                  lambda *a: None, lambda *a: None)
    ids = list(range(7, 50))
    assert w.add("a", ids, 2) is None
    w.loop.run()  # "a" ran: its blocks are cached
    prompt = ids + [9000, 9001, 9002]
    hashes: list[int] = []
    assert w.cached_prefix_tokens(prompt, hashes) == 40
    assert len(hashes) >= 10 and hashes == block_hashes(prompt[:4 * len(hashes)], 4)
    assert w.add("b", prompt, 2, block_hashes=hashes) is None
    req = w.scheduler.requests["b"]
    assert req.block_hashes is hashes  # taken over, not recomputed
    w.loop.run()
    assert req.num_cached_tokens == 40
    assert req.block_hashes[:11] == block_hashes(prompt[:44], 4)


def test_router_chunk_hashes_of_a_numpy_prompt_equal_the_list_ones():
    from tokenmill.router.prefix_index import chunk_hashes

    ids = np.random.default_rng(0).integers(0, 150_000, 1000)
    for chunk in (1, 16, 512):
        assert chunk_hashes(ids, chunk) == chunk_hashes(ids.tolist(), chunk) == chunk_hashes(tuple(ids.tolist()), chunk)


def test_discarding_the_router_metrics_changes_nothing(tmp_path, monkeypatch):
    """The simulated router records no Prometheus metrics (cluster.DiscardedMetrics): with the real
    RouterMetrics recording every record and level statistic is identical, on an overloaded run with leading
    admission (holds, rejections, the queue-wait and rejection metrics) and the fast-forward cases; the real
    metrics did record the routed requests."""
    from tokenmill.sim import cluster

    hw = profile(tmp_path, [0.002, 2e-5, 1e-4, 1e-8, 1e-7, 1e-4])
    routers = []
    real_init = cluster.SimRouter.__init__

    def recording(self, cfg, loop, metrics=False):
        real_init(self, cfg, loop, True)
        routers.append(self)

    cases = FF_CASES + [("chat", LoadConfig("rate", rate=200, num_requests=200), 2, "prefix-load", "leading",
                         {"slos": ("ttft=50",)})]
    rejected = 0
    for wl, load, workers, policy, admission, kw in cases:
        runs = []
        for patch in (None, recording):
            if patch is not None:
                monkeypatch.setattr(cluster.SimRouter, "__init__", patch)
            runs.append(sim(tmp_path, hw, wl, load, workers=workers, policy=policy, admission=admission, **kw))
            monkeypatch.undo()
        (a, la), (b, lb) = runs
        assert [r.to_json() for r in a.runs[0].records] == [r.to_json() for r in b.runs[0].records], wl
        timing = ("wall_s", "cpu_s", "events_per_s", "speedup_vs_real_time")
        assert {k: v for k, v in la["levels"][0].items() if k not in timing} == \
            {k: v for k, v in lb["levels"][0].items() if k not in timing}
        rejected += sum(r.status == "rejected" for r in a.runs[0].records)
        text = routers[-1].metrics.render().decode()
        assert "tokenmill_router_routed_requests_total{" in text
    assert rejected > 0  # the overloaded case refused some (admission's metric paths ran)


def test_fit_roofline_recovers_the_roofline_that_made_the_steps():
    """`tokenmill sim calibrate` on a GPU fits MFU, MBU and the step overhead of the roofline to the measured
    steps (calibrate.fit_roofline): steps a known roofline produced give that roofline back."""
    from tokenmill.sim.calibrate import fit_roofline
    from tokenmill.sim.cost_model import Roofline, RooflineParams
    from tokenmill.sim.hardware import get_hardware
    from tokenmill.sim.models import get_model

    model, hw = get_model("llama-3.1-8b"), get_hardware("h200")
    truth = Roofline(model, hw, RooflineParams(mfu=0.3, mbu=0.5, step_overhead_s=0.003))
    shapes = [StepShape(tokens=d, decode_seqs=d, attn_pairs=d * c, decode_ctx=d * c, logits=d)
              for d in (1, 8, 32, 128) for c in (256, 1024, 4096)]
    shapes += [StepShape(tokens=p, prefill_tokens=p, attn_pairs=p * (p + 1) / 2, logits=1) for p in (512, 2048, 8192)]
    fit = fit_roofline(shapes, [truth.step_s(s) for s in shapes], model, hw)
    assert (fit["mfu"], fit["mbu"], fit["step_overhead_ms"]) == (0.3, 0.5, 3.0)
    assert fit["median_abs_rel_error"] < 1e-9
    # and a slower engine is fitted as one: the catalog's defaults would be ~2x off on these decode steps
    slow = Roofline(model, hw, RooflineParams(mfu=0.5, mbu=0.2, step_overhead_s=0.006))
    fit = fit_roofline(shapes, [slow.step_s(s) for s in shapes], model, hw)
    assert (fit["mfu"], fit["mbu"], fit["step_overhead_ms"]) == (0.5, 0.2, 6.0)


def test_calibrate_reports_the_roofline_fit_on_a_catalog_gpu(monkeypatch):
    """The GPU-only branch of calibrate (the device's name matched in the hardware catalog), run with the
    measured samples of a CPU: the profile gets `roofline_fit` and the log the `tokenmill sim` flags."""
    from tokenmill.sim import calibrate as cal

    monkeypatch.setattr(cal, "gpu_catalog_name", lambda device: "h200" if device.startswith("cuda") else None)
    samples = [(StepShape(tokens=d, decode_seqs=d, attn_pairs=d * 300, decode_ctx=d * 300, logits=d), 0.004 + 1e-4 * d)
               for d in (1, 4, 16, 64)]
    lines = []
    out = cal._roofline_fit("demo", "cuda:0", "torch.bfloat16", samples, 0.3, lines.append)
    fit = out["roofline_fit"]
    assert fit["hardware"] == "h200" and fit["linear_median_abs_rel_error"] == 0.3 and fit["steps"] == 4
    assert "--hardware h200 --mfu" in lines[0]
    assert cal._roofline_fit("demo", "cpu", "torch.bfloat16", samples, 0.3, lines.append) == {}
    assert cal._roofline_fit("demo", "cuda:0", "torch.float32", samples, 0.3, lines.append) == {}
