"""`--cuda-graphs` (engine/graphs.py): decode steps through static buffers padded to batch-size buckets. The
capture itself needs a GPU; what runs here is everything around it — bucketing, padding rows that write into
the runner's scratch block, the fixed-width block tables — replayed eagerly (`capture="eager"`) on the CPU
through the PyTorch attention path CUDA uses, against the plain decode path; and the whole thing on the fake CUDA
device (tokenmill/testing/fake_cuda.py)."""

import pytest
import torch

from tokenmill.engine.graphs import DecodeGraphs, buckets, max_graph_batch
from tokenmill.engine.llm import LLM
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import TokenmillError
from tokenmill.model.loader import ModelLoadError
from tokenmill.testing.fake_cuda import fake_cuda


def test_buckets_and_the_gather_bound():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert max_graph_batch(256, 1024) == 256
    assert max_graph_batch(64, 8192) == 32  # 2^18 gathered tokens per layer
    assert max_graph_batch(256, 1 << 19) == 0


def _pytorch_path(llm, monkeypatch):
    """The attention and linears CUDA runs: no fused C++ stacks, no C++ attention kernels."""
    from tokenmill.model import attention

    m = llm.engine.runner.model
    m.fused = m.fused_mixed = None
    monkeypatch.setattr(attention, "_cpu_kernels", lambda q, cache: None)


def _with_graphs(llm, max_batch):
    e = llm.engine
    old = e.runner
    r = ModelRunner(old.model, old.cfg, old.device, old.dtype, old.num_blocks, old.block_size, old.sliding_window,
                    kv_dtype=old.kv_dtype, scratch_block=True)
    r.enable_graphs(max_batch, e.max_model_len, capture="eager")
    e.runner = r
    return r


@pytest.mark.parametrize("n", [1, 5])
def test_padded_graph_steps_give_the_plain_decode_tokens(tiny_dir, monkeypatch, n):
    """n sequences of different lengths (tables of different widths) decoded together: the graphs path (bucket 1 or 8:
    padding rows write into the scratch block) emits exactly the plain path's tokens, and the scratch block
    is the only one the padding touched."""
    prompts = [list(range(3 + i, 3 + i + 9 + 13 * i)) for i in range(n)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = LLM(str(tiny_dir), dtype="float32", enable_prefix_caching=False, kv_cache_bytes="4MiB")
    _pytorch_path(ref, monkeypatch)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    llm = LLM(str(tiny_dir), dtype="float32", enable_prefix_caching=False, kv_cache_bytes="4MiB")
    _pytorch_path(llm, monkeypatch)
    r = _with_graphs(llm, max_batch=8)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    assert r.graphs.replays >= 11  # every decode step of the batch went through the graphs path
    k = r.kv_caches[0]
    assert k.shape[1] == r.num_blocks + 1 and r.scratch_block == r.num_blocks
    if n == 5:  # a padded bucket (8): the scratch block was written
        assert k[:, r.scratch_block].abs().sum() > 0


def test_graphs_beyond_the_largest_bucket_run_eagerly(tiny_dir, monkeypatch):
    prompts = [[5 + i] * 6 for i in range(5)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_dir), dtype="float32", enable_prefix_caching=False, kv_cache_bytes="4MiB")
    _pytorch_path(llm, monkeypatch)
    r = _with_graphs(llm, max_batch=4)
    outs = llm.generate(prompts, sp)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert r.graphs.replays == 0  # 5 > 4: the plain path


def test_cuda_graphs_on_the_fake_cuda_device(tiny_dir):
    with fake_cuda() as fc:
        llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16", cuda_graphs=True, max_model_len=256,
                  max_num_seqs=8)
        outs = llm.generate(["hello world " * 5, "x"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    g = llm.engine.runner.graphs
    assert g.buckets == [1, 2, 4, 8] and g.replays >= 3
    assert {dev for _, dev, _ in fc.outputs} == {"cuda"}
    assert all(o.outputs[0].token_ids == [fc.token] * 4 for o in outs)
    assert "CUDA graphs for decode steps of 1..8 sequences" in llm.engine.describe()


def test_cuda_graphs_refusals(tiny_dir, monkeypatch):
    from tokenmill.engine import graphs

    with pytest.raises(ModelLoadError, match="needs a CUDA device"):
        LLM(str(tiny_dir), device="cpu", cuda_graphs=True)
    with pytest.raises(TokenmillError, match="cuda_graphs.*int8"):
        LLM(str(tiny_dir), device="cpu", cuda_graphs=True, kv_cache_dtype="int8")
    monkeypatch.setattr(graphs, "GATHER_TOKENS", 1024)  # the tiny model's 2,048 positions exceed it
    with fake_cuda():
        with pytest.raises(ModelLoadError, match="lower --max-model-len to at most 1024"):
            LLM(str(tiny_dir), device="cuda", dtype="bfloat16", cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs.__init__(object.__new__(DecodeGraphs), type("R", (), {"device": torch.device("cpu")})(), 4,
                              64, "cuda")
