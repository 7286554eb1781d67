"""Speculative decoding in `tokenmill sim` (sim/spec.py): the engine's SpecDecoder on the virtual clock."""

from __future__ import annotations

import pytest

from tokenmill.bench.runner import LoadConfig
from tokenmill.cli import CLIError
from tokenmill.sim.clock import EventLoop
from tokenmill.sim.cost_model import Roofline, StepShape
from tokenmill.sim.hardware import get_hardware
from tokenmill.sim.models import get_model
from tokenmill.sim.simulation import SimConfig
from tokenmill.sim.spec import DRAFTABLE, OTHER, Acceptance, Content, SpecSimConfig
from tokenmill.sim.worker import SimWorker, WorkerConfig

from .test_sim import profile, sim

TARGET, DRAFT = get_model("llama-3.1-8b"), get_model("llama-3.2-1b")


def test_acceptance_parse_and_errors():
    assert Acceptance.parse("0.7") == Acceptance(0.7, None)
    assert Acceptance.parse("0.6:span=20") == Acceptance(0.6, 20.0)
    for bad in ("x", "0.7:spam=3", "1.5", "0.9:span=2", "0.5:span=0.5", "1:span=4"):
        with pytest.raises(CLIError):
            Acceptance.parse(bad)


@pytest.mark.parametrize("acc, mean_run", [(Acceptance(0.7), 1 / 0.3), (Acceptance(0.6, 20.0), 20.0)])
def test_content_share_and_run_length(acc, mean_run):
    """The stationary share of draftable positions is alpha and their runs have the mean length asked
    (i.i.d.: 1 / (1 - alpha))."""
    c = Content(acc, seed=3)
    toks = [c.token("r", i) for i in range(200_000)]
    assert set(toks) == {DRAFTABLE, OTHER}
    assert abs(toks.count(DRAFTABLE) / len(toks) - acc.alpha) < 0.02
    runs, n = [], 0
    for t in toks:
        if t == DRAFTABLE:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert abs(sum(runs) / len(runs) / mean_run - 1) < 0.1
    # the same request's content on another worker (another Content) and its prefix are the same
    assert [Content(acc, seed=3).token("r", i) for i in range(500)] == toks[:500]
    assert [Content(acc, seed=4).token("r", i) for i in range(500)] != toks[:500]


def _worker(spec: SpecSimConfig | None, requests=8, max_tokens=60, num_blocks=4000):
    """One simulated worker (H100, Llama-3.1-8B; a Llama-3.2-1B draft), `requests` prompts at t = 0; returns
    (the worker, each request's output tokens at its end)."""
    hw = get_hardware("h100")
    loop, outs = EventLoop(), {}

    def on_token(w, req, first, finished, count=1):
        if finished:
            outs[req.request_id] = list(req.output_token_ids)

    w = SimWorker("w", WorkerConfig(num_blocks=num_blocks, max_model_len=4096, spec=spec), Roofline(TARGET, hw), loop,
                  on_token, lambda *a: None, draft_cost=Roofline(DRAFT, hw))
    for i in range(requests):
        assert w.add(f"r{i}", list(range(1000 * i, 1000 * i + 100 + 7 * i)), max_tokens) is None
    loop.run()
    return w, outs


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_lossless_any_k_gives_each_request_its_content(proposer):
    """Whatever k (fixed 1, 4, auto), every request's output is its content, token for token (greedy verify
    keeps only drafts equal to it): speculation changes the number of steps, never the output."""
    acc = Acceptance(0.8, 10.0) if proposer == "ngram" else Acceptance(0.7)
    steps = {}
    for k in (1, 4, "auto"):
        w, outs = _worker(SpecSimConfig(proposer, k, acc))
        assert len(outs) == 8
        ref = Content(acc)
        for rid, toks in outs.items():
            assert toks == [ref.token(rid, i) for i in range(60)], (k, rid)
        steps[k] = w.steps
        assert w.spec_stats()["accepted_tokens"] > 0
    assert steps[4] < steps[1]


def test_fixed_k_acceptance_matches_hand_computation():
    """i.i.d. alpha = 0.7, k = 4: a verify keeps j drafts with P(>= j) = 0.7^j, so the share kept is
    (0.7 + 0.49 + 0.343 + 0.2401) / 4 = 0.443 (verifies near an output's end draft fewer: a little above)."""
    w, _ = _worker(SpecSimConfig("draft", 4, Acceptance(0.7)), requests=16, max_tokens=400)
    st = w.spec_stats()
    assert abs(st["accepted_tokens"] / st["draft_tokens"] - 0.4433) < 0.03
    assert st["chosen_k"].get(4, 0) > 0.9 * sum(st["chosen_k"].values())


def test_the_engines_decoder_runs(monkeypatch):
    """A patched guard (never speculate) and a patched verify (keep nothing) change the simulation: the sim
    runs the engine's spec/guard.py and spec/decoder.py, not copies."""
    from tokenmill.engine.spec import decoder, guard

    base, _ = _worker(SpecSimConfig("draft", "auto", Acceptance(0.9)))
    assert base.spec_stats()["drafts"] > 0
    monkeypatch.setattr(guard.GoodputGuard, "cap", lambda self, n, suggest=None: 0)
    off, outs = _worker(SpecSimConfig("draft", "auto", Acceptance(0.9)))
    assert off.spec_stats()["drafts"] == 0 and len(outs) == 8 and off.steps > base.steps
    monkeypatch.undo()
    monkeypatch.setattr(decoder, "verify_greedy", lambda rows, drafts: ([rows[0]], 0))
    fixed, _ = _worker(SpecSimConfig("draft", 4, Acceptance(0.9)))
    st = fixed.spec_stats()
    assert st["drafts"] > 0 and st["accepted_tokens"] == 0


def test_verify_rows_and_draft_passes_are_priced():
    """A speculating step costs its verify rows (tokens and logits of the target's step) and the draft's
    passes: a batch of 256 at k = 4 is compute-bound on the roofline and costs about twice the plain step (which reads 256k tokens of KV)."""
    hw = get_hardware("h100")
    cost = Roofline(TARGET, hw)
    plain = StepShape(tokens=256, decode_seqs=256, attn_pairs=256 * 1001, decode_ctx=256 * 1001, logits=256)
    spec = StepShape(tokens=256 * 5, decode_seqs=256, attn_pairs=256 * 5 * 1003, decode_ctx=256 * 1001,
                     logits=256 * 5, verify_tokens=256 * 4)
    assert cost.step_s(spec) > 1.8 * cost.step_s(plain)  # 1,280 rows of FLOPs vs 256 (KV reads the same)
    one = StepShape(tokens=1, decode_seqs=1, attn_pairs=1001, decode_ctx=1001, logits=1)
    one4 = StepShape(tokens=5, decode_seqs=1, attn_pairs=5 * 1003, decode_ctx=1001, logits=5, verify_tokens=4)
    assert cost.step_s(one4) < 1.05 * cost.step_s(one)  # memory-bound at batch 1: verify rows are ~free
    # the worker adds the proposer's seconds: a draft's passes cost more than n-gram lookups
    d, _ = _worker(SpecSimConfig("draft", 4, Acceptance(0.0)), requests=1)
    g, _ = _worker(SpecSimConfig("ngram", 4, Acceptance(0.0)), requests=1)
    assert d.steps == g.steps and d.busy_s > g.busy_s * 1.2


def _run(tmp_path, concurrency, spec=None, duration=30):
    kw = {}
    if spec is not None:
        kw = dict(speculative_model="llama-3.2-1b", num_speculative_tokens=spec, spec_acceptance="0.7")
    result, js = sim(tmp_path, "h100", "chat", LoadConfig("concurrency", concurrency=concurrency, duration_s=duration),
                     model="llama-3.1-8b", **kw)
    return result.runs[0].summary, js


@pytest.mark.slow
def test_idle_vs_saturated(tmp_path):
    """The scenario (tokenmill/sim/scenarios/spec_idle_vs_saturated.json): at one stream speculation cuts TPOT
    (memory-bound decode, verify rows ~free); at 256 streams a fixed k = 4 loses goodput (compute-bound) while
    auto's guard turns it off and keeps the goodput of speculation off."""
    off1, _ = _run(tmp_path, 1)
    auto1, js = _run(tmp_path, 1, "auto")
    assert auto1.tpot_ms.p50 < 0.75 * off1.tpot_ms.p50
    assert js["levels"][0]["spec"]["drafts"] > 0
    off, _ = _run(tmp_path, 256)
    k4, _ = _run(tmp_path, 256, 4)
    auto, js = _run(tmp_path, 256, "auto")
    assert k4.output_throughput < 0.85 * off.output_throughput
    assert auto.output_throughput > 0.95 * off.output_throughput
    assert js["levels"][0]["spec"]["guard_caps"]["128"] == {"0": 1}


def test_config_errors(tmp_path):
    mk = lambda **kw: SimConfig(model="llama-3.1-8b", hardware="h100", out=tmp_path, **kw)  # noqa: E731
    with pytest.raises(CLIError, match="both"):
        mk(speculative_model="ngram")
    with pytest.raises(CLIError, match="--spec-acceptance"):
        mk(speculative_model="ngram", num_speculative_tokens="auto")
    with pytest.raises(CLIError, match="need --speculative-model"):
        mk(spec_acceptance="0.5")
    load = LoadConfig("rate", rate=1.0, num_requests=2)
    with pytest.raises(CLIError, match="num-speculative-tokens"):
        sim(tmp_path, "h100", "chat", load, model="llama-3.1-8b", speculative_model="ngram",
            num_speculative_tokens="many", spec_acceptance="0.5")
    with pytest.raises(CLIError, match="not in the catalog"):
        sim(tmp_path, "h100", "chat", load, model="llama-3.1-8b", speculative_model="no-such-draft",
            num_speculative_tokens=4, spec_acceptance="0.5")
    hw = profile(tmp_path, [0.01, 0, 0, 0, 0, 0])
    with pytest.raises(CLIError, match="its own calibration profile"):
        sim(tmp_path, hw, "chat", load, speculative_model="llama-3.2-1b", num_speculative_tokens=4,
            spec_acceptance="0.5")
    with pytest.raises(CLIError, match="catalog GPU"):
        sim(tmp_path, "h100", "chat", load, model="llama-3.1-8b", speculative_model=hw, num_speculative_tokens=4,
            spec_acceptance="0.5")


def test_calibrated_profile_with_a_draft_profile(tmp_path):
    """On this machine's profile the draft is its own profile (demo-draft calibrated): its in-process engine fit
    prices the passes; the draft's KV shares the blocks (fewer blocks than without it)."""
    hw = profile(tmp_path, [0.002, 5e-5, 0, 0, 0, 5e-5])
    draft = profile(tmp_path, [0.0005, 1e-5, 0, 0, 0, 1e-5], model="demo-draft", name="d.json")
    load = LoadConfig("concurrency", concurrency=2, num_requests=8)
    plain, pj = sim(tmp_path, hw, "batch:prompt=64,output=32,spread=0", load)
    spec, sj = sim(tmp_path, hw, "batch:prompt=64,output=32,spread=0", load, speculative_model=draft,
                   num_speculative_tokens=3, spec_acceptance="0.8")
    assert sj["worker"]["num_blocks"] < pj["worker"]["num_blocks"]
    assert sj["spec"]["draft_cost_model"]["model"] == "demo-draft"
    assert sj["levels"][0]["spec"]["draft_passes"] > 0
    assert spec.runs[0].summary.tpot_ms.p50 < plain.runs[0].summary.tpot_ms.p50


def test_closed_loop_refusals_do_not_spin(tmp_path):
    """Concurrency mode with admission refusing: a refused slot takes its next session a round trip later
    (cluster.REFUSED_RTT_S), so the run ends (it recursed without limit at the same instant before)."""
    result, _ = sim(tmp_path, "h100", "chat", LoadConfig("concurrency", concurrency=64, duration_s=0.5),
                    model="llama-3.1-8b", admission="leading")
    s = result.runs[0].summary
    assert s.completed > 0 and s.rejected > 0


def test_shipped_scenarios_parse_and_run_quick(tmp_path, capsys):
    """Every shipped scenario's runs parse as `tokenmill sim` flags; one runs end to end (--quick, two of its
    runs) and writes its table and each run's result.json."""
    import argparse
    import json

    from tokenmill.sim.cli import add_parser, build_config
    from tokenmill.sim.scenario import load, run_scenario, shipped

    names = shipped()
    assert {"spec_idle_vs_saturated", "llmd_prefix_routing", "h200_vs_b300_cost", "kv_tiers_hit_rate"} <= set(names)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    for name, path in names.items():
        data = load(str(path))
        for r in data["runs"]:
            build_config(parser.parse_args(["sim", *data["common"], *r["args"], "--out", str(tmp_path / "x")]))
    rows = run_scenario("spec_idle_vs_saturated", tmp_path / "s", quick=True, only=["c=1 off", "c=1 draft k=4"],
                        log=lambda m: None)
    assert [r["run"] for r in rows] == ["c=1 off", "c=1 draft k=4"]
    assert rows[1]["spec_acceptance"] > 0 and rows[1]["tpot_p50_ms"] < rows[0]["tpot_p50_ms"]
    md = (tmp_path / "s" / "scenario.md").read_text()
    assert "| c=1 draft k=4 |" in md and "draft acc." in md
    res = json.loads((tmp_path / "s" / "01-c-1-draft-k-4" / "result.json").read_text())
    assert res["sim"]["spec"]["proposer"] == "draft" and "--quick" not in res["command"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"name": "x"}]}))
    with pytest.raises(CLIError, match="runs must be"):
        load(str(bad))
    with pytest.raises(CLIError, match="not a shipped scenario"):
        load("no-such-scenario")
    with pytest.raises(CLIError, match="no run named"):
        run_scenario("spec_idle_vs_saturated", tmp_path / "t", only=["nope"])


def test_speculation_with_kv_tiers(tmp_path):
    """Both at once, as the engine allows: the spec step calls the tier hooks too (loads, write-through, forget);
    every request completes and both sections are reported."""
    result, js = sim(tmp_path, "h100", "chat:turns_min=3,turns_max=4,prompt=300,output=60,think_s=1",
                     LoadConfig("rate", rate=4.0, num_requests=40), model="llama-3.1-8b", kv_cache_bytes=512 << 20,
                     kv_host_bytes=8 << 30, speculative_model="llama-3.2-1b", num_speculative_tokens=3,
                     spec_acceptance="0.7")
    s = result.runs[0].summary
    assert s.completed == s.requests > 0
    level = js["levels"][0]
    assert level["spec"]["drafts"] > 0 and level["kv_tiers"]


def test_a_calibrated_draft_loop_prices_proposals_by_its_fit(tmp_path):
    """A draft profile with `draft_loop` (tokenmill sim calibrate --draft-for): a short catch-up proposal costs
    coef . (1, passes, rows after the first pass, catch-up tokens) -- hand computation -- instead of whole engine
    steps of the draft; a long catch-up (a new request's first proposal) stays a draft prefill step."""
    import json

    from tokenmill.engine.request import Request
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.engine.spec import decoder
    from tokenmill.sim import spec as simspec
    from tokenmill.sim.cost_model import Calibrated

    assert simspec.SHORT_CATCHUP == decoder.SHORT_CATCHUP
    path = profile(tmp_path, [0.001, 1e-5, 0, 0, 0, 1e-5], model="demo-draft", name="d.json")
    data = json.loads(open(path).read())
    data["draft_loop"] = {"target": "demo", "features": ["one", "passes", "rows", "catchup_tokens"],
                          "coef": [1e-4, 5e-5, 2e-5, 1e-5]}
    open(path, "w").write(json.dumps(data))
    p = simspec.SimProposer(SpecSimConfig("draft", 4, Acceptance(0.5)), Calibrated.load(path))
    reqs = [Request(f"r{i}", list(range(30)), SamplingParams(max_tokens=50)) for i in range(3)]
    p.propose(reqs, [4, 4, 4], [None] * 3, [None] * 3)  # first proposals: 30-token catch-ups (> 16): a prefill
    first = p.take_s()
    assert first == pytest.approx(0.001 + 1e-5 * 90 + 1e-5 * 3 + 5e-5 * 3 + 2e-5 * 9)
    for r in reqs:  # the target kept one draft + its token; KV is valid up to the newest token (rollback)
        r.append_output(1)
        r.append_output(2)
        p.rollback(r, r.num_tokens - 1)
    p.propose(reqs, [4, 2, 1], [None] * 3, [None] * 3)
    # passes 4; rows after the first pass: 2 (j=1: k 4 and 2) + 1 (j=2) + 1 (j=3) = 4; catch-up: the draft's KV
    # covered 33 positions, cut to the target's 31 by the rollback: the newest token alone, 1 each = 3
    assert p.take_s() == pytest.approx(1e-4 + 5e-5 * 4 + 2e-5 * 4 + 1e-5 * 3)
    data["draft_loop"]["features"] = ["one", "passes"]
    open(path, "w").write(json.dumps(data))
    with pytest.raises(CLIError, match="calibrate the draft again"):
        simspec.SimProposer(SpecSimConfig("draft", 4, Acceptance(0.5)), Calibrated.load(path))
