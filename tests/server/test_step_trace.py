"""TOKENMILL_STEP_TRACE: the engine core writes one JSON line per step with the step's shape as the
simulator's cost model reads it (sim/cost_model.StepShape of the SchedulerOutput the step ran) and its times."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenmill.engine.llm_engine")

from tokenmill.engine.config import EngineConfig  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.engine.sampling_params import SamplingParams  # noqa: E402
from tokenmill.server.engine_core import AddCmd, EngineCore  # noqa: E402
from tokenmill.sim.cost_model import StepShape  # noqa: E402


def test_step_trace_has_one_line_per_step_with_the_scheduled_shape(tiny_dir, tmp_path, monkeypatch):
    path = tmp_path / "steps-{pid}.jsonl"
    monkeypatch.setenv("TOKENMILL_STEP_TRACE", str(path))
    eng = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_bytes=4 << 20, max_model_len=256,
                                 max_num_batched_tokens=48))
    shapes = []
    inner = eng.scheduler.schedule

    def schedule(*a, **k):  # the reference: the shapes of what the real scheduler returned
        out = inner(*a, **k)
        if not out.empty:
            shapes.append(StepShape.of(out))
        return out

    eng.scheduler.schedule = schedule
    core = EngineCore(eng)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    res = core.run_once([AddCmd("b", list(range(3, 13)), params), AddCmd("a", list(range(1, 71)), params)])
    steps = 1
    while res.busy:
        res = core.run_once([])
        steps += 1
    core._trace.close()
    import os

    lines = [json.loads(x) for x in (tmp_path / f"steps-{os.getpid()}.jsonl").read_text().splitlines()]
    assert len(lines) == steps == len(shapes)
    assert any(s.prefill_tokens and s.decode_seqs for s in shapes)  # chunked prefill beside a decode: a mixed step
    assert [s.new_requests for s in shapes][:2] == [2, 0]  # both start in the first step
    for line, s in zip(lines, shapes):
        assert StepShape(line["tokens"], line["prefill_tokens"], line["decode_seqs"], line["attn_pairs"],
                         line["decode_ctx"], line["prefill_ctx"], line["logits"], line["new_requests"]) == s
        assert line["t1"] > line["t0"] and line["cpu_s"] >= 0
    assert all(b["t0"] >= a["t1"] for a, b in zip(lines, lines[1:]))


def test_no_trace_without_the_variable(tiny_dir, monkeypatch):
    monkeypatch.delenv("TOKENMILL_STEP_TRACE", raising=False)
    eng = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_bytes=4 << 20, max_model_len=256))
    assert EngineCore(eng)._trace is None


def test_step_trace_lists_each_request_hand_over_time_in_its_first_step(tiny_dir, tmp_path, monkeypatch):
    """`enq`: AddCmd.sent_t of the requests a step scheduled for the first time (the calibration's per-request
    path under load, sim/calibrate.open_loop_paths_s); a request waiting for room appears in a later step."""
    import os

    path = tmp_path / "steps-{pid}.jsonl"
    monkeypatch.setenv("TOKENMILL_STEP_TRACE", str(path))
    eng = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_bytes=4 << 20, max_model_len=256,
                                 max_num_batched_tokens=48))
    core = EngineCore(eng)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    res = core.run_once([AddCmd("a", list(range(1, 49)), params, sent_t=10.0),
                         AddCmd("b", list(range(3, 33)), params, sent_t=11.0), AddCmd("c", [5, 6], params)])
    while res.busy:
        res = core.run_once([])
    core._trace.close()
    lines = [json.loads(x) for x in (tmp_path / f"steps-{os.getpid()}.jsonl").read_text().splitlines()]
    assert lines[0]["enq"] == [10.0]  # a (48 tokens) fills the 48-token budget; b waits
    later = [x["enq"] for x in lines[1:] if x["enq"]]
    assert later == [[11.0]]  # c had no sent_t: not listed
    assert sum(x["new_requests"] for x in lines) == 3 and not core._enq
