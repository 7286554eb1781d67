"""The session-9 decode attention (csrc/paged_decode.cpp: tasks split between threads by token count, the next
task's K prefetched during the current one's pass 2, a vectorized softmax maximum) against the kernel it replaces
(`set_decode_attention(False)`, TOKENMILL_DECODE_ATTN=0) and against dense SDPA.

It changes only which thread runs a (sequence, kv head) and what is prefetched, never the math of one, so its
output must be the same bits as the reference kernel's for every query / cache dtype, GQA ratio, head size,
window and thread count; the dense comparison is the independent check of both."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.cpu_kernels import get_kernels

K = get_kernels()
pytestmark = pytest.mark.skipif(K is None or not hasattr(K, "set_decode_attention"),
                                reason="no C++ CPU kernels on this machine")


def _case(g, d, nh, kvh, hd, cache_dtype, q_dtype, bs=16, lo=1, hi=300):
    lens = torch.randint(lo, hi + 1, (d,), generator=g, dtype=torch.int64)
    lens[0] = hi  # one long context beside short ones: the split by token count differs from the split by tasks
    nblk = [(int(n) + bs - 1) // bs for n in lens]
    nb = sum(nblk) + 3
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(d, max(nblk), dtype=torch.int64)
    i = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[i:i + n]
        i += n
    q = torch.randn(d, nh, hd, generator=g).to(q_dtype)
    if cache_dtype == torch.int8:
        k = torch.randint(-127, 128, (nb, kvh, bs, hd), generator=g, dtype=torch.int8)
        v = torch.randint(-127, 128, (nb, kvh, bs, hd), generator=g, dtype=torch.int8)
        ks = torch.rand(nb, kvh, generator=g) * 0.02 + 1e-3
        vs = torch.rand(nb, kvh, generator=g) * 0.02 + 1e-3
        return q, k, v, tables, lens, (ks, vs)
    k = torch.randn(nb, kvh, bs, hd, generator=g).to(cache_dtype)
    v = torch.randn(nb, kvh, bs, hd, generator=g).to(cache_dtype)
    return q, k, v, tables, lens, None


def _attend(q, k, v, tables, lens, scales, window, on: bool):
    out = torch.empty_like(q)
    prev = K.set_decode_attention(on)
    try:
        if scales is None:
            K.paged_decode_attention(out, q, k, v, tables, lens, 0.125, window)
        else:
            K.paged_decode_attention(out, q, k, v, tables, lens, 0.125, window, scales[0], scales[1])
    finally:
        K.set_decode_attention(prev)
    return out


def _dense(q, k, v, tables, lens, scales, window):
    """fp32 SDPA over the gathered (dequantized) K/V of each sequence: [d, nh, hd]."""
    d, nh, hd = q.shape
    kvh, bs = k.shape[1], k.shape[2]
    kf, vf = k.float(), v.float()
    if scales is not None:
        kf = kf * scales[0][:, :, None, None]
        vf = vf * scales[1][:, :, None, None]
    out = []
    for i in range(d):
        n = int(lens[i])
        blocks = tables[i, : (n + bs - 1) // bs]
        keys = kf[blocks].transpose(1, 2).reshape(-1, kvh, hd)[:n]  # [n, kvh, hd]
        vals = vf[blocks].transpose(1, 2).reshape(-1, kvh, hd)[:n]
        if window and n > window:
            keys, vals = keys[n - window:], vals[n - window:]
        kk = keys.repeat_interleave(nh // kvh, dim=1).transpose(0, 1)
        vv = vals.repeat_interleave(nh // kvh, dim=1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i].float()[:, None], kk, vv, scale=0.125)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("q_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.int8), (torch.float32, torch.int8)])
@pytest.mark.parametrize("nh,kvh,hd", [(4, 4, 64), (8, 4, 64), (8, 2, 128), (8, 1, 64), (16, 2, 128)])
def test_same_bits_as_the_reference_kernel(threads, q_dtype, cache_dtype, nh, kvh, hd):
    """GQA ratios 1 / 2 / 4 / 8, head_dim 64 / 128; 13 sequences of 1-300 tokens, and one sequence alone."""
    g = torch.Generator().manual_seed(nh * 1000 + kvh * 10 + hd)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for d in (13, 1):
            args = _case(g, d, nh, kvh, hd, cache_dtype, q_dtype)
            for window in (0, 37):
                ref = _attend(*args, window, on=False)
                new = _attend(*args, window, on=True)
                assert torch.equal(new, ref), (d, window, (new.float() - ref.float()).abs().max())
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("q_dtype,cache_dtype,tol", [
    (torch.float32, torch.float32, 2e-5), (torch.bfloat16, torch.bfloat16, 3e-2), (torch.bfloat16, torch.int8, 3e-2)])
def test_close_to_dense_attention(q_dtype, cache_dtype, tol):
    """The independent reference: fp32 SDPA over the same (dequantized) cache; tolerance per dtype (bf16: the
    query, the softmax weights and the output are rounded to bf16)."""
    g = torch.Generator().manual_seed(7)
    torch.set_num_threads(2)
    q, k, v, tables, lens, scales = _case(g, 11, 8, 4, 64, cache_dtype, q_dtype)
    for window in (0, 50):
        new = _attend(q, k, v, tables, lens, scales, window, on=True)
        ref = _dense(q, k, v, tables, lens, scales, window)
        assert (new.float() - ref).abs().max() < tol * max(1.0, ref.abs().max().item())


def test_prefetch_distance_is_checked_and_does_not_change_the_result():
    g = torch.Generator().manual_seed(3)
    args = _case(g, 9, 8, 4, 64, torch.bfloat16, torch.bfloat16)
    base = _attend(*args, 0, on=True)
    prev = K.set_decode_attention_prefetch(16)
    try:
        assert torch.equal(_attend(*args, 0, on=True), base)
        K.set_decode_attention_prefetch(256)
        assert torch.equal(_attend(*args, 0, on=True), base)
        with pytest.raises(RuntimeError, match="multiple of 16"):
            K.set_decode_attention_prefetch(10)
    finally:
        K.set_decode_attention_prefetch(prev)


def _env_run(value: str) -> subprocess.CompletedProcess:
    code = ("from tokenmill.model.cpu_kernels import get_kernels\n"
            "k = get_kernels()\n"
            "print('on' if k.set_decode_attention(True) else 'off')\n")
    env = dict(os.environ, TOKENMILL_DECODE_ATTN=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_env_switch_selects_the_reference_kernel_and_rejects_other_values():
    r = _env_run("0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "off"
    r = _env_run("1")
    assert r.returncode == 0 and r.stdout.strip() == "on", r.stderr
    r = _env_run("yes")
    assert r.returncode != 0 and "TOKENMILL_DECODE_ATTN must be 0 or 1" in r.stderr


MANY = [[(31 * i + 7 * j) % 500 + 1 for j in range(3 + 11 * i)] for i in range(13)]  # 13 sequences, 3..135 tokens


@pytest.mark.parametrize("preset,dtype,quant,kv", [
    ("tiny", "float32", "none", "auto"), ("tiny", "bfloat16", "none", "auto"), ("tiny", "bfloat16", "int8", "int8"),
    ("tiny-qwen2", "bfloat16", "none", "auto"), ("tiny-qwen3", "float32", "none", "bfloat16")])
def test_engine_tokens_and_logprobs_equal_with_the_kernel_on_and_off(model_dir, preset, dtype, quant, kv):
    from tokenmill import LLM, SamplingParams
    from tokenmill.model.linear import onednn_bf16

    if dtype == "bfloat16" and quant == "none" and not onednn_bf16():
        pytest.skip("bf16 is emulated on this CPU")  # (an int8 model's linears are int8 whatever its dtype)
    llm = LLM(str(model_dir(preset)), dtype=dtype, quantization=quant, kv_cache_dtype=kv, kv_cache_bytes="8MiB")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    got = {}
    for on in (False, True):
        prev = K.set_decode_attention(on)
        try:
            res = llm.generate(MANY, params)
        finally:
            K.set_decode_attention(prev)
        llm.engine.kv.pool.reset_prefix_cache()
        got[on] = ([r.outputs[0].token_ids for r in res],
                   torch.tensor([[lp.logprob for lp in r.outputs[0].logprobs] for r in res]))
    assert got[True][0] == got[False][0]
    assert torch.equal(got[True][1], got[False][1])


def _verify_rows(g, nh, kvh, hd, runs, bs=16):
    """Rows as a verify step lays them out: per sequence, R consecutive rows over one block table with contexts
    c, c + 1, .., c + R - 1 (run (c, R)); a single decode row is (c, 1). -> q, k, v, tables, lens (bf16)"""
    nblk = [(c + r - 1 + bs - 1) // bs for c, r in runs]
    nb = sum(nblk) + 2
    perm = torch.randperm(nb, generator=g)
    rows, lens, i = [], [], 0
    for (c, r), n in zip(runs, nblk):
        t = torch.zeros(max(nblk), dtype=torch.int64)
        t[:n] = perm[i:i + n]
        i += n
        rows += [t] * r
        lens += list(range(c, c + r))
    q = torch.randn(len(lens), nh, hd, generator=g).bfloat16()
    k = torch.randn(nb, kvh, bs, hd, generator=g).bfloat16()
    v = torch.randn(nb, kvh, bs, hd, generator=g).bfloat16()
    return q, k, v, torch.stack(rows).contiguous(), torch.tensor(lens)


@pytest.mark.skipif(K is None or not hasattr(K, "set_decode_attention_group"), reason="no grouped decode attention")
@pytest.mark.parametrize("nh,kvh,hd", [(8, 4, 32), (8, 2, 64), (8, 8, 128), (16, 2, 32), (4, 4, 64)])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_verify_rows_of_one_sequence_are_each_rows_own_bits(nh, kvh, hd, window, threads):
    """A verify step's rows of one sequence (same block table, consecutive contexts) run as one task per kv head
    (bf16 query and cache): every row must be the same bits as that row attended alone (what a decode step
    computes for it, which makes speculative decoding lossless) and the same with grouping off, for odd and even
    contexts (pass 2's odd tail), runs that cross a block, up to 17 rows, a window, and beside single rows."""
    g = torch.Generator().manual_seed(nh * 1000 + hd * 10 + window + threads)
    runs = [(37, 5), (150, 1), (16, 9), (1, 3), (200, 17), (64, 2), (99, 1)]
    q, k, v, tables, lens = _verify_rows(g, nh, kvh, hd, runs)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty_like(q)
        K.paged_decode_attention(out, q, k, v, tables, lens, 0.125, window)
        alone = torch.empty_like(q)
        for d in range(len(lens)):
            o = torch.empty_like(q[d:d + 1])
            K.paged_decode_attention(o, q[d:d + 1].contiguous(), k, v, tables[d:d + 1].contiguous(),
                                     lens[d:d + 1].contiguous(), 0.125, window)
            alone[d] = o[0]
        prev = K.set_decode_attention_group(False)
        try:
            ungrouped = torch.empty_like(q)
            K.paged_decode_attention(ungrouped, q, k, v, tables, lens, 0.125, window)
        finally:
            K.set_decode_attention_group(prev)
    finally:
        torch.set_num_threads(prev_threads)
    assert torch.equal(out.view(torch.int16), alone.view(torch.int16))
    assert torch.equal(out.view(torch.int16), ungrouped.view(torch.int16))
    dense = _dense(q, k, v, tables, lens, None, window)
    torch.testing.assert_close(out.float(), dense, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(K is None or not hasattr(K, "set_decode_attention_group"), reason="no grouped decode attention")
def test_group_env_switch_turns_grouping_off_and_rejects_other_values():
    code = ("from tokenmill.model.cpu_kernels import get_kernels\n"
            "k = get_kernels()\n"
            "print('on' if k.set_decode_attention_group(True) else 'off')\n")
    run = lambda v: subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TOKENMILL_DECODE_ATTN_GROUP=v),
                                   capture_output=True, text=True, timeout=300)
    r = run("0")
    assert r.returncode == 0 and r.stdout.strip() == "off", r.stderr
    r = run("1")
    assert r.returncode == 0 and r.stdout.strip() == "on", r.stderr
    r = run("no")
    assert r.returncode != 0 and "TOKENMILL_DECODE_ATTN_GROUP must be 0 or 1" in r.stderr
