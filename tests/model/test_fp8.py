"""FP8 (e4m3): `--quantization fp8` (W8A8 dynamic through torch._scaled_mm) and `--kv-cache-dtype fp8`, checked on
the CPU (where both are emulated: the same math as on CUDA sm89+, not its speed) against independent references,
plus the refusals and the CUDA capability table. The CUDA speed is a benchmark run on a lent GPU
(benchmarks/gpu_precision.py), not a test."""

import pytest
import torch
import torch.nn.functional as F

from tests.model.test_precision import load_train_demo, random_linear
from tests.parity import hf_logits, hf_model, make_req, rel_err
from tokenmill.engine.scoring import Scorer, heldout_quality
from tokenmill.errors import ModelLoadError, TokenmillError
from tokenmill.hardware import Capabilities

E4M3_MAX = 448.0


def e4m3_grid() -> torch.Tensor:
    """Every finite e4m3fn value, from its 256 bit patterns (independent of torch's float -> fp8 cast)."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return vals[torch.isfinite(vals)].unique()


def test_fp8_quantize_rows_is_the_nearest_e4m3_value_times_a_row_scale():
    from tokenmill.model.linear import fp8_quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0  # an all-zero row: scale 1, values 0
    q, s = fp8_quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (7, 1) and s[3, 0] == 1
    grid = e4m3_grid()
    y = x / s
    nearest = grid[(y[..., None] - grid).abs().argmin(-1)]
    # nearest on the grid (ties may go either way: compare distances, not values)
    assert torch.allclose((q.float() - y).abs(), (nearest - y).abs(), rtol=0, atol=1e-6)
    assert q.float().abs().amax(1)[torch.arange(7) != 3].eq(E4M3_MAX).all()  # each row's max lands on 448


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_fp8_linear_method_is_the_dequantized_product(rows):
    from tokenmill.model.linear import Fp8LinearMethod

    g = torch.Generator().manual_seed(rows)
    lin, w = random_linear(Fp8LinearMethod(), g)
    assert lin.weight.numel() == 0 and lin.w_fp8.dtype == torch.float8_e4m3fn  # the float weight is not kept
    x = torch.randn(rows, 96, generator=g)
    # the reference, by hand: per-channel weight scale and per-token activation scale, both max|.| / 448, values
    # rounded to the nearest e4m3 grid point, product in fp64
    grid = e4m3_grid().double()

    def q(t, dim):
        s = t.double().abs().amax(dim, keepdim=True) / E4M3_MAX
        y = t.double() / s
        return grid[(y[..., None] - grid).abs().argmin(-1)] * s

    ref = (q(x, 1) @ q(w, 1).t() + lin.bias.double()).float()
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 64)
    assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    err = ((got - F.linear(x, w, lin.bias)).norm() / F.linear(x, w, lin.bias).norm()).item()
    assert 1e-4 < err < 5e-2, err  # really fp8 (3 mantissa bits: a few % per value, averaging down in the sums)


def test_quality_gate_fp8_on_the_demo_model():
    """fp8 W8A8 held-out loss within +3% of fp32's (int8 W8A8's gate); greedy agreement >= 90% of the first 64
    positions of each held-out window."""
    td = load_train_demo()
    held = td.windows(td.load_stream("heldout"), 256)
    held = held[torch.linspace(0, len(held) - 1, 12).long()]
    q = heldout_quality(Scorer("demo", torch.float32, quantization="fp8"), held,
                        reference=Scorer("demo", torch.float32))
    assert q["loss"] <= q["reference_loss"] * 1.03, q
    assert q["agreement"] >= 0.90, q


def test_fp8_kv_write_keeps_values_within_its_scale():
    """Tokens written one chunk at a time (the scale of a block grows, earlier rows requantized): every stored
    value is its input to within e4m3's relative step (1/16) plus, for values in the subnormal range, half its
    smallest step (2^-10 of the scale) -- one more such rounding per requantization."""
    from tokenmill.model.attention import Fp8KVCache, write_kv_scaled

    g = torch.Generator().manual_seed(1)
    bs, kvh, hd = 16, 2, 32
    cache = Fp8KVCache.empty(8, kvh, bs, hd, "cpu")
    assert cache.data.dtype == torch.float8_e4m3fn
    tokens = 40
    k = torch.randn(tokens, kvh, hd, generator=g) * torch.linspace(0.1, 4, tokens)[:, None, None]  # growing
    v = torch.randn(tokens, kvh, hd, generator=g)
    slots = torch.tensor([3 * bs + i if i < bs else 5 * bs + (i - bs) if i < 2 * bs else 1 * bs + (i - 2 * bs)
                          for i in range(tokens)])
    for a, b in ((0, 5), (5, 6), (6, 20), (20, 21), (21, 40)):
        write_kv_scaled(cache, k[a:b], v[a:b], slots[a:b])
    for i, x in ((0, k), (1, v)):
        blk, off = slots // bs, slots % bs
        s = cache.scales[i][blk]  # [T, kvh]
        deq = cache.data[i][blk, :, off].float() * s[..., None]
        assert (s * E4M3_MAX >= x.abs().amax(-1) * (1 - 1e-6)).all()  # nothing clipped
        bound = 2 * (x.abs() / 16 + s[..., None] * 2.0 ** -10) + 1e-7
        assert ((deq - x).abs() <= bound).all(), ((deq - x).abs() - bound).max()
        assert (deq != x).any()  # really stored in 3 mantissa bits


def test_fp8_kv_cache_logits_against_hf(model_dir):
    """An fp32 model over an fp8 KV cache: a fresh prefill attends to its own unquantized K/V (HF-exact), later
    chunks and decodes read e4m3 K/V (bounded like int8's: 5e-2 relative L2 of the logits, and not fp32's)."""
    path = model_dir("tiny-qwen3")
    ids = torch.randint(1, 4096, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_logits(hf_model(path), ids)
    s = Scorer(path, torch.float32, kv_dtype=torch.float8_e4m3fn)
    assert s.runner.kv_caches[0].data.dtype == torch.float8_e4m3fn
    assert s.runner.model.fused is None and s.runner.model.fused_mixed is None  # the C++ stacks read no fp8
    a = make_req("a", ids)
    (prefill,) = s.run([(a, 60)])
    later = [s.run([(a, 20)])[0], *[s.run([(a, 1)])[0] for _ in range(19)]]
    b = make_req("b", ids[:30])  # a step that mixes a fresh prefill with a decode
    got_b, got_a = s.run([(b, 30), (a, 1)])
    later = torch.cat([*later, got_a])
    assert rel_err(prefill, ref[:60]) < 1e-4 and rel_err(got_b, ref[:30]) < 1e-4
    assert 1e-4 < rel_err(later, ref[60:]) < 5e-2, rel_err(later, ref[60:])


def test_quality_gate_fp8_kv_cache_on_the_demo_model():
    """fp8 KV: held-out loss within +1% of fp32's (int8 KV's gate), every earlier token read from the cache."""
    td = load_train_demo()
    held = td.windows(td.load_stream("heldout"), 128)
    held = held[torch.linspace(0, len(held) - 1, 6).long()]
    q = heldout_quality(Scorer("demo", torch.float32, kv_dtype=torch.float8_e4m3fn), held,
                        reference=Scorer("demo", torch.float32), chunk=1)
    assert q["loss"] <= q["reference_loss"] * 1.01, q
    # argmax agreement over 768 positions (one flip = 0.13%): 0.948 on the pair shipped in session 21 (loss +0.06%),
    # >= 0.95 on the one before
    assert q["agreement"] >= 0.94, q


def test_fp8_through_llm_cli_capacity_and_block_copy(tiny_dir, capsys):
    from tokenmill import LLM, SamplingParams
    from tokenmill.cli import main
    from tokenmill.engine.runner import ModelRunner
    from tokenmill.model.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_dir)
    fp32 = LLM(str(tiny_dir), dtype="float32", kv_cache_bytes="8MiB")
    llm = LLM(str(tiny_dir), dtype="float32", quantization="fp8", kv_cache_dtype="fp8", kv_cache_bytes="8MiB")
    d = llm.engine.describe()
    assert "with fp8 weights (W8A8, emulated)" in d and "KV cache (float8_e4m3fn)" in d
    per_block = ModelRunner.kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn)
    assert per_block == ModelRunner.kv_bytes_per_block(cfg, 16, torch.int8)  # 1 byte per value + the scales
    assert 3.8 < llm.engine.kv_capacity_tokens / fp32.engine.kv_capacity_tokens <= 4
    out = llm.generate(["def f(x):", "import os"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    runner = llm.engine.runner
    tensors = runner.kv_block_tensors()
    assert len(tensors) == 2 * cfg.num_hidden_layers and tensors[0].dtype == torch.float8_e4m3fn
    used = [b for b in range(runner.num_blocks) if tensors[1][:, b].abs().sum() > 0][:3]
    assert used, "generation wrote no block"
    dest = [runner.num_blocks - 1 - i for i in range(len(used))]
    runner.write_blocks(dest, runner.read_blocks(used))  # the byte path the KV tiers use
    for t in tensors:
        assert torch.equal(t[:, dest].view(torch.uint8), t[:, used].view(torch.uint8))
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "x = 1", "--max-tokens", "3",
                 "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--kv-cache-bytes", "8MiB"]) == 0
    with pytest.raises(TokenmillError, match="unknown kv_cache_dtype 'fp8_e5m2'"):
        LLM(str(tiny_dir), kv_cache_dtype="fp8_e5m2")


def test_fp8_refused_on_cuda_below_sm89_and_on_a_prequantized_checkpoint(monkeypatch):
    from tokenmill.model import loader

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ModelLoadError, match=r"needs fp8 tensor cores .*A100-SXM4-80GB is sm80"):
        loader.check_fp8(torch.device("cuda"))

    class Cfg:
        quantization = "compressed-tensors-w8a8"

    with pytest.raises(ModelLoadError, match="cannot apply to a checkpoint already quantized"):
        loader.load_model(None, Cfg(), torch.device("cpu"), torch.float32, 64, quantization="fp8")


@pytest.mark.parametrize("cap, want", [((7, 5), []), ((8, 0), ["bf16"]), ((8, 6), ["bf16"]), ((8, 9), ["bf16", "fp8"]),
                                       ((9, 0), ["bf16", "fp8"]), ((10, 0), ["bf16", "fp8", "fp4"]),
                                       ((12, 0), ["bf16", "fp8", "fp4"])])
def test_cuda_compute_capability_to_native_precisions(cap, want):
    c = Capabilities("cpu", ("avx2",), None, "GPU", cap)
    assert c.cuda_precisions() == want
    assert c.to_json()["cuda_fp8"] == ("fp8" in want) and c.to_json()["cuda_fp4"] == ("fp4" in want)
    assert f"sm{cap[0]}{cap[1]} ({' '.join(want) or 'fp16 only'} native)" in c.summary()
