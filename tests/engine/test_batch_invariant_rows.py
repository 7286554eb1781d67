"""Batch invariance (EngineConfig.batch_invariant, `--batch-invariant`): a row's logits are the same bits however
the step that computes it is made up, which lossless greedy speculation in bf16 rests on (a verify step, a
preemption's recompute and the tail of a batch all change the row counts and the attention path a row takes).

Checked at the runner, bit for bit: a sequence decoded token by token, then recomputed in one chunk beside a
300-row prompt (more rows than AMX's small-row limit: oneDNN's territory), must give every generated position
the logits it had as a decode row; a prompt prefilled in odd chunks (one of them a single token) must give every
prompt row the bits of one whole chunk. With batch_invariant off the recompute's rows differ (the prefill kernel
and oneDNN give other last bits): the check is not vacuous. End to end: 240 sequences with and without n-gram
speculation under a KV cache small enough to preempt, token for token.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.errors import TokenmillError
from tokenmill.hardware import capabilities
from tokenmill.model.cpu_kernels import get_kernels

needs_bf16_kernels = pytest.mark.skipif(get_kernels() is None or not capabilities().native_bf16,
                                        reason="no C++ CPU kernels / native bf16 on this machine")

PROMPT = [(7 * i + 3) % 3000 + 5 for i in range(40)]
OTHER = [(11 * i + 1) % 3000 + 5 for i in range(300)]


def _llm(mode: str) -> LLM:
    return LLM("demo", dtype="bfloat16", kv_cache_bytes="64MiB", batch_invariant=mode, enable_prefix_caching=False)


def _run(runner, seqs):
    out = runner.execute(SchedulerOutput(seqs, sum(len(s.token_ids) for s in seqs)), float_logits=False)
    return [out.logits[o:o + s.num_logits].clone() for o, s in zip(out.logit_offsets, seqs)]


def _decode_then_recompute(mode: str):
    """Logits of positions 40..59 as decode rows, and as rows of one recompute chunk beside a 300-token prompt."""
    runner = _llm(mode).engine.runner
    blocks, other_blocks = list(range(0, 8)), list(range(8, 40))
    n = len(PROMPT)
    (last,) = _run(runner, [ScheduledSeq("a", PROMPT, 0, blocks, 1, decode_from=n)])
    toks, decoded = list(PROMPT), []
    for p in range(n, n + 20):
        toks.append(int(last[-1].float().argmax()))
        (last,) = _run(runner, [ScheduledSeq("a", [toks[-1]], p, blocks, 1, decode_from=n)])
        decoded.append(last[-1])
    rec, _ = _run(runner, [ScheduledSeq("a", toks, 0, blocks, len(toks), decode_from=n),
                           ScheduledSeq("b", OTHER, 0, other_blocks, 1, decode_from=len(OTHER))])
    return torch.stack(decoded), rec[n:]


@needs_bf16_kernels
def test_auto_is_on_for_bf16_with_own_kernels_and_off_for_fp32():
    assert _llm("auto").engine.batch_invariant and _llm("auto").engine.stats().batch_invariant  # /metrics reads it
    assert not LLM("demo", dtype="float32", kv_cache_bytes="16MiB").engine.batch_invariant
    assert LLM("demo", dtype="float32", kv_cache_bytes="16MiB", batch_invariant="on").engine.batch_invariant


def test_bad_value_is_a_clear_error():
    with pytest.raises(TokenmillError, match="batch_invariant"):
        EngineConfig(model="demo", batch_invariant="yes")


@pytest.mark.skipif(get_kernels() is None, reason="no C++ CPU kernels on this machine")
def test_on_where_it_cannot_hold_is_a_clear_error_not_a_silent_off():
    """int8 linears are not PackedWeights: "on" could not give them small-row bits, so it is refused by name."""
    with pytest.raises(TokenmillError, match="batch_invariant"):
        LLM("demo", quantization="int8", kv_cache_bytes="16MiB", batch_invariant="on")
    assert not LLM("demo", quantization="int8", kv_cache_bytes="16MiB").engine.batch_invariant  # auto: off


@needs_bf16_kernels
@pytest.mark.parametrize("mode", ["on", "strict"])
def test_recomputed_generated_rows_have_their_decode_bits(mode):
    decoded, recomputed = _decode_then_recompute(mode)
    assert torch.equal(decoded, recomputed)


@needs_bf16_kernels
def test_without_it_the_recompute_differs():
    decoded, recomputed = _decode_then_recompute("off")
    assert not torch.equal(decoded, recomputed)  # the prefill kernel's (and oneDNN's) last bits
    assert (decoded.float().argmax(-1) == recomputed.float().argmax(-1)).float().mean() > 0.8  # but the same model


@needs_bf16_kernels
@pytest.mark.parametrize("mode", ["on", "strict"])
def test_prompt_rows_do_not_depend_on_the_chunking(mode):
    runner = _llm(mode).engine.runner
    n, blocks = len(PROMPT), list(range(8))
    (whole,) = _run(runner, [ScheduledSeq("a", PROMPT, 0, blocks, n, decode_from=n)])
    parts = []
    for a, b in ((0, 17), (17, 18), (18, 33), (33, 40)):  # (17, 18): one token alone (the decode fast path's shape)
        parts += _run(runner, [ScheduledSeq("a", PROMPT[a:b], a, blocks, b - a, decode_from=n)])
    assert torch.equal(torch.cat(parts), whole)


@needs_bf16_kernels
def test_strict_prompt_rows_are_decode_rows():
    """strict: a prompt (which may hold an earlier answer) gets, row by row, the bits of decoding it token by token."""
    runner = _llm("strict").engine.runner
    n, blocks = len(PROMPT), list(range(8))
    (whole,) = _run(runner, [ScheduledSeq("a", PROMPT, 0, blocks, n, decode_from=n)])
    one = [_run(runner, [ScheduledSeq("a", [t], p, blocks, 1, decode_from=0)])[0] for p, t in enumerate(PROMPT)]
    assert torch.equal(torch.cat(one), whole)


@needs_bf16_kernels
def test_greedy_speculation_is_lossless_at_a_large_batch_with_preemption():
    """240 sequences in a 32 MiB KV cache (preempted and recomputed at other moments with and without speculation):
    before batch invariance 1 of 240 outputs differed here (3 on the AVX-512 path without AMX)."""
    base = [[3, 4, 5, 6] * 4, [9, 10, 11] * 5, [20, 21] * 7, [7, 8, 9, 10, 11] * 3]
    prompts = [[(t + i) % 200 + 3 for t in p] for i in range(60) for p in base]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, preempted = [], 0
    for spec in ({}, dict(speculative_model="ngram", num_speculative_tokens=4)):
        llm = LLM("demo", dtype="bfloat16", kv_cache_bytes="32MiB", **spec)
        assert llm.engine.batch_invariant
        outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params)])
        preempted += llm.engine.stats().num_preempted_total
    assert preempted > 0  # the case this covers happened (in one run or both)
    assert outs[0] == outs[1]
