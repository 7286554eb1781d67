"""Model directories: errors that name the problem, sharded checkpoints, deterministic `model make`."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill.cli import main
from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import load_model
from tokenmill.model.make import make_model


def load(path):
    cfg = ModelConfig.from_dir(path)
    return load_model(path, cfg, torch.device("cpu"), torch.float32, 256)


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_make_is_deterministic_and_seeded(tmp_path):
    a = make_model("tiny", tmp_path / "a", seed=3)
    b = make_model("tiny", tmp_path / "b", seed=3)
    c = make_model("tiny", tmp_path / "c", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / f).is_file()


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    single = make_model("tiny", tmp_path / "single", seed=0)
    sharded = make_model("tiny", tmp_path / "sharded", seed=0, max_shard_bytes=1 << 20)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = load(single), load(sharded)
    for (n1, p1), (n2, p2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_unsupported_architecture_named(tiny_dir, tmp_path):
    d = copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        ModelConfig.from_dir(d)


def test_missing_tensor_named(tiny_dir, tmp_path):
    d = copy(tiny_dir, tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor.*layers\.1\.mlp\.gate_up_proj\[up\]"):
        load(d)


def test_mismatched_and_unexpected_tensor_named(tiny_dir, tmp_path):
    d = copy(tiny_dir, tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(3, 3\)"):
        load(d)
    sd = load_file(str(tiny_dir / "model.safetensors"))
    sd["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor.*model\.layers\.0\.extra\.weight"):
        load(d)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["model", "make", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and "Traceback" not in err
