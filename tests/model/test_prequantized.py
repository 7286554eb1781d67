"""Pre-quantized checkpoints: compressed-tensors int8 W8A8 (as vLLM reads it) loads straight into the int8 linear
method; every other quantization_config is refused by key and value.

The checkpoint is written by hand here (weights quantized per output channel with our own code, saved with
safetensors + config.json), so the test does not depend on llm-compressor. Its reference: the same float model
loaded with `--quantization int8`, which quantizes the same way at load time, so logits must be equal.
"""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.parity import make_req
from tokenmill.engine.scoring import Scorer
from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig

W8A8 = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "global_compression_ratio": 1.5, "version": "0.9.0", "kv_cache_scheme": None, "sparsity_config": None,
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                    "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
                              "observer": "memoryless", "observer_kwargs": {}},
    }},
}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _rewrite_projections(src, dst, quantize, qc):
    """A copy of the float checkpoint `src` with each projection's weight replaced by `quantize(w)` -> (stored
    weight, weight_scale), and `qc` as its quantization_config."""
    shutil.copytree(src, dst)
    (f,) = list(dst.glob("*.safetensors"))
    out = {}
    for name, t in load_file(str(f)).items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            out[name], out[name[:-len("weight")] + "weight_scale"] = quantize(t.float())
        else:
            out[name] = t
    save_file(out, str(f))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def write_w8a8(src, dst, scale_shape="N1", qc=W8A8):
    """A compressed-tensors int8 W8A8 copy of the float checkpoint `src`: each projection's weight as int8
    [N, K] (symmetric, per output channel, scale = max|w_n| / 127) plus its fp32 weight_scale."""
    def quantize(w):
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q, scale[:, None] if scale_shape == "N1" else scale

    return _rewrite_projections(src, dst, quantize, qc)


@pytest.mark.parametrize("preset, scale_shape", [("tiny", "N1"), ("tiny-qwen2", "N")])  # qwen2: qkv bias
def test_w8a8_checkpoint_loads_int8_and_matches_load_time_quantization(model_dir, tmp_path, preset, scale_shape):
    src = model_dir(preset)
    dst = write_w8a8(src, tmp_path / "w8a8", scale_shape)
    assert ModelConfig.from_dir(dst).quantization == "compressed-tensors-w8a8"
    pre = Scorer(dst, torch.float32)
    lin = pre.runner.model.layers[0].self_attn.qkv_proj
    assert lin.weight.numel() == 0 and lin.w8.dtype == torch.int8  # int8 storage, no float copy
    ckpt = load_file(str(next(dst.glob("*.safetensors"))))
    assert torch.equal(lin.w8[:lin.shard_range("k")[0]], ckpt["model.layers.0.self_attn.q_proj.weight"])
    ref = Scorer(src, torch.float32, quantization="int8")
    plain = Scorer(src, torch.float32)
    ids = torch.randint(1, 4096, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b, c = make_req("a", ids), make_req("b", ids), make_req("c", ids)
    got = torch.cat([pre.run([(a, 30)])[0], *[pre.run([(a, 1)])[0] for _ in range(10)]])  # W8A8 GEMM + small kernel
    want = torch.cat([ref.run([(b, 30)])[0], *[ref.run([(b, 1)])[0] for _ in range(10)]])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    fp = torch.cat([plain.run([(c, 30)])[0], *[plain.run([(c, 1)])[0] for _ in range(10)]])
    assert (got - fp).abs().max() > 1e-4  # and it really is the quantized model


def test_w8a8_checkpoint_through_llm_in_bf16(model_dir, tmp_path):
    from tokenmill import LLM, SamplingParams

    dst = write_w8a8(model_dir("tiny"), tmp_path / "w8a8")
    llm = LLM(str(dst), dtype="bfloat16", kv_cache_bytes="8MiB")
    assert "pre-quantized checkpoint" in llm.engine.describe()
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def _with(path, value):
    qc = copy.deepcopy(W8A8)
    *parents, last = path.split(".")
    d = qc
    for p in parents:
        d = d[p]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value
    return qc


G = "config_groups.group_0"


@pytest.mark.parametrize("path, value, match", [
    ("quant_method", "awq", "quant_method='awq'"),
    ("quant_method", "fp8", "quant_method='fp8'"),
    ("format", "float-quantized", "weights.type='int'"),  # fp8's format with int8's value types
    (f"{G}.format", "float-quantized", "group_0.format='float-quantized'"),
    ("format", "pack-quantized", "format='pack-quantized'"),
    ("quantization_status", "frozen", "quantization_status='frozen'"),
    ("kv_cache_scheme", {"num_bits": 8, "type": "float", "strategy": "tensor"}, "kv_cache_scheme="),
    ("sparsity_config", {"format": "sparse-bitmask"}, "sparsity_config="),
    ("ignore", ["lm_head", "model.layers.0.mlp.down_proj"], "ignore="),
    ("calibration_magic", 3, "calibration_magic=3 is not supported \\(unknown key\\)"),
    (f"{G}.targets", ["re:.*mlp.*"], "targets="),
    (f"{G}.format", "naive-quantized", "group_0.format='naive-quantized'"),
    (f"{G}.weights.strategy", "group", "weights.strategy='group'"),
    (f"{G}.weights.strategy", "tensor", "weights.strategy='tensor'"),
    (f"{G}.weights.group_size", 128, "weights.group_size=128"),
    (f"{G}.weights.block_structure", [128, 128], "weights.block_structure=\\[128, 128\\]"),
    (f"{G}.weights.symmetric", False, "weights.symmetric=False"),
    (f"{G}.weights.num_bits", 4, "weights.num_bits=4"),
    (f"{G}.weights.type", "float", "weights.type='float'"),
    (f"{G}.weights.actorder", "group", "weights.actorder='group'"),
    (f"{G}.input_activations.dynamic", False, "input_activations.dynamic=False"),
    (f"{G}.input_activations.strategy", "tensor", "input_activations.strategy='tensor'"),
    (f"{G}.input_activations.symmetric", False, "input_activations.symmetric=False"),
    (f"{G}.input_activations", None, "input_activations=None"),  # weight-only int8
    (f"{G}.output_activations", {"num_bits": 8}, "output_activations="),
    (f"{G}.weights.zp_dtype", "int8", "weights.zp_dtype='int8'"),
])
def test_every_other_quantization_config_is_refused_by_key_and_value(path, value, match):
    """(also for the fp8 format: FP8 below)"""
    from tests.model.test_hf_config import base

    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(base(quantization_config=_with(path, value)))


def test_two_config_groups_and_bad_tensors_are_refused(model_dir, tmp_path):
    from tests.model.test_hf_config import base

    qc = copy.deepcopy(W8A8)
    qc["config_groups"]["group_1"] = copy.deepcopy(qc["config_groups"]["group_0"])
    with pytest.raises(ModelLoadError, match="config_groups=.*exactly one group"):
        ModelConfig.from_dict(base(quantization_config=qc))
    src = model_dir("tiny")
    dst = write_w8a8(src, tmp_path / "w8a8")
    f = next(dst.glob("*.safetensors"))
    t = load_file(str(f))
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({**t, name: t[name].float()}, str(f))  # a float weight where int8 is declared
    with pytest.raises(ModelLoadError, match=f"{name} is torch.float32, expected torch.int8"):
        Scorer(dst, torch.float32)
    save_file({k: v for k, v in t.items() if k != "model.layers.1.mlp.down_proj.weight_scale"}, str(f))
    with pytest.raises(ModelLoadError, match="missing tensor.*down_proj\\[all\\].weight_scale"):
        Scorer(dst, torch.float32)
    with pytest.raises(ModelLoadError, match="unexpected tensor.*weight_scale"):  # scales without the config
        shutil.copy(next(src.glob("*.safetensors")), tmp_path / "x.safetensors")
        save_file({**load_file(str(tmp_path / "x.safetensors")),
                   "model.layers.0.mlp.down_proj.weight_scale": torch.ones(1)}, str(tmp_path / "x.safetensors"))
        plain = tmp_path / "plain"
        shutil.copytree(src, plain)
        shutil.copy(tmp_path / "x.safetensors", next(plain.glob("*.safetensors")))
        Scorer(plain, torch.float32)


FP8 = {**copy.deepcopy(W8A8), "format": "float-quantized"}
for _k in ("weights", "input_activations"):
    FP8["config_groups"]["group_0"][_k]["type"] = "float"


def write_fp8(src, dst):
    """llm-compressor's FP8_DYNAMIC layout, by hand: each projection's weight as float8_e4m3fn [N, K] (symmetric, per
    output channel, scale = max|w_n| / 448) plus its weight_scale [N, 1]."""
    def quantize(w):
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.to(torch.bfloat16).float()  # bf16-stored

    return _rewrite_projections(src, dst, quantize, FP8)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_fp8_checkpoint_loads_fp8_and_runs_as_its_dequantized_weights(model_dir, tmp_path, preset):
    """The fp8 checkpoint's own values and scales are used (not re-quantized): its logits equal those of a float
    model holding exactly w_fp8 * scale, under `--quantization fp8` (whose load-time quantization of such a weight
    gives back the same e4m3 values: each row's max is 448 x its scale)."""
    from tokenmill import LLM, SamplingParams

    src = model_dir(preset)
    dst = write_fp8(src, tmp_path / "fp8")
    assert ModelConfig.from_dir(dst).quantization == "compressed-tensors-w8a8-fp8"
    pre = Scorer(dst, torch.float32)
    lin = pre.runner.model.layers[0].self_attn.qkv_proj
    ckpt = load_file(str(next(dst.glob("*.safetensors"))))
    assert lin.weight.numel() == 0 and lin.w_fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(lin.w_fp8[:lin.shard_range("k")[0]].view(torch.uint8),
                       ckpt["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))
    # the reference: the float model with the checkpoint's dequantized weights, quantized again at load time
    deq = tmp_path / "deq"
    shutil.copytree(src, deq)
    (f,) = list(deq.glob("*.safetensors"))
    save_file({k: (ckpt[k].float() * ckpt[k[:-len("weight")] + "weight_scale"]) if k[:-len("weight")] + "weight_scale"
               in ckpt else v for k, v in load_file(str(f)).items()}, str(f))
    ref = Scorer(deq, torch.float32, quantization="fp8")
    plain = Scorer(src, torch.float32)
    ids = torch.randint(1, 4096, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b, c = make_req("a", ids), make_req("b", ids), make_req("c", ids)
    got = torch.cat([pre.run([(a, 30)])[0], *[pre.run([(a, 1)])[0] for _ in range(5)]])
    want = torch.cat([ref.run([(b, 30)])[0], *[ref.run([(b, 1)])[0] for _ in range(5)]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fp = torch.cat([plain.run([(c, 30)])[0], *[plain.run([(c, 1)])[0] for _ in range(5)]])
    assert (got - fp).abs().max() > 1e-4  # and it really is the quantized model
    llm = LLM(str(dst), kv_cache_bytes="8MiB")
    assert "with fp8 weights (W8A8, pre-quantized checkpoint)" in llm.engine.describe()
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ModelLoadError, match="quantization='int8' cannot apply to a checkpoint already quantized"):
        Scorer(dst, torch.float32, quantization="int8")


def test_fp8_checkpoint_with_an_int8_tensor_is_refused(model_dir, tmp_path):
    dst = write_fp8(model_dir("tiny"), tmp_path / "fp8")
    f = next(dst.glob("*.safetensors"))
    t = load_file(str(f))
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({**t, name: t[name].float().clamp(-127, 127).to(torch.int8)}, str(f))
    with pytest.raises(ModelLoadError, match=f"{name} is torch.int8, expected torch.float8_e4m3fn"):
        Scorer(dst, torch.float32)
