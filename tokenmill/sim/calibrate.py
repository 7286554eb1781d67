"""`tokenmill sim calibrate`: measure the real engine's step times on this machine and fit the calibrated
cost model's coefficients (cost_model.FEATURES) by non-negative least squares on relative error.

The grid: for each context length C and decode batch D, D requests of C random prompt tokens are prefilled
(those steps are samples too), then `repeats` decode-only steps are timed, then for each prefill chunk P one
step carrying the D decodes plus a P-token chunk of a fresh prompt (token_budget = D + P). Every sample's
features come from the SchedulerOutput the real scheduler produced (the engine's scheduler.schedule is
wrapped to keep it); its time is the wall time of LLMEngine.step(), as the server's engine thread measures it.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.cli import CLIError
from tokenmill.sim.cost_model import FEATURES, PROFILE_KIND, StepShape, nnls


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...] = (64, 256, 768, 1536)
    decodes: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
    prefills: tuple[int, ...] = (16, 64, 256, 1024)
    repeats: int = 4

    def __post_init__(self):
        if not (self.contexts and self.decodes and self.prefills) or self.repeats < 1:
            raise CLIError("calibration grid: contexts, decodes and prefills must be non-empty, repeats >= 1")
        if min(self.contexts + self.decodes + self.prefills) < 1:
            raise CLIError("calibration grid values must be >= 1")


class _Recorder:
    def __init__(self, engine):
        self.engine = engine
        self.last = None
        inner = engine.scheduler.schedule

        def schedule(now=None, token_budget=None):
            self.last = inner(now, token_budget)
            return self.last

        engine.scheduler.schedule = schedule
        self.samples: list[tuple[StepShape, float]] = []

    def step(self, token_budget: int | None = None, keep: bool = True):
        t0 = time.perf_counter()
        out = self.engine.step(now=t0, token_budget=token_budget)
        dt = time.perf_counter() - t0
        if keep and self.last is not None and not self.last.empty:
            self.samples.append((StepShape.of(self.last), dt))
        return out


def calibrate(model: str, grid: Grid = Grid(), engine_kwargs: dict | None = None, seed: int = 0,
              log=print) -> dict:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.hardware import capabilities

    kwargs = {"model": model, **(engine_kwargs or {})}
    engine = LLMEngine(**kwargs)
    rec = _Recorder(engine)
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    max_len = engine.max_model_len
    ids = itertools.count()
    t_start = time.perf_counter()

    def add(n: int, max_tokens: int) -> str:
        rid = f"cal-{next(ids)}"
        n = max(1, min(n, max_len - max_tokens - 1))
        engine.add_request(rid, rng.integers(1, vocab, size=n).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        return rid

    def drain():
        for rid in list(engine.scheduler.requests):
            engine.abort_request(rid)

    # warm-up: kernels compiled, allocator settled
    for _ in range(2):
        add(256, 4)
        while engine.has_unfinished_requests():
            rec.step(keep=False)
    decode_len = grid.repeats + 4 * len(grid.prefills) + 8
    for c in grid.contexts:
        for d in grid.decodes:
            live = [add(c, decode_len) for _ in range(d)]
            while any(engine.scheduler.requests[r].num_computed_tokens < engine.scheduler.requests[r].num_tokens - 1
                      for r in live if r in engine.scheduler.requests):
                rec.step()  # prefill steps (full budget), samples too
            for _ in range(grid.repeats):
                rec.step()  # decode-only
            for p in grid.prefills:
                for _ in range(grid.repeats):
                    extra = add(p + 1, 1)
                    rec.step(token_budget=d + p)
                    engine.abort_request(extra)
            drain()
        log(f"  context {c}: {len(rec.samples)} samples so far ({time.perf_counter() - t_start:.0f} s)")
    x = np.array([s.features() for s, _ in rec.samples])
    y = np.array([t for _, t in rec.samples])
    coef = nnls(x, y, weights=1.0 / y)
    pred = x @ coef
    rel = np.abs(pred - y) / y
    kv_bytes_per_value = float(engine.runner.kv_caches[0].element_size()) if hasattr(engine.runner.kv_caches[0], "element_size") else 1.0
    c = engine.config
    return {
        "kind": PROFILE_KIND, "model": model, "features": list(FEATURES), "coef": [float(v) for v in coef],
        "isa": capabilities().summary(),
        "engine": {"kv_cache_bytes": c.kv_cache_bytes, "block_size": c.block_size,
                   "max_num_batched_tokens": c.max_num_batched_tokens, "max_num_seqs": c.max_num_seqs,
                   "dtype": str(engine.dtype).replace("torch.", ""), "kv_bytes_per_value": kv_bytes_per_value,
                   "num_threads": c.num_threads, "max_model_len": engine.max_model_len},
        "grid": {"contexts": list(grid.contexts), "decodes": list(grid.decodes), "prefills": list(grid.prefills),
                 "repeats": grid.repeats},
        "fit": {"samples": len(y), "median_abs_rel_error": float(np.median(rel)),
                "p90_abs_rel_error": float(np.percentile(rel, 90)), "seconds": time.perf_counter() - t_start},
        "samples": [[*s.features().tolist()[1:], t] for s, t in rec.samples],
    }


def write_profile(profile: dict, out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")


def measure_serving(profile: dict, model: str, engine_args: list[str], concurrencies=(1, 4, 16),
                    prompt: int = 128, output: int = 64, long_prompt: int = 1024, port: int = 18473,
                    log=print) -> dict:
    """The serving overhead on top of the engine fit: a real `tokenmill serve` (admission off) under a closed
    loop of C streams (fixed prompt and output lengths) measured by `tokenmill bench` in its own process, for
    each C. In steady state a stream's TPOT is one step of ~C decodes, so

        TPOT_real(C) - engine_fit(C decodes at the mean context) = step_s + per_seq_s x C   (fitted, >= 0)
        TTFT_real(C=1, P) = request_s + prefill_scale x engine_fit(one prefill of P tokens) + step_s + per_seq_s
                            for P = `prompt` and `long_prompt` (two equations: the per-request delay, and how
                            much slower a prefill runs inside the server than in-process)

    The bench client shares the machine with the server, as it does in the fidelity runs."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import urllib.request

    from tokenmill.sim.cost_model import Calibrated

    fit = Calibrated(profile["coef"], {})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-calibrate-"))
    logf = open(tmp / "server.log", "w")
    server = subprocess.Popen([py, "-m", "tokenmill", "serve", "--model", model, "--port", str(port), "--admission",
                               "off", *engine_args], stdout=logf, stderr=subprocess.STDOUT,
                              env={**env, "TOKENMILL_STEP_TRACE": str(tmp / "steps.jsonl")})
    url = f"http://127.0.0.1:{port}"
    points = []
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise CLIError(f"calibrate: the server exited; see {tmp / 'server.log'}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise CLIError("calibrate: the server did not become healthy in 300 s") from None
                time.sleep(0.5)
        from tokenmill.model.loader import resolve_model_path

        tok = str(resolve_model_path(model))
        windows = []

        def run(c: int, p: int, tag: str) -> dict:
            out = tmp / tag
            n = max(3 * c, 12)
            t0 = time.perf_counter()
            subprocess.run([py, "-m", "tokenmill", "bench", "--target", url, "--model", model, "--tokenizer", tok,
                            "--workload", f"batch:prompt={p},output={output},spread=0", "--concurrency", str(c),
                            "--num-requests", str(n), "--out", str(out), "--no-plots", "--no-progress"],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            windows.append({"tag": tag, "concurrency": c, "prompt": p, "t0": t0, "t1": time.perf_counter()})
            s = json.loads((out / "result.json").read_text())["summary"]
            log(f"  serving: {c} streams, prompt {p}: TPOT p50 {s['tpot_ms']['p50']:.2f} ms, "
                f"TTFT p50 {s['ttft_ms']['p50']:.1f} ms")
            return s

        for c in concurrencies:
            s = run(c, prompt, f"c{c}")
            points.append((c, s["tpot_ms"]["p50"] / 1000, s["ttft_ms"]["p50"] / 1000))
        long_ttft_s = run(min(concurrencies), long_prompt, "long")["ttft_ms"]["p50"] / 1000
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
        logf.close()
    ctx = prompt + output // 2
    x, y = [], []
    for c, tpot, _ in points:
        engine = fit.engine_step_s(StepShape(tokens=c, decode_seqs=c, attn_pairs=c * ctx, decode_ctx=c * ctx, logits=c))
        x.append([1.0, c])
        y.append(max(0.0, tpot - engine))
    step_s, per_seq_s = nnls(np.array(x), np.array(y))
    c1 = next(p for p in points if p[0] == min(concurrencies))

    def prefill_s(n: int) -> float:
        return fit.engine_step_s(StepShape(tokens=n, prefill_tokens=n, attn_pairs=n * (n + 1) / 2, logits=1))

    short, long_ = prefill_s(prompt), prefill_s(long_prompt)
    scale = max(1.0, (long_ttft_s - c1[2]) / (long_ - short)) if long_ > short else 1.0
    request_s = max(0.0, c1[2] - scale * short - step_s - per_seq_s)
    return {"step_s": float(step_s), "per_seq_s": float(per_seq_s), "request_s": float(request_s),
            "prefill_scale": float(scale),
            "points": [{"concurrency": c, "tpot_s": t, "ttft_s": f} for c, t, f in points],
            "long_prompt": long_prompt, "long_prompt_ttft_s": long_ttft_s,
            "prompt": prompt, "output": output, "dir": str(tmp), "windows": windows}
