"""Where a batch-1 speculative step's time goes, beside a plain decode step, in one process.

    python benchmarks/spec_step_split.py                     # held-out code: off, demo-draft k=2..4, ngram k=4
    python benchmarks/spec_step_split.py --workload edit     # the edit workload: off, ngram k=4/8/12/16

Each configuration's engine runs the same prompts (batch 1, greedy, `ignore_eos`), interleaved prompt by prompt.
The engine's phases are timed by wrapping their Python entry points with a wall clock (no profiler):

    plan       SpecDecoder.plan (k per sequence)          schedule   Scheduler.schedule less plan
    draft      SpecDecoder.propose (the proposer: draft-model steps / n-gram lookup)
    verify fwd ModelRunner.execute (the target's forward: 1 row off, k+1 rows speculating)
    accept     SpecDecoder.verify / verify_argmax (greedy / rejection), rollback   SpecDecoder.rollback (KV cut)
    post       the rest of postprocess (sampling for plain rows, appending tokens, outputs)
    other      the rest of LLMEngine.step (output processor, observe_step, the step's own Python)
    caller     the benchmark loop around step()

Per configuration it prints ms per step by phase, tokens per step, and the expected speedup over off from
measured quantities only: tokens/step (= 1 + accepted per step) x off's ms/step / this config's ms/step, and the
same with E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) from the measured acceptance alpha (the i.i.d. model the
`auto` policy's cost model uses), beside the measured speedup (wall clock of the same run).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from spec_decode import edit_prompts, heldout_prompts  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.hardware import capabilities  # noqa: E402

PHASES = ("plan", "schedule", "draft", "verify fwd", "accept", "rollback", "post", "other", "caller")


class Timed:
    """Wraps an engine's phase methods with wall-clock accumulators (exclusive times: nested phases are
    subtracted from the enclosing one)."""

    def __init__(self, engine: LLMEngine):
        self.e = engine
        self.t = collections.defaultdict(float)
        self.stack: list[list[float]] = []  # per open phase: [child seconds]
        spec = engine.spec
        self._wrap(engine, "_step", "step")
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "execute", "verify fwd")
        self._wrap(engine, "_postprocess", "post")
        self._wrap(engine, "_postprocess_spec", "post")
        if spec is not None:
            self._wrap(spec, "plan", "plan")
            self._wrap(spec, "propose", "draft")
            self._wrap(spec, "verify", "accept")
            self._wrap(spec, "verify_argmax", "accept")
            self._wrap(spec, "rollback", "rollback")
            self._wrap(spec, "observe_step", "other")

    def _wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)
        t, stack = self.t, self.stack

        def wrapped(*a, **kw):
            stack.append([0.0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                child = stack.pop()[0]
                t[phase] += dt - child
                if stack:
                    stack[-1][0] += dt

        setattr(obj, name, wrapped)


def run_one(engine: LLMEngine, timed: Timed, prompt: list[int], max_tokens: int, rid: str) -> tuple[float, list[int], int]:
    steps0 = engine.num_steps
    out: list[int] = []
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    t_steps = 0.0
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        t_steps += time.perf_counter() - s0
        for o in outs:
            if o.finished:
                out = list(o.output_token_ids)
    wall = time.perf_counter() - t0
    timed.t["caller"] += wall - t_steps
    return wall, out, engine.num_steps - steps0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("heldout", "edit"), default="heldout")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--config", action="append", default=None,
                    help="NAME=PROPOSER:K (repeatable; off is always first); default by workload")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model", default="demo", help="target: a shipped name or an HF directory (default demo)")
    a = ap.parse_args()
    e0 = LLMEngine(model=a.model, kv_cache_bytes="64MiB")
    prompts = (heldout_prompts(e0.tokenizer, a.prompts, 128) if a.workload == "heldout"
               else edit_prompts(e0.tokenizer, a.prompts, 160))
    del e0
    specs = a.config or (["draft k=2=demo-draft:2", "draft k=3=demo-draft:3", "draft k=4=demo-draft:4",
                          "ngram k=4=ngram:4"] if a.workload == "heldout" else
                         ["ngram k=4=ngram:4", "ngram k=8=ngram:8", "ngram k=12=ngram:12", "ngram k=16=ngram:16",
                          "draft k=3=demo-draft:3"])
    configs: dict[str, dict] = {"off": {}}
    for s in specs:
        name, _, val = s.rpartition("=")
        prop, _, k = val.partition(":")
        configs[name] = dict(speculative_model=prop, num_speculative_tokens=k if k == "auto" else int(k))
    engines = {n: LLMEngine(model=a.model, kv_cache_bytes="256MiB", num_threads=a.num_threads, **kw) for n, kw in configs.items()}
    timers = {}
    for n, e in engines.items():  # warm-up, then the timers
        for p in prompts[:2]:
            e.add_request("warm", p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            while e.has_unfinished_requests():
                e.step()
        timers[n] = Timed(e)
    wall = collections.defaultdict(float)
    steps = collections.Counter()
    toks = collections.Counter()
    outs = collections.defaultdict(list)
    for r in range(a.repeats):
        for i, p in enumerate(prompts):
            for n, e in engines.items():
                w, o, s = run_one(e, timers[n], p, a.max_tokens, f"{n}-{r}-{i}")
                wall[n] += w
                steps[n] += s
                toks[n] += len(o)
                outs[n].append(o)
    print(f"\n### Batch-1 step split, {a.workload} prompts ({len(prompts)} x {a.repeats}, {a.max_tokens} greedy "
          f"tokens each)\n\n{capabilities().summary()}\n")
    print("ms per engine step (the prefill step included; 'caller' = the loop around step()):\n")
    print("| config | steps | tok/step | " + " | ".join(PHASES) + " | total ms/step |")
    print("|---|---:|---:|" + "---:|" * (len(PHASES) + 1))
    per_step = {}
    for n in engines:
        t = timers[n].t
        t["other"] += t.pop("step", 0.0)
        total = sum(t[p] for p in PHASES)
        per_step[n] = total / steps[n]
        print(f"| {n} | {steps[n]} | {toks[n] / steps[n]:.2f} | "
              + " | ".join(f"{1000 * t[p] / steps[n]:.3f}" for p in PHASES) + f" | {1000 * per_step[n]:.3f} |")
    print("\nexpected vs measured speedup over off (same run):\n")
    print("| config | identical to off | acceptance | tok/step | step cost vs off | expected (tok/step) "
          "| expected E(alpha,k) | measured |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    off_rate = toks["off"] / wall["off"]
    for n, e in engines.items():
        st = e.stats().spec
        same = "yes" if outs[n] == outs["off"] else f"NO ({sum(x != y for x, y in zip(outs[n], outs['off']))} differ)"
        cost = per_step[n] / per_step["off"]
        tps = toks[n] / steps[n]
        exp1 = tps / (toks["off"] / steps["off"]) / cost
        if st is not None and st.num_draft_tokens:
            alpha = st.acceptance_rate
            k = configs[n]["num_speculative_tokens"]
            ek = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
            exp2 = f"{ek / cost * (toks['off'] / steps['off']) / (toks['off'] / steps['off']):.2f}x"
            acc = f"{alpha:.3f}"
        else:
            exp2, acc = "–", "–"
        print(f"| {n} | {same} | {acc} | {tps:.2f} | {cost:.2f}x | {exp1:.2f}x | {exp2} | "
              f"{toks[n] / wall[n] / off_rate:.2f}x |")
    print(f"\noff: {off_rate:.0f} tok/s")


if __name__ == "__main__":
    main()
