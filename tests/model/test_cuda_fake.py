"""The engine's CUDA path checked without a GPU (tokenmill/testing/fake_cuda.py): every op of every step runs on
PyTorch's fake tensors as device cuda:0 — shapes, dtypes and devices are checked as on a GPU, nothing is
computed, and a value read back from the device inside a step raises. The scheduler, KV manager, speculation and
the sampler run for real around the model (the model's outputs are placeholders)."""

import pytest
import torch

from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.model.loader import ModelLoadError
from tokenmill.testing.fake_cuda import DeviceReadBack, fake_cuda

PROMPTS = ["def fibonacci(n):", "import os\n" * 24]  # a short and a longer (chunked) prompt


def _generate(model, max_tokens=3, **kw):
    with fake_cuda() as fc:
        llm = LLM(model, device="cuda", **kw)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return fc, llm, outs


@pytest.mark.parametrize("kw, logits_dtype", [
    (dict(dtype="bfloat16"), torch.bfloat16),
    (dict(dtype="float16", quantization="int8"), torch.float16),
    (dict(dtype="float32", kv_cache_dtype="int8"), torch.float32),
    (dict(dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8"), torch.bfloat16),
], ids=["bf16", "fp16+int8", "fp32+int8kv", "fp8+fp8kv"])
def test_every_precision_runs_its_cuda_path(tiny_dir, kw, logits_dtype):
    fc, llm, outs = _generate(str(tiny_dir), max_num_batched_tokens=32, **kw)
    assert llm.engine.device.type == "cuda"
    # prefill chunks of the 24-line prompt, then decode steps: all through the fake device
    assert fc.executed >= 4
    assert {dev for _, dev, _ in fc.outputs} == {"cuda"}
    assert {d for d, _, _ in fc.outputs} == {logits_dtype}
    assert [o.outputs[0].token_ids for o in outs] == [[fc.token] * 3] * 2
    if kw.get("kv_cache_dtype") in ("int8", "fp8"):  # the 1-byte cache off the CPU: blocks grouped on the host
        assert llm.engine.runner._host_kv_groups


@pytest.mark.parametrize("kw", [
    dict(speculative_model="ngram", num_speculative_tokens=3),
    dict(speculative_model="demo-draft", num_speculative_tokens=3),
    dict(speculative_model="demo-draft", num_speculative_tokens="auto", quantization="fp8", kv_cache_dtype="fp8"),
], ids=["ngram", "draft", "draft-auto-fp8"])
def test_speculative_decoding_runs_its_cuda_path(kw):
    fc, llm, outs = _generate("demo", max_tokens=6, dtype="bfloat16", **kw)
    assert {dev for _, dev, _ in fc.outputs} == {"cuda"}
    assert [o.outputs[0].token_ids for o in outs] == [[fc.token] * 6] * 2
    if kw["speculative_model"] != "ngram":  # the draft's own runner ran on the fake device too
        assert llm.engine.spec.proposer.runner.device.type == "cuda"


def test_prefix_hits_and_preemption_on_the_cuda_path(tiny_dir):
    """A shared prefix (cached blocks reused), a KV cache too small for both sequences (one is preempted and
    recomputed): the block bookkeeping around the fake device."""
    prompt = list(range(5, 37))  # 32 tokens = 2 blocks of 16; both fit at first (2 shared + 1 each), not once they grow past 48 tokens (2 + 2 + 2 > 4)
    with fake_cuda() as fc:
        llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16", kv_cache_dtype="int8", block_size=16,
                  kv_cache_bytes=4 * _block_bytes(tiny_dir, torch.int8))
        sp = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
        first = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        outs = llm.generate([prompt + [9], prompt + [11]], sp)
    assert first[0].outputs[0].token_ids == [fc.token] * 2
    assert all(o.outputs[0].token_ids == [fc.token] * 17 for o in outs)
    assert outs[0].num_cached_tokens >= 32  # the first request's blocks were reused
    assert llm.engine.scheduler.num_preemptions > 0


def _block_bytes(model_dir, kv_dtype):
    from tokenmill.engine.runner import ModelRunner
    from tokenmill.model.config import ModelConfig

    return ModelRunner.kv_bytes_per_block(ModelConfig.from_dir(model_dir), 16, kv_dtype)


def test_fp8_refused_below_sm89_naming_the_device(tiny_dir):
    with fake_cuda(capability=(8, 0), name="NVIDIA A100 (fake)"):
        with pytest.raises(ModelLoadError, match="A100.*sm80"):
            LLM(str(tiny_dir), device="cuda", dtype="bfloat16", quantization="fp8")


def test_a_cpu_tensor_in_the_step_is_caught(tiny_dir, monkeypatch):
    """The check can fail: a step input left on the CPU (the runner not moving it to the device) is the error a
    GPU would raise."""
    from tokenmill.engine import runner

    monkeypatch.setattr(runner.ModelRunner, "_tensor", lambda self, data, dtype=torch.long: torch.tensor(data, dtype=dtype))
    with fake_cuda():
        llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16")
        with pytest.raises(Exception, match="(?i)device"):
            llm.engine.runner.execute(_one_prefill(llm))


def test_a_device_read_back_in_the_step_is_caught(tiny_dir, monkeypatch):
    """A value read back on the host inside the model (a GPU sync per step) raises under the fake device, as
    torch.unique in the 1-byte KV write did before its blocks were grouped on the host."""
    with fake_cuda():
        llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16", kv_cache_dtype="int8")
        monkeypatch.setattr(llm.engine.runner, "_host_kv_groups", False)
        with pytest.raises(DeviceReadBack, match="unique"):
            llm.engine.runner.execute(_one_prefill(llm))


def _one_prefill(llm):
    from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput

    return SchedulerOutput(seqs=[ScheduledSeq(request_id="r", token_ids=list(range(1, 21)), start_pos=0,
                                              block_ids=[0, 1], num_logits=1)])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_host_grouped_scaled_kv_write_is_bit_identical(kv):
    """write_kv_scaled with the blocks grouped on the host (the CUDA path: no torch.unique, every touched block
    requantized) stores the same bits and scales as the device-grouped path, chunks growing the scales."""
    from tokenmill.model.attention import Fp8KVCache, Int8KVCache, KVBlockGroups, write_kv_scaled

    cls = Int8KVCache if kv == "int8" else Fp8KVCache
    g = torch.Generator().manual_seed(3)
    bs, kvh, hd, nb = 16, 2, 32, 8
    a, b = cls.empty(nb, kvh, bs, hd, "cpu"), cls.empty(nb, kvh, bs, hd, "cpu")
    tables = [[3, 5, 1], [6, 2]]
    lens = [40, 25]
    for d, n in enumerate(lens):
        k = torch.randn(n, kvh, hd, generator=g) * torch.linspace(0.2, 4, n)[:, None, None]
        v = torch.randn(n, kvh, hd, generator=g)
        k[n // 2, 1, 5] = 30.0
        cuts = [0, 7, 8, 19, 20, 33, n] if n > 33 else [0, 5, 6, 17, n]
        for lo, hi in zip(cuts, cuts[1:]):
            slots = [tables[d][p // bs] * bs + p % bs for p in range(lo, hi)]
            write_kv_scaled(a, k[lo:hi], v[lo:hi], torch.tensor(slots))
            write_kv_scaled(b, k[lo:hi], v[lo:hi], torch.tensor(slots), KVBlockGroups.of(slots, bs, torch.tensor))
    assert torch.equal(a.raw(), b.raw())
    assert torch.equal(a.scales, b.scales)
    assert a.scales.gt(0).sum() > 0


def test_host_block_groups_match_a_hand_computation():
    from tokenmill.model.attention import KVBlockGroups

    g = KVBlockGroups.of([5 * 16 + 3, 5 * 16 + 4, 2 * 16 + 0, 9 * 16 + 15], 16, list)
    assert g.blocks == [2, 5, 9]
    assert g.inverse == [1, 1, 0, 2]
    assert g.first_offset == [0, 3, 15]


@pytest.mark.parametrize("preset", ["tiny-mistral", "tiny-qwen3"])  # (tiny = Llama runs every test above)
def test_every_architecture_runs_its_cuda_path_sampled(model_dir, preset):
    with fake_cuda() as fc:
        llm = LLM(str(model_dir(preset)), device="cuda", dtype="bfloat16", quantization="fp8",
                  max_num_batched_tokens=32)
        outs = llm.generate(["hello world " * 10], SamplingParams(max_tokens=3, temperature=0.8, seed=1))
    assert fc.executed >= 3 and {dev for _, dev, _ in fc.outputs} == {"cuda"}
    assert outs[0].outputs[0].token_ids == [fc.token] * 3  # the placeholder logits' peak, sampled


def test_kv_tiers_store_and_load_through_the_cuda_path(tiny_dir, tmp_path):
    """Blocks evicted from a small device cache go to the host tier (read_blocks: device -> host bytes) and come
    back on a prefix hit (write_blocks: host bytes -> device), on the fake device."""
    prompt = list(range(5, 69))  # 4 blocks
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with fake_cuda():
        llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16", block_size=16, kv_host_bytes=1 << 20,
                  kv_host_dir=str(tmp_path), kv_cache_bytes=6 * _block_bytes(tiny_dir, torch.bfloat16))
        llm.generate([prompt], sp)
        for i in range(3):  # other prompts push the first one's blocks out of the device cache
            llm.generate([list(range(100 + 70 * i, 164 + 70 * i))], sp)
        again = llm.generate([prompt + [9]], sp)
    host = llm.engine.tiers.stats()["host"]
    assert host["stores"] >= 4 and host["loaded_blocks"] >= 4
    assert again[0].num_cached_tokens == 64


@pytest.mark.parametrize("kw", [dict(), dict(speculative_model="ngram", num_speculative_tokens=3),
                                dict(speculative_model="demo-draft", num_speculative_tokens="auto")],
                         ids=["plain", "ngram", "draft-auto"])
def test_batch_invariant_on_cuda_runs_by_fixed_tiles(kw, monkeypatch):
    """`--batch-invariant on` on CUDA (model/invariant.py): every step's attention through the fixed-tile decode
    attention (prompt rows too: the strict layout), on the device."""
    from tokenmill.model import invariant

    calls = []
    real = invariant.decode_attention
    monkeypatch.setattr("tokenmill.model.attention.decode_attention",
                        lambda q, *a: (calls.append((q.device.type, q.shape[0])), real(q, *a))[1])
    fc, llm, outs = _generate("demo", max_tokens=5, dtype="bfloat16", batch_invariant="on", **kw)
    eng = llm.engine
    assert eng.batch_invariant and eng.runner.tiles and eng.runner.invariant_attention == "strict"
    assert {dev for _, dev, _ in fc.outputs} == {"cuda"}
    assert [o.outputs[0].token_ids for o in outs] == [[fc.token] * 5] * 2
    assert calls and {d for d, _ in calls} == {"cuda"}
    assert max(n for _, n in calls) > 2  # the prompts' rows attended as decode rows


@pytest.mark.parametrize("kw, named", [(dict(cuda_graphs=True, max_model_len=512), "cuda-graphs"),
                                       (dict(quantization="fp8"), "quantization fp8"),
                                       (dict(kv_cache_dtype="fp8"), "kv-cache-dtype fp8")])
def test_batch_invariant_on_cuda_refuses_what_fixed_tiles_cannot_cover(kw, named):
    with fake_cuda():
        with pytest.raises(ModelLoadError, match=f"batch_invariant.*{named}"):
            LLM("demo", device="cuda", dtype="bfloat16", batch_invariant="on", **kw)
        assert not LLM("demo", device="cuda", dtype="bfloat16").engine.batch_invariant  # auto: off on CUDA
