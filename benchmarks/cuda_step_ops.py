"""How many device ops one engine step dispatches on the CUDA path, counted without a GPU.

    python benchmarks/cuda_step_ops.py                                   # preset small, bf16 and fp8, batch 1 and 8
    python benchmarks/cuda_step_ops.py --preset llama-3.1-8b --layers 2 --batch 1

The engine runs on the fake CUDA device (tokenmill/testing/fake_cuda.py) and every aten op of each runner step
is counted by a TorchDispatchMode, split into ops that write device memory (a kernel launch on a GPU: new
outputs and in-place writes) and the rest (views, reshapes, `.device` queries: CPU work only). Per layer and per
step for the model's layer count, and for a 32-layer model of the same shape (ops per layer do not depend on the
widths). This is the input to a launch-bound estimate: in eager PyTorch every op costs CPU time before the GPU
sees it, and at batch 1 an 8B model's step reads its 16 GB of bf16 weights in ~3.3 ms on an H200 (4.8 TB/s).
Nothing here is timed; the per-op CPU cost is not measured on this machine.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (default: the preset's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decoding sequences per step")
    ap.add_argument("--configs", default="bf16,fp8,fp8+fp8kv")
    ap.add_argument("--model-dir", default=None, help="made here if missing (default: a temporary directory)")
    args = ap.parse_args(argv)

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tokenmill.engine import runner as runner_mod
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.model.make import make_model
    from tokenmill.testing.fake_cuda import fake_cuda

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func] += 1
            return func(*args, **(kwargs or {}))

    def writes_memory(func) -> bool:
        if not isinstance(func, torch._ops.OpOverload) or func.namespace == "prim":
            return False
        rets = func._schema.returns
        return not any(r.alias_info is not None and not r.alias_info.is_write for r in rets)

    mdir = Path(args.model_dir or tempfile.mkdtemp(prefix="cuda_step_ops_"))
    if not (mdir / "config.json").exists():
        make_model(args.preset, mdir, dtype="bfloat16",
                   overrides={"num_hidden_layers": args.layers} if args.layers else None)
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}; the CUDA device is fake (tokenmill/testing/fake_cuda.py, sm90); "
          f"torch {torch.__version__}")
    print("| config | decoding seqs | layers | aten ops / step | of which write device memory (launches) | "
          "launches / layer | launches / step at 32 layers |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.configs.split(","):
        quant = "fp8" if name.startswith("fp8") else "none"
        kv = "fp8" if name.endswith("fp8kv") else "auto"
        for n in args.batch:
            with fake_cuda():
                llm = LLM(str(mdir), device="cuda", dtype="bfloat16", quantization=quant, kv_cache_dtype=kv,
                          enable_prefix_caching=False)
                layers = llm.engine.model_config.num_hidden_layers
                prompts = [[5 + i] * 32 for i in range(n)]
                counted = []
                patched = runner_mod.ModelRunner.execute  # fake_cuda's wrapper

                def execute(self, sched, *a, **kw):
                    c = Count()
                    with c:
                        out = patched(self, sched, *a, **kw)
                    if len(sched.seqs) == n and all(len(s.token_ids) == 1 for s in sched.seqs):
                        counted.append(c.ops)
                    return out

                runner_mod.ModelRunner.execute = execute
                try:
                    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                finally:
                    runner_mod.ModelRunner.execute = patched
            ops = counted[-1]  # a decode step of all n sequences
            total = sum(ops.values())
            launches = sum(v for f, v in ops.items() if writes_memory(f))
            # per layer: a 2-layer difference would be exact; the step minus the head and embedding is close
            per_layer = launches / layers
            print(f"| {name} | {n} | {layers} | {total} | {launches} | {per_layer:.0f} | {per_layer * 32:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
