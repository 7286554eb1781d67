"""OutputProcessor (engine/output_processor.py): detokenization and stop strings outside the engine core.

The reference is independent of the class: the tokenizer's plain decode of the whole token list, and the
least number of tokens whose decode contains the stop string."""

from __future__ import annotations

import pytest

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput, TokenLogprob
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.model.tokenizer import Tokenizer

TEXT = "def add(a, b):\n    return a + b  # STOP here, then more text after the stop\n"


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def reference(tok, ids: list[int], stop: str) -> tuple[str, int]:
    """(text before the stop string, tokens up to and including the one that completed it), by brute force."""
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    full = tok.decode(ids[:k])
    return full[:full.index(stop)], k


def split_stop(tok, ids: list[int]) -> str:
    """A stop string whose characters come from at least two tokens (so at least two steps of one token)."""
    for k in range(3, len(ids)):
        a, b = tok.decode(ids[:k - 1]), tok.decode(ids[:k])
        if b.startswith(a) and len(a) >= 3 and len(b) - len(a) >= 2 and "\ufffd" not in b:
            stop = b[len(a) - 2:len(a) + 2]
            if stop.strip() and TEXT.count(stop) == 1:
                return stop
    raise AssertionError("no stop string across a token boundary")


def feed(proc: OutputProcessor, rid: str, ids: list[int], per_step: int, finish_last: str | None = None):
    """Drive `proc` as a core would: `per_step` tokens per output (speculative steps make several)."""
    outs, stopped = [], []
    for i in range(0, len(ids), per_step):
        chunk = ids[i:i + per_step]
        last = i + per_step >= len(ids)
        core = RequestOutput(rid, chunk, "", "", [], 5, 0, finished=bool(last and finish_last),
                             finish_reason=finish_last if last else None,
                             new_logprobs=[TokenLogprob(t, -1.0) for t in chunk])
        got, st = proc.process_step([core])
        outs += got
        stopped += st
        if got and got[-1].finished:
            break
    return outs, stopped


@pytest.mark.parametrize("per_step", [1, 3, 100])
def test_stop_string_across_tokens_and_steps(tok, per_step):
    ids = tok.encode(TEXT)
    stop = split_stop(tok, ids)
    want_text, want_n = reference(tok, ids, stop)
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(stop=["never-here", stop], max_tokens=len(ids)))
    outs, stopped = feed(proc, "r", ids, per_step)
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == want_text and stop not in final.text
    assert final.output_token_ids == ids[:want_n]  # usage: up to and including the token that completed it
    assert sum(len(o.new_token_ids) for o in outs) == want_n  # tokens after it are dropped, with their logprobs
    assert sum(len(o.new_logprobs) for o in outs) == want_n
    assert stopped == ["r"] and "r" not in proc  # the caller aborts it in the core
    emitted = ""
    for o in outs:  # streaming: what was sent is always a prefix of the final text (held back until sure)
        emitted += o.new_text
        assert want_text.startswith(emitted)
    assert emitted == want_text


def test_min_tokens_ignores_an_earlier_stop_string(tok):
    ids = tok.encode(TEXT)
    stop = "STOP"
    _, n = reference(tok, ids, stop)
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(stop=[stop], min_tokens=n + 1, max_tokens=len(ids)))
    outs, stopped = feed(proc, "r", ids, 1, finish_last="length")
    assert outs[-1].finish_reason == "length" and not stopped
    assert outs[-1].text == tok.decode(ids) and "".join(o.new_text for o in outs) == tok.decode(ids)


def test_core_finishes_pass_through(tok):
    ids = tok.encode("x = 1\ny = 2\n")
    proc = OutputProcessor(tok)
    proc.add("eos", SamplingParams(stop=["zzz"]))
    outs, stopped = feed(proc, "eos", ids + [0], 1, finish_last="stop")  # the core saw EOS (or a stop token id)
    final = outs[-1]
    assert final.finish_reason == "stop" and final.stop_reason is None and not stopped
    assert final.text == tok.decode(ids)  # the finishing token is counted, not detokenized
    assert final.output_token_ids == ids + [0]
    proc.add("gone", SamplingParams())
    proc.forget("gone")  # aborted: what the core still sends is dropped
    assert proc.process_step([RequestOutput("gone", [1], "", "", [], 1, 0)]) == ([], [])
    proc.add("err", SamplingParams())
    got, _ = proc.process_step([RequestOutput("err", [], "", "", [], 1, 0, True, "error", error="boom")])
    assert got[0].finish_reason == "error" and got[0].error == "boom" and "err" not in proc


def test_core_without_text_plus_processor_equals_offline(tiny_dir):
    """The core process's path (LLMEngine(detokenize=False) + an OutputProcessor + an abort on stop) gives the
    offline API's outputs, and the abort frees the request's KV blocks."""
    cfg = EngineConfig(model=tiny_dir, kv_cache_bytes=8 << 20, max_model_len=256)
    llm = LLM(config=cfg)
    prompts = ["def f(x):\n", "import os\n", "class A:\n", "# a comment\n"]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stops = []
    for r in free:  # a stop string from the middle of each greedy output, across a token boundary
        ids = r.outputs[0].token_ids
        k = len(ids) // 2
        a, b = llm.tokenizer.decode(ids[:k]), llm.tokenizer.decode(ids[:k + 1])
        stops.append(b[max(0, len(a) - 2):len(a) + 1] if b.startswith(a) and b[len(a):].strip() else "\n")
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops]
    offline = llm.generate(prompts, params)

    core = LLMEngine(cfg, detokenize=False)
    proc = OutputProcessor(core.tokenizer)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", core.tokenizer.encode(p), sp)
        proc.add(f"r{i}", sp)
    final, aborts = {}, 0
    while core.has_unfinished_requests():
        outs = core.step()
        assert all(o.text == "" and o.new_text == "" for o in outs)  # the core makes no text
        outs, stopped = proc.process_step(outs)
        for rid in stopped:
            core.abort_request(rid)
            aborts += 1
        final.update({o.request_id: o for o in outs if o.finished})
    for i, r in enumerate(offline):
        c, o = r.outputs[0], final[f"r{i}"]
        assert (o.text, o.output_token_ids, o.finish_reason, o.stop_reason) == (
            c.text, c.token_ids, c.finish_reason, c.stop_reason)
        ref_text, ref_n = reference(llm.tokenizer, free[i].outputs[0].token_ids, stops[i]) if stops[i] in \
            free[i].outputs[0].text else (free[i].outputs[0].text, 24)
        assert (c.text, len(c.token_ids)) == (ref_text, ref_n)
    assert aborts == sum(r.outputs[0].finish_reason == "stop" for r in offline) >= 2
    assert core.kv.pool.num_used == 0 and core.stats().num_running == 0 and len(proc) == 0
