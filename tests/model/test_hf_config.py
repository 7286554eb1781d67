"""Checkpoints as today's transformers writes them (v5 `rope_parameters`) and as v4 wrote them
(`rope_theta` + `rope_scaling`) load exactly as HF computes them; config keys that change the math and are
not implemented are refused by name."""

import json
import shutil

import pytest
import torch

from tests.parity import Harness, hf_logits, hf_model, make_req, rel_err
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig, RopeConfig
from tokenmill.model.tokenizer import SHIPPED_TOKENIZER_DIR

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name -> (transformers config class, its kwargs as a v5 user passes them)
CASES = {
    "llama-llama3": ("LlamaConfig", dict(rope_parameters=dict(LLAMA3))),
    "llama-bias": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 123456.0},
                                       attention_bias=True, mlp_bias=True)),
    "qwen3": ("Qwen3Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, head_dim=48)),
    "qwen3-bias-window": ("Qwen3Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                              attention_bias=True, use_sliding_window=True, sliding_window=24,
                                              max_window_layers=0)),
    "qwen2-linear": ("Qwen2Config", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0})),
    "mistral-window": ("MistralConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                             sliding_window=24)),
}


def save_hf(out, cls_name, seed=0, **kw):
    """A random model saved by the installed transformers, every parameter (biases, norms) non-trivial."""
    cfg = getattr(transformers, cls_name)(**SHAPE, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SHIPPED_TOKENIZER_DIR / f, out / f)
    return out


def to_v4_spelling(src, dst):
    """The same checkpoint with RoPE written the transformers 4.x way: top-level rope_theta + rope_scaling."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    raw["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            cls_name, kw = CASES[case]
            v5 = save_hf(tmp_path_factory.mktemp(case), cls_name, **kw)
            cache[case] = (v5, to_v4_spelling(v5, tmp_path_factory.mktemp(case + "-v4") / "m"))
        return cache[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_both_spellings_match_hf_logits(saved, case):
    v5, v4 = saved(case)
    assert ModelConfig.from_dir(v5).rope == ModelConfig.from_dir(v4).rope
    ids = torch.randint(1, 4096, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    for path in (v5, v4):
        ref = hf_logits(hf_model(path), ids)
        h = Harness(path)
        a = make_req("a", ids)
        (prefill,) = h.run([(a, 80)])
        decodes = [h.run([(a, 1)])[0] for _ in range(20)]
        assert rel_err(prefill, ref[:80]) < 1e-4, path
        assert rel_err(torch.cat(decodes), ref[80:]) < 1e-4, path


def test_v5_checkpoint_greedy_tokens_match_hf_generate(saved):
    v5, _ = saved("llama-llama3")
    raw = json.loads((v5 / "config.json").read_text())
    assert "rope_parameters" in raw and raw["rope_parameters"]["rope_theta"] == 500000.0
    hf = hf_model(v5)
    llm = LLM(str(v5), kv_cache_bytes="16MiB", dtype="float32")
    prompt = torch.randint(1, 4096, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out[0].outputs[0].token_ids == ref


def base(**kw):
    raw = {"architectures": ["LlamaForCausalLM"], **SHAPE}
    raw.update(kw)
    return raw


def test_rope_spellings_read_alike():
    v4 = ModelConfig.from_dict(base(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}))
    v5 = ModelConfig.from_dict(base(rope_parameters=dict(LLAMA3)))
    assert v4.rope == v5.rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 64)
    # both spellings at once (transformers 4.5x wrote both): the dict's theta wins, as in transformers
    both = ModelConfig.from_dict(base(rope_theta=10000.0, rope_scaling=None,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert both.rope == RopeConfig(1e6)
    assert ModelConfig.from_dict(base()).rope == RopeConfig(10000.0)  # nothing written: transformers' default
    assert ModelConfig.from_dict(base(rope_theta=2e5)).rope == RopeConfig(2e5)
    # llama3 without original_max_position_embeddings: transformers uses max_position_embeddings
    no_orig = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert ModelConfig.from_dict(base(rope_parameters=no_orig)).rope.original_max_position_embeddings == 4096


def test_rope_per_layer_type_form():
    qwen = dict(architectures=["Qwen3ForCausalLM"], layer_types=["full_attention"] * 3)
    same = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # unused type: ignored
    assert ModelConfig.from_dict(base(**qwen, rope_parameters=same)).rope == RopeConfig(1e6)
    mixed = dict(qwen, layer_types=["full_attention", "sliding_attention", "full_attention"],
                 use_sliding_window=True, sliding_window=None)  # no window: every layer attends to all
    with pytest.raises(ModelLoadError, match="differs per layer type"):
        ModelConfig.from_dict(base(**mixed, rope_parameters=same))


def test_architecture_defaults_are_transformers_defaults():
    qwen3 = ModelConfig.from_dict(base(architectures=["Qwen3ForCausalLM"]))
    assert qwen3.head_dim == 128 and qwen3.sliding_window is None
    mistral = ModelConfig.from_dict({**base(architectures=["MistralForCausalLM"]), "max_position_embeddings": 8192})
    assert mistral.sliding_window == 4096  # absent: Mistral's default window; explicit null: none
    assert ModelConfig.from_dict(base(architectures=["MistralForCausalLM"], sliding_window=None)).sliding_window is None
    # a Llama ignores sliding_window, as transformers' Llama does
    assert ModelConfig.from_dict(base(sliding_window=16)).sliding_window is None
    # Qwen: the window applies only with use_sliding_window, on the layers from max_window_layers on
    q = dict(architectures=["Qwen2ForCausalLM"], sliding_window=32)
    assert ModelConfig.from_dict(base(**q)).sliding_window is None
    assert ModelConfig.from_dict(base(**q, use_sliding_window=True, max_window_layers=0)).sliding_window == 32
    assert ModelConfig.from_dict(base(model_type="qwen3", architectures=None)).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize("raw, match", [
    (base(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope_type 'yarn'"),
    (base(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
    (base(rope_parameters={**LLAMA3, "mscale": 1.0}), r"\['mscale'\] not understood"),
    (base(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}), r"\['factor'\]"),
    (base(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), r"lacks \['factor'\]"),
    (base(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (base(hidden_act="gelu"), "'hidden_act' 'gelu'"),
    (base(quantization_config={"quant_method": "awq"}), "quantization_config.*awq"),
    (base(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64, max_window_layers=2),
     "mixes full_attention and sliding_attention"),
    (base(architectures=["Qwen3ForCausalLM"], layer_types=["full_attention"] * 2), "one type per layer"),
    (base(architectures=["Qwen3ForCausalLM"], layer_types=["chunked_attention"] * 3), "chunked_attention"),
])
def test_config_keys_that_change_the_math_are_refused_by_name(raw, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(raw)


def test_mixed_sliding_layout_saved_by_transformers_is_refused(tmp_path):
    path = save_hf(tmp_path / "m", "Qwen2Config", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ModelLoadError, match="per-layer sliding windows are not implemented"):
        LLM(str(path))
