"""What `auto` costs per step beside a fixed k where both run the same k: batch 1, n-gram, content the target
copies (a random 40-token block twice: acceptance ~1, so auto settles on k_max = 8 like the fixed k = 8).

    python benchmarks/spec_auto_overhead.py [--rounds 2] [--profile]

Each round builds both engines, warms each with --warm requests (auto's batch-1 bucket settles), then times
--n requests of 96 greedy tokens one at a time; the table is tokens/s per round, in the same hold. --profile:
cProfile of the spec decoder's per-step calls (plan, observe_step) for both, microseconds per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.hardware import capabilities


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        b = torch.randint(5, 4000, (40,), generator=g).tolist()
        out.append(b + b + b[:8])
    return out


def run(k: str, ps, warm: int, profile: bool):
    llm = LLM("demo", speculative_model="ngram", num_speculative_tokens=k if k == "auto" else int(k), num_threads=1)
    p = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for q in ps[:warm]:
        llm.generate([q], p)
    pr = cProfile.Profile()
    if profile:
        pr.enable()
    t = time.perf_counter()
    out = sum(len(llm.generate([q], p)[0].outputs[0].token_ids) for q in ps[warm:])
    dt = time.perf_counter() - t
    pr.disable()
    us = {}
    if profile:
        st = pstats.Stats(pr).stats
        steps = next(v[0] for f, v in st.items() if f[2] == "_step" and f[0].endswith("llm_engine.py"))
        for f, v in st.items():
            if f[0].endswith("spec/decoder.py") and f[2] in ("plan", "observe_step"):
                us[f[2]] = v[3] / steps * 1e6
    return out / dt, us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", type=int, default=40)
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    ps = prompts(a.warm + a.n)
    print(f"# {capabilities().summary()}; torch threads 1\n")
    print("| round | n-gram k = 8 tok/s | auto tok/s | auto / k = 8 |" + (" plan + observe_step us/step (k=8 / auto) |" if a.profile else ""))
    print("|---:|---:|---:|---:|" + ("---|" if a.profile else ""))
    for r in range(a.rounds):
        (k8, u8), (au, ua) = run("8", ps, a.warm, a.profile), run("auto", ps, a.warm, a.profile)
        extra = (f" {u8.get('plan', 0):.0f} + {u8.get('observe_step', 0):.0f} / {ua.get('plan', 0):.0f} + "
                 f"{ua.get('observe_step', 0):.0f} |") if a.profile else ""
        print(f"| {r} | {k8:.0f} | {au:.0f} | {au / k8:.3f} |" + extra, flush=True)


if __name__ == "__main__":
    main()
