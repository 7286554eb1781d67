"""Run the engine's CUDA code path on a machine without a GPU: every tensor op of the model checked, none computed.

    with fake_cuda(capability=(9, 0)) as fc:
        llm = LLM("demo", device="cuda", dtype="bfloat16", quantization="fp8")
        llm.generate(...)          # tokens are placeholders; what is checked is that every op could run
        fc.executed                # model steps that went through the fake device

PyTorch's FakeTensorMode runs each op's meta kernel: shapes, dtypes and **devices** are propagated and
checked exactly as on the device (a CPU index into a CUDA tensor, an fp32 scale beside a bf16 matmul, an
fp8 GEMM whose dims are not multiples of 16: each raises here as it would on a GPU), but no value exists.
So only the places that hold device tensors run under the mode — the model load, the runner (and a draft
model's runner) — and their outputs are handed back to the engine as real CPU placeholders (logits that
favour token `token`, greedy tokens = `token`), so the scheduler, the KV manager, speculation and the
sampler run for real around them. A value read back on the host inside the model (`.item()`, `.tolist()`,
a Python `if` on a tensor, an op whose output size depends on values such as torch.unique) raises
`DeviceReadBack`: on a GPU each is a device synchronisation inside the step. A CPU-only PyTorch has no CUDA
device guard, which its Python bindings take for indexing and SDPA: a do-nothing one for cuda:0 is built with
g++ (~2 s, once: csrc/fake_cuda_guard.cpp) and loaded into the process.

What this cannot find: numerical errors, kernels that exist for the meta device but not for CUDA, CUDA
runtime errors (memory, launch limits) and speed. It is the check a CPU-only session can give the CUDA path
before a device is lent (benchmarks/gpu_precision.py --fake-cuda runs the prepared GPU script this way).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch


class DeviceReadBack(RuntimeError):
    """A step read a value back from the device (a data-dependent size or a Python decision on a tensor):
    on a GPU a synchronisation inside the step; under the fake device it cannot run at all."""


@dataclass
class FakeCudaRun:
    capability: tuple[int, int]
    name: str
    token: int
    executed: int = 0  # runner steps (target and draft) that ran on the fake device
    outputs: list = field(default_factory=list)  # (dtype, device, shape) of each step's logits / tokens

    def _record(self, t: torch.Tensor) -> None:
        if t.numel() and len(self.outputs) < 10_000:  # (a step with no logits returns an empty CPU tensor)
            self.outputs.append((t.dtype, t.device.type, tuple(t.shape)))


def _real(t: torch.Tensor, token: int, vocab: int) -> torch.Tensor:
    """A real CPU placeholder for a fake output: logits peaked at `token`, or int64 tokens equal to it."""
    if t.dtype in (torch.int64, torch.int32):
        return torch.full(tuple(t.shape), token, dtype=t.dtype)
    out = torch.zeros(tuple(t.shape), dtype=t.dtype)
    if out.dim() == 2 and out.shape[1] == vocab and out.shape[0]:
        out[:, token] = 10.0
    return out


_GUARD_SRC = Path(__file__).parent / "csrc" / "fake_cuda_guard.cpp"


@functools.lru_cache(maxsize=1)
def _load_device_guard() -> None:
    """A CPU-only PyTorch has no CUDA device guard, and its Python bindings take one for indexing, SDPA and
    more: a fake CUDA tensor fails there ("PyTorch is not linked with support for cuda devices") where a
    real one would not. Build (once per torch version and source, ~2 s with g++) and load a do-nothing guard
    for device cuda:0. A PyTorch built with CUDA has its own: nothing is loaded."""
    if torch.backends.cuda.is_built():
        return
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile

    src = _GUARD_SRC.read_bytes()
    key = hashlib.sha256(src + torch.__version__.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(tempfile.gettempdir()) / "torch_extensions")
    so = root / f"tokenmill_fake_cuda_guard_{key}.so"
    if not so.exists():
        root.mkdir(parents=True, exist_ok=True)
        tdir = Path(torch.__file__).parent
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cmd = [os.environ.get("CXX", "g++"), "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{tdir / 'include'}",
               str(_GUARD_SRC), f"-L{tdir / 'lib'}", "-lc10", f"-Wl,-rpath,{tdir / 'lib'}", "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"building the fake CUDA device guard failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
        os.replace(tmp, so)
    ctypes.CDLL(str(so))


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H200 (fake)", token: int = 7):
    """Pretend a CUDA device of `capability` exists; run the model parts under FakeTensorMode (see module doc)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tokenmill.engine import llm_engine, runner as runner_mod
    from tokenmill.hardware import capabilities
    from tokenmill.model import loader

    _load_device_guard()
    run = FakeCudaRun(tuple(capability), name, token)
    class _Mode(FakeTensorMode):
        @property
        def avoid_device_init(self) -> bool:  # torch.cuda.is_available() is patched to True below: the real one
            return True

    mode = _Mode(allow_non_fake_inputs=True)

    def under_mode(fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            with mode:
                return fn(*a, **kw)
        return wrapped

    class _RealFiles:  # safetensors builds real tensors from file storage: outside the mode, copied in after
        def __init__(self, *a, **kw):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            self._unset = unset_fake_temporarily
            with self._unset():
                self._f = orig_safe_open(*a, **kw)

        def __enter__(self):
            with self._unset():
                self._f.__enter__()
            return self

        def __exit__(self, *exc):
            with self._unset():
                return self._f.__exit__(*exc)

        def get_tensor(self, name):
            with self._unset():
                t = self._f.get_tensor(name)
            return mode.from_tensor(t)  # its fake twin (shape, dtype, CPU), as the loader would hold it

        def __getattr__(self, attr):
            return getattr(self._f, attr)

    import safetensors

    def module_to(self, *args, **kwargs):
        """nn.Module.to for fake parameters: Module._apply swaps a FakeTensor parameter in place
        (torch.utils.swap_tensors), which the fake mode's own weak references forbid; put the converted
        parameters and buffers in instead (tied parameters stay tied), as Module.to's result would hold."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        done: dict[int, torch.nn.Parameter] = {}
        with mode:
            for m in self.modules():
                for k, p in m._parameters.items():
                    if p is not None:
                        if id(p) not in done:
                            t = p.to(device=device, dtype=dtype if dtype is not None and p.is_floating_point() else None,
                                     non_blocking=non_blocking)
                            done[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
                        m._parameters[k] = done[id(p)]
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = b.to(device=device, dtype=dtype if dtype is not None and b.is_floating_point()
                                             else None, non_blocking=non_blocking)
        return self

    orig_safe_open = safetensors.safe_open
    orig_execute = runner_mod.ModelRunner.execute

    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    def execute(self, sched, *a, **kw):
        try:
            with mode:
                out = orig_execute(self, sched, *a, **kw)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise DeviceReadBack(f"the step reads a value back from the device ({type(e).__name__}: {e}): a GPU "
                                 f"synchronisation inside the step") from e
        run.executed += 1
        vocab = self.cfg.vocab_size
        run._record(out.logits)
        logits = _real(out.logits, token, vocab)
        tokens = None
        if out.tokens is not None:
            run._record(out.tokens)
            tokens = _real(out.tokens, token, vocab)
        return runner_mod.ModelOutput(logits, out.logit_offsets, tokens)

    patches = [
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.get_device_capability", lambda device=None: run.capability),
        mock.patch("torch.cuda.get_device_name", lambda device=None: run.name),
        mock.patch("torch.cuda.synchronize", lambda device=None: None),
        mock.patch.object(safetensors, "safe_open", _RealFiles),
        mock.patch.object(torch.nn.Module, "to", module_to),
        mock.patch.object(loader, "load_model", under_mode(loader.load_model)),
        mock.patch.object(llm_engine, "load_model", under_mode(llm_engine.load_model)),
        mock.patch.object(runner_mod.ModelRunner, "__init__", under_mode(runner_mod.ModelRunner.__init__)),
        mock.patch.object(runner_mod.ModelRunner, "execute", execute),
    ]
    orig_read_blocks = runner_mod.ModelRunner.read_blocks

    def read_blocks(self, block_ids):
        """The KV tiers' copy to host memory: checked on the fake device, handed on as real zero bytes."""
        with mode:
            out = orig_read_blocks(self, block_ids)
        if out.device.type != "cpu":
            raise AssertionError(f"read_blocks returned a {out.device} tensor: the tiers need host bytes")
        return torch.zeros(tuple(out.shape), dtype=out.dtype)

    patches.append(mock.patch.object(runner_mod.ModelRunner, "read_blocks", read_blocks))
    from tokenmill.engine import graphs as graphs_mod

    orig_graphs_init = graphs_mod.DecodeGraphs.__init__

    def graphs_init(self, runner, max_batch, max_model_len, capture="cuda"):
        """--cuda-graphs on the fake device: the same static buffers, padding and buckets, replayed eagerly (a
        capture needs a GPU)."""
        with mode:
            orig_graphs_init(self, runner, max_batch, max_model_len, "eager")

    patches.append(mock.patch.object(graphs_mod.DecodeGraphs, "__init__", graphs_init))
    for name_ in ("read_kv_blocks", "write_kv_blocks", "write_blocks"):
        patches.append(mock.patch.object(runner_mod.ModelRunner, name_,
                                         under_mode(getattr(runner_mod.ModelRunner, name_))))
    capabilities.cache_clear()
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        try:
            yield run
        finally:
            capabilities.cache_clear()
