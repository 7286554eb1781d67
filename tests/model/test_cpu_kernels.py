"""The fused CPU ops against their PyTorch definitions (odd sizes exercise the scalar tails)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.cpu_kernels import get_kernels
from tokenmill.model.config import RopeConfig
from tokenmill.model.layers import RotaryEmbedding, _rotate

kernels = get_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ toolchain: the PyTorch paths are used")


@pytest.mark.parametrize("dim", [64, 36, 5])
def test_rms_norm_with_and_without_residual(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(33, dim, generator=g) * 3
    res = torch.randn(33, dim, generator=g)
    w = torch.rand(dim, generator=g) + 0.5

    def ref(v):
        return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6))

    out = torch.empty_like(x)
    kernels.rms_norm(out, x, None, w, 1e-6)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    x2 = x.clone()
    kernels.rms_norm(out, x2, res, w, 1e-6)
    torch.testing.assert_close(x2, x + res)  # the residual stream is updated in place
    torch.testing.assert_close(out, ref(x + res), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inter", [1408, 20])
def test_silu_mul(inter):
    gu = torch.randn(17, 2 * inter, generator=torch.Generator().manual_seed(1)) * 4
    out = torch.empty(17, inter)
    kernels.silu_mul(out, gu)
    gate, up = gu.split(inter, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hd", [64, 36])
def test_rope_in_place_on_strided_views(hd):
    rope = RotaryEmbedding(hd, 512, RopeConfig())
    t, nh, nkv = 9, 4, 2
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=torch.Generator().manual_seed(2))
    q, k, _ = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k = q.view(t, nh, hd), k.view(t, nkv, hd)
    pos = torch.tensor([0, 1, 2, 100, 101, 7, 511, 300, 3])
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    kernels.rope_inplace(q, pos, rope.cos, rope.sin)
    kernels.rope_inplace(k, pos, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.rope_inplace(q, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 512]), rope.cos, rope.sin)


def test_write_kv_matches_the_indexing_definition():
    from tokenmill.model.attention import write_kv

    g = torch.Generator().manual_seed(3)
    cache = torch.zeros(2, 6, 2, 4, 8)
    kv = torch.randn(5, 3 * 2 * 8, generator=g)  # strided views, as the model passes them
    k, v = kv[:, 16:32].view(5, 2, 8), kv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([0, 5, 6, 23, 12])
    want = cache.clone()
    write_kv(want, k, v, slots)
    kernels.write_kv(cache[0], cache[1], k, v, slots)
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_kv(cache[0], cache[1], k, v, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("k", [512, 36])
def test_linear_small_rows(k):
    g = torch.Generator().manual_seed(k)
    w, b = torch.randn(300, k, generator=g), torch.randn(300, generator=g)
    for m in range(1, 9):
        x = torch.randn(m, k, generator=g)
        out = torch.empty(m, 300)
        kernels.linear_small(out, x, w, b)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        kernels.linear_small(out, x, w, None)
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="shapes"):
        kernels.linear_small(torch.empty(9, 300), torch.randn(9, k), w, None)


def test_kernel_builds_are_keyed_by_source_text_not_checkout_path(tmp_path):
    """Two checkouts (git worktrees, a CI clone) with the same C++ sources share one build folder; any edit to a
    source or header gives a new one, and the copies hold exactly the checkout's text."""
    import shutil

    from tokenmill.model import cpu_kernels

    here = Path(cpu_kernels.__file__).parent / "csrc"
    a, b = tmp_path / "a" / "csrc", tmp_path / "b" / "csrc"
    shutil.copytree(here, a)
    shutil.copytree(here, b)
    out = tmp_path / "cache"
    srcs_a = cpu_kernels._content_addressed_sources(a, out)
    srcs_b = cpu_kernels._content_addressed_sources(b, out)
    assert srcs_a == srcs_b and len({s.parent for s in srcs_a}) == 1
    assert [s.read_bytes() for s in srcs_a] == [(here / s.name).read_bytes() for s in srcs_a]
    header = b / cpu_kernels.HEADERS[0]
    header.write_bytes(header.read_bytes() + b"\n// edited\n")
    srcs_c = cpu_kernels._content_addressed_sources(b, out)
    assert srcs_c[0].parent != srcs_a[0].parent
    assert (srcs_c[0].parent / cpu_kernels.HEADERS[0]).read_bytes() == header.read_bytes()


def test_a_build_that_takes_long_is_announced_and_a_fast_load_is_not(tmp_path, monkeypatch, caplog):
    """A first use that compiles (minutes) says so on the log; loading an existing build says nothing."""
    import logging
    import time

    import torch.utils.cpp_extension as ext

    from tokenmill.model import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "BUILD_NOTICE_S", 0.05)
    for delay, announced in ((0.5, True), (0.0, False)):
        monkeypatch.setattr(ext, "load", lambda *a, _d=delay, **k: time.sleep(_d) or "module")
        monkeypatch.setitem(cpu_kernels._state, "mod", None)
        del cpu_kernels._state["mod"]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.log.name):
            assert cpu_kernels.get_kernels() == "module"
            time.sleep(0.1)  # a timer that was not cancelled would fire here
        said = any("compiling tokenmill's CPU kernels" in r.getMessage() for r in caplog.records)
        assert said is announced, (delay, [r.getMessage() for r in caplog.records])
