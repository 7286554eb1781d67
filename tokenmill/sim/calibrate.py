"""`tokenmill sim calibrate`: measure the real engine's step times on this machine and fit the calibrated
cost model's coefficients (cost_model.FEATURES) by non-negative least squares on relative error.

The grid: for each context length C and decode batch D, D requests of C random prompt tokens are prefilled
(those steps are samples too), then `repeats` decode-only steps are timed, then for each prefill chunk P one
step carrying the D decodes plus a P-token chunk of a fresh prompt (token_budget = D + P). Every sample's
features come from the SchedulerOutput the real scheduler produced (the engine's scheduler.schedule is
wrapped to keep it); its time is the wall time of LLMEngine.step(), as the server's engine thread measures it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.cli import CLIError
from tokenmill.model.row_buckets import onednn_rows
from tokenmill.sim.cost_model import FEATURES, KIND_TERMS, PROFILE_KIND, STEP_KINDS, StepShape, nnls, step_kind


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
        self.cells: list[object] = []  # per sample: the grid cell its repeats share (None: a cell of its own)

    def step(self, token_budget: int | None = None, keep: bool = True, cell=None):
        t0 = time.perf_counter()
        out = self.engine.step(now=t0, token_budget=token_budget)
        dt = time.perf_counter() - t0
        if keep and self.last is not None and not self.last.empty:
            self.samples.append((StepShape.of(self.last), dt))
            self.cells.append(cell if cell is not None else object())
        return out


def cell_medians(samples: list[tuple[StepShape, float]], cells: list) -> tuple[np.ndarray, np.ndarray]:
    """One row per grid cell: the median of its repeats' features and of their times. A step another
    process's burst of CPU slowed (on a shared machine: a few x) moves a cell's median far less than a mean or
    a least-squares fit over every repeat."""
    groups: dict = {}
    for (shape, t), cell in zip(samples, cells):
        groups.setdefault(id(cell) if not isinstance(cell, tuple) else cell, []).append((shape.features(), t))
    x = np.array([np.median(np.array([f for f, _ in g]), axis=0) for g in groups.values()])
    y = np.array([float(np.median([t for _, t in g])) for g in groups.values()])
    return x, y


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
    busy0, own0 = machine_busy_s(), time.process_time()

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
                rec.step(cell=(c, d, 0))  # decode-only
            for p in grid.prefills:
                for _ in range(grid.repeats):
                    extra = add(p + 1, 1)
                    rec.step(token_budget=d + p, cell=(c, d, p))
                    engine.abort_request(extra)
            drain()
        log(f"  context {c}: {len(rec.samples)} samples so far ({time.perf_counter() - t_start:.0f} s)")
    elapsed = time.perf_counter() - t_start
    other = max(0.0, machine_busy_s() - busy0 - (time.process_time() - own0)) / elapsed if elapsed > 0 else 0.0
    if other > 0.1:
        log(f"  warning: other processes used {other:.2f} cores of this machine during the grid; its step times "
            "include their interference (calibrate on a quiet machine)")
    x, y = cell_medians(rec.samples, rec.cells)  # robust to other processes' bursts on a shared machine
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
                   "num_threads": c.num_threads, "max_model_len": engine.max_model_len,
                   "device": str(engine.runner.device), "quantization": c.quantization,
                   "cuda_graphs": bool(c.cuda_graphs),
                   "small_rows": int(engine.runner.small_rows)},
        "grid": {"contexts": list(grid.contexts), "decodes": list(grid.decodes), "prefills": list(grid.prefills),
                 "repeats": grid.repeats},
        "fit": {"samples": len(rec.samples), "cells": len(y), "median_abs_rel_error": float(np.median(rel)),
                "p90_abs_rel_error": float(np.percentile(rel, 90)), "seconds": time.perf_counter() - t_start,
                "other_cpu_share": other},
        "samples": [[*s.features().tolist()[1:], t] for s, t in rec.samples],
        # each sample's whole StepShape (tokens, prefill_tokens, decode_seqs, attn_pairs, decode_ctx, prefill_ctx,
        # logits, new_requests): what a roofline needs to predict the same step (benchmarks/sim_roofline_check.py)
        "sample_shapes": [list(dataclasses.astuple(s)) for s, _ in rec.samples],
        **_roofline_fit(model, str(engine.runner.device), str(engine.dtype), rec.samples, float(np.median(rel)), log),
    }


def _roofline_fit(model: str, device: str, dtype: str, samples, linear_err: float, log) -> dict:
    """On a GPU of the hardware catalog: the roofline fitted to the measured steps (fit_roofline), kept as the
    profile's `roofline_fit` and printed as the `tokenmill sim` flags it stands for."""
    hw_name = gpu_catalog_name(device)
    if hw_name is None or "bfloat16" not in dtype:
        return {}
    from tokenmill.sim.hardware import get_hardware
    from tokenmill.sim.models import get_model

    fit = fit_roofline([s for s, _ in samples], [t for _, t in samples], get_model(model), get_hardware(hw_name))
    fit["hardware"] = hw_name
    fit["linear_median_abs_rel_error"] = linear_err
    log(f"  roofline fit on {hw_name}: MFU {fit['mfu']}, MBU {fit['mbu']}, {fit['step_overhead_ms']} ms a step "
        f"(median |error| {100 * fit['median_abs_rel_error']:.0f}%, the linear fit's {100 * linear_err:.0f}%): "
        f"tokenmill sim --model {model} --hardware {hw_name} --mfu {fit['mfu']} --mbu {fit['mbu']} "
        f"--step-overhead-ms {fit['step_overhead_ms']}")
    return {"roofline_fit": fit}


ROOFLINE_GRID = {
    "mfu": (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8, 0.9),
    "mbu": (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95),
    "step_overhead_ms": (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 15.0),
}


def fit_roofline(shapes: list[StepShape], times, model, hw, dtype: str = "bf16", kv_bytes: float = 2.0) -> dict:
    """The roofline (`tokenmill sim --hardware NAME`) fitted to measured steps: the MFU, MBU and per-step overhead
    (a grid) with the least median |log(predicted / measured)| (robust to a noisy machine's outliers), and among
    those within 0.01 of it the least mean (a median alone leaves the compute term free when most steps are
    memory-bound). A GPU step is a max of compute and memory time
    plus a fixed cost, which the linear calibrated model (a sum of terms) fits poorly (H200, session 23: its median
    error 31-34% vs 17-23% for this form); the result is the `--mfu/--mbu/--step-overhead-ms` to simulate this
    engine on that hardware with."""
    from tokenmill.sim.cost_model import Roofline, RooflineParams

    r = Roofline(model, hw, RooflineParams(dtype=dtype, kv_bytes=kv_bytes, mfu=1.0, mbu=1.0, step_overhead_s=0.0))
    t = np.asarray(times, dtype=float)
    # at MFU = MBU = 1 and no step overhead: compute seconds and memory seconds per step, and the per-layer term
    comp, mem = np.array([r.bound_s(s) for s in shapes]).T
    fixed = r.fixed_s

    def err(mfu, mbu, ov):
        pred = np.maximum(comp / mfu, mem / mbu) + fixed + ov
        return np.abs(np.log(pred / t))

    scored = []
    for mfu in ROOFLINE_GRID["mfu"]:
        for mbu in ROOFLINE_GRID["mbu"]:
            for ov in ROOFLINE_GRID["step_overhead_ms"]:
                e = err(mfu, mbu, ov / 1000)
                scored.append((float(np.median(e)), float(np.mean(e)), mfu, mbu, ov))
    low = min(x[0] for x in scored)
    _, _, mfu, mbu, ov = min((x for x in scored if x[0] <= low + 0.01), key=lambda x: x[1])
    pred = np.maximum(comp / mfu, mem / mbu) + fixed + ov / 1000
    rel = np.abs(pred - t) / t
    return {"mfu": mfu, "mbu": mbu, "step_overhead_ms": ov, "median_abs_rel_error": float(np.median(rel)),
            "p90_abs_rel_error": float(np.percentile(rel, 90)), "steps": len(t)}


def gpu_catalog_name(device: str) -> str | None:
    """The hardware catalog entry of this CUDA device (by its name), or None."""
    import torch

    from tokenmill.sim.hardware import CATALOG

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device)).lower().replace(" ", "")
    for key in CATALOG:
        if key in name:
            return key
    return None


def write_profile(profile: dict, out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")


def process_cpu_s(pid: int) -> float:
    """utime + stime of a live process (Linux /proc); 0.0 where it cannot be read."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy_s() -> float:
    """CPU seconds every process of the machine used since boot (/proc/stat, all but idle and iowait)."""
    import os

    try:
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


GAP_CAP_S = 0.05  # a longer pause between two steps is the engine waiting for work, not serving overhead


def _shape(d: dict) -> StepShape:
    return StepShape(d["tokens"], d["prefill_tokens"], d["decode_seqs"], d["attn_pairs"], d["decode_ctx"],
                     d["prefill_ctx"], d["logits"], d.get("new_requests", 0))


def mark_new_shapes(steps: list[dict]) -> list[dict]:
    """Marks (`new_shape`: True) each step of a server's whole step trace, in order from its start, whose row count
    (tokens) no earlier step had: where the served engine meets a shape for the first time (serving_excess's
    new_shape_s regressor counts the wide ones). Returns the steps."""
    seen = set()
    for d in steps:
        rows = onednn_rows(d["tokens"])  # the row count oneDNN runs (the engine buckets wide calls)
        d["new_shape"] = rows not in seen
        seen.add(rows)
    return steps


def serving_excess(steps: list[dict], engine_step_s, wide_rows: int | None = None) -> dict:
    """One serving run's engine-core step trace (TOKENMILL_STEP_TRACE lines, in order) against the in-process
    engine fit: what the served engine lost beyond the fit -- each step's measured time minus the fit of its
    shape, plus the pause before the next step (the core's own loop and the front-end's wake-up; pauses over
    GAP_CAP_S are the engine waiting for work, not counted) -- in total and per step (`rows`: the step's
    regressors SERVING_TERMS and its excess). `wide_rows`: a step of more tokens is wide (KIND_TERMS' wide_scale
    regressor: its fit; 0 for the others and for every step where wide_rows is None) and, where mark_new_shapes
    marked it, a new one (new_shape_s regressor: 1)."""
    rows, kind_rows = [], []
    by_kind = {k: {"steps": 0, "busy_s": 0.0, "gap_s": 0.0, "engine_fit_s": 0.0} for k in STEP_KINDS}
    for a, b in zip(steps, steps[1:] + [None]):
        gap = 0.0 if b is None else b["t0"] - a["t1"]
        gap = gap if gap <= GAP_CAP_S else 0.0
        fit = engine_step_s(_shape(a))
        excess = (a["t1"] - a["t0"]) + gap - fit
        rows.append(([1.0, a["logits"], a.get("new_requests", 0), a["prefill_tokens"]], excess))
        kind = step_kind(a["prefill_tokens"], a["decode_seqs"])
        wide = wide_rows is not None and a["tokens"] > wide_rows
        kind_rows.append((kind, [1.0, fit, a["logits"], a.get("new_requests", 0), fit if wide else 0.0,
                                 1.0 if wide and a.get("new_shape") else 0.0], excess))  # KIND_TERMS' regressors
        k = by_kind[kind]
        k["steps"] += 1
        k["busy_s"] += a["t1"] - a["t0"]
        k["gap_s"] += gap
        k["engine_fit_s"] += fit
    busy = sum(d["t1"] - d["t0"] for d in steps)
    fit = sum(engine_step_s(_shape(d)) for d in steps)
    return {"steps": len(steps), "tokens": sum(d["logits"] for d in steps),
            "requests": sum(d.get("new_requests", 0) for d in steps),
            "prefill_tokens": sum(d["prefill_tokens"] for d in steps), "busy_s": busy,
            "engine_fit_s": fit, "excess_s": sum(e for _, e in rows), "by_kind": by_kind, "rows": rows,
            "kind_rows": kind_rows}


SERVING_TERMS = ("step_s", "per_seq_s", "per_request_s", "per_prefill_token_s")


def fit_serving(runs: list[dict]) -> dict[str, float]:
    """The serving terms (SERVING_TERMS: per step, per streamed token, per request started, per prefill token)
    by non-negative least squares of every step's excess (serving_excess rows, all runs) on its counts."""
    rows = [r for run in runs for r in run["rows"]]
    x = np.array([f for f, _ in rows], dtype=np.float64)
    y = np.array([e for _, e in rows])
    return dict(zip(SERVING_TERMS, (float(v) for v in nnls(x, y))))


# terms held at 0 in the per-kind fit: a mixed step's streamed tokens (its decodes) move with its engine fit and its
# wide share; fitted freely, their per-token cost came out 0, 0.03 and 0.62 ms in three calibrations of one machine
# (session 18; decode-only steps measure a streamed token's serving cost at ~0.03 ms: the decode table's slope), and
# the 0.62 ms profile put the check's TPOT p90 49% over at 0.85 of capacity
KIND_FIT_FIXED = {"mixed": ("per_seq_s",)}


def fit_serving_kinds(runs: list[dict], fixed: dict = KIND_FIT_FIXED) -> dict[str, dict[str, float]]:
    """The serving terms per step kind (cost_model.STEP_KINDS: decode-only, mixed, prefill-only steps apart), by
    non-negative least squares of each kind's steps' excess (serving_excess kind_rows, all runs) on KIND_TERMS'
    regressors: 1, the step's engine fit (`scale`: a share of the step the served engine loses), streamed
    tokens, requests started and the fit again on wide steps only (`wide_scale`: the further share a step of more
    rows than the small-row kernels take loses; serving_excess's wide_rows) and 1 on wide steps of a row count new
    to the server (`new_shape_s`, once per row count: mark_new_shapes). `fixed`: per kind, terms held at 0
    (KIND_FIT_FIXED). A kind with no steps in the runs gets zeros (the engine fit alone)."""
    out = {}
    for kind in STEP_KINDS:
        rows = [(f, e) for run in runs for k, f, e in run["kind_rows"] if k == kind]
        if not rows:
            out[kind] = dict.fromkeys(KIND_TERMS, 0.0)
            continue
        x = np.array([f for f, _ in rows], dtype=np.float64)
        y = np.array([e for _, e in rows])
        # a regressor equal to an earlier one on every step cannot be told apart from it (prefill-only steps of
        # one-chunk prompts: 1 request started = 1 token streamed): fitted on the earlier one alone, 0 for it
        keep = [j for j in range(x.shape[1]) if not any(np.array_equal(x[:, i], x[:, j]) for i in range(j))
                and KIND_TERMS[j] not in fixed.get(kind, ())]
        coef = np.zeros(x.shape[1])
        coef[keep] = nnls(x[:, keep], y)
        out[kind] = dict(zip(KIND_TERMS, (float(v) for v in coef)))
    return out


DECODE_TABLE_MIN_STEPS = 60  # decode-only steps per table knot: batch sizes with fewer are pooled with the next


def fit_decode_table(runs: list[dict], min_steps: int = DECODE_TABLE_MIN_STEPS) -> dict:
    """The decode-only steps' serving excess as a table over the decode batch size (cost_model.DECODE_TABLE_TERMS),
    from the open-loop runs' steps (serving_excess kind_rows; for a decode-only step its streamed tokens are its
    decode sequences): consecutive batch sizes are pooled until a knot has `min_steps` steps (a short last group
    joins the one before); a knot is (the steps' mean batch size, their mean excess) -- the mean, because a run's
    latency adds the steps up. Beyond the last knot the excess grows by table_slope_s per sequence: the slope of a
    least-squares line through the knots (weighted by their steps; >= 0). Steps that start requests (full
    prefix-cache hits) are left out of the table; per_request_s is then their mean excess beyond the table, per
    request (>= 0). Each knot is measured directly, so no split between near-collinear regressors (per step,
    per token, a share of the fit) can move between calibrations (docs/benchmarks/sim.md, session 15).
    None where the runs have no decode-only steps."""
    rows = [(int(f[2]), int(f[3]), e) for run in runs for k, f, e in run["kind_rows"] if k == "decode"]
    plain = sorted((d, e) for d, r, e in rows if r == 0)
    if not plain:
        return None
    by_d: dict[int, list[float]] = {}
    for d, e in plain:
        by_d.setdefault(d, []).append(e)
    groups, cur = [], []
    for d in sorted(by_d):
        cur += [(d, e) for e in by_d[d]]
        if len(cur) >= min_steps:
            groups.append(cur)
            cur = []
    if cur:
        if groups:
            groups[-1] += cur
        else:
            groups.append(cur)
    knots = [(float(np.mean([d for d, _ in g])), float(np.mean([e for _, e in g]))) for g in groups]
    w = np.array([len(g) for g in groups], dtype=np.float64)
    slope = 0.0
    if len(knots) > 1:
        x, y = np.array([k[0] for k in knots]), np.array([k[1] for k in knots])
        xm, ym = np.average(x, weights=w), np.average(y, weights=w)
        slope = max(0.0, float(np.sum(w * (x - xm) * (y - ym)) / np.sum(w * (x - xm) ** 2)))
    from tokenmill.sim.cost_model import table_excess

    starts = [(e - table_excess(knots, slope, d)) / r for d, r, e in rows if r > 0]
    per_request = max(0.0, float(np.mean(starts))) if starts else 0.0
    return {**dict.fromkeys(KIND_TERMS, 0.0), "per_request_s": per_request, "table": [list(k) for k in knots],
            "table_slope_s": slope, "table_steps": [int(n) for n in w]}


# The serving runs. First one stream of fixed lengths, closed loop (the per-request path before and after the
# engine: request_s, first_token_path_s); then a capacity probe (a saturating closed loop, capacity_from_ends);
# then open loops -- Poisson arrivals, as the fidelity runs and real traffic have them -- at fractions of that
# measured capacity (session 16; fixed req/s before, chosen for a 3x slower machine, reached decode batches of
# 4-5 where the fidelity check reaches ~15): the serving terms are fitted on the open-loop runs' steps only.
# Closed loops (the method before session 14) saw about half of the loss open-loop runs show at the same batch
# sizes (docs/benchmarks/sim.md, session 13). The workload is chat-shaped (multi-turn sessions with prefix reuse,
# as served traffic) but not the fidelity check's: other lengths, turns and seed; each run its own seed (one seed
# for all made the later runs replays of the first, 98% prefix-cache hits: almost no prefill, session 16).
SERVING_ONE_STREAM = (1, 128, 64)  # (streams, prompt, output)
SERVING_ONE_STREAM_REQUESTS = 48  # 12 before session 18: too few for the mean of a two-group path (first_token_path_s)
SERVING_WORKLOAD = "chat:prompt=192,output=96,spread=0.8,turns_min=1,turns_max=4"
SERVING_LOAD_FRACTIONS = (0.3, 0.65, 1.0)  # of the probe's capacity: the top reaches the check's batch sizes
SERVING_REQUESTS = (100, 150, 240)  # per open-loop run
SERVING_SEED = 7
# the capacity probe: (concurrent sessions, requests). 16 sessions keep this CPU's demo model busy (chat: ~6 req/s;
# 64 sessions add ~10% more at 4x the TPOT); 96 requests leave a middle half of ~48 completions between the first
# wave and the drain (capacity_from_ends)
CAPACITY_PROBE = (16, 96)


def capacity_from_ends(end_s, lo: float = 0.25, hi: float = 0.75) -> float:
    """Requests per second a server completes when saturated, from a closed-loop run's completion times: the
    completions between the lo and hi quantiles over the time between them -- the run's start (every session's
    first prefill at once) and its tail (the last sessions alone) left out."""
    e = np.sort(np.asarray(end_s, dtype=np.float64))
    if len(e) < 4:
        raise CLIError(f"capacity probe: {len(e)} completed requests; need >= 4")
    i, j = int(round(lo * (len(e) - 1))), int(round(hi * (len(e) - 1)))
    if j <= i or e[j] <= e[i]:
        raise CLIError("capacity probe: the completions span no time")
    return float((j - i) / (e[j] - e[i]))


def rates_from_capacity(capacity: float, fractions) -> tuple[float, ...]:
    """Open-loop request rates (req/s, 3 significant digits) at `fractions` of a measured capacity."""
    fractions = tuple(float(f) for f in fractions)
    if not (capacity > 0 and np.isfinite(capacity)):
        raise CLIError(f"capacity {capacity!r} req/s: must be a positive number")
    if not fractions or any(not 0 < f <= 2 for f in fractions):
        raise CLIError(f"load fractions {fractions}: need 0 < fraction <= 2 (of the measured capacity)")
    return tuple(float(f"{f * capacity:.3g}") for f in fractions)


def first_token_path_s(steps: list[dict], records: list[dict]) -> float | None:
    """The per-request time outside the engine's steps (request arrival -> engine, first token -> client), from
    a closed loop of ONE stream (each request finds the engine idle): per request, its TTFT minus the step that
    scheduled it (the requests enter the engine in the order they were sent: the k-th `new_requests` of the step
    trace) and the pause after that step (the sim charges that pause inside its step time); the mean (session 18:
    on the AMX machine the per-request values fall in two groups, ~0.8-1.0 and ~2.4-2.9 ms, in changing shares: the
    median of 12 flipped between 0.92 and 2.45 ms over four calibrations, the mean stayed at 1.5-2.2 ms; a latency
    adds the path up, so the mean is what the sim's constant must match). None
    where the trace and the records do not pair up (a request of several prefill chunks, a missing trace).
    Measured directly: the step model's error on this one step shape does not move it (before session 16:
    TTFT - the model's step, clipped at 0 where the model over-predicted the idle server's prefill)."""
    recs = sorted((r for r in records if r.get("status") == "ok" and r.get("ttft_s") is not None),
                  key=lambda r: r["sent_s"])
    firsts = [i for i, s in enumerate(steps) for _ in range(s.get("new_requests", 0))]
    if not recs or len(firsts) != len(recs):
        return None
    vals = []
    for r, i in zip(recs, firsts):
        s = steps[i]
        if s["decode_seqs"] or s["logits"] != 1:  # not a lone first-token step: one stream cannot pair it
            return None
        pause = steps[i + 1]["t0"] - s["t1"] if i + 1 < len(steps) else 0.0
        vals.append(r["ttft_s"] - (s["t1"] - s["t0"]) - min(max(pause, 0.0), GAP_CAP_S))
    return float(np.mean(vals))


def open_loop_paths_s(steps: list[dict], records: list[dict]) -> list[float]:
    """The per-request time outside the engine under load (session 25): per request, its TTFT minus the time
    from the front-end handing it to the engine (the trace's `enq`: AddCmd.sent_t) to the end of the step that
    scheduled it, and the pause after that step (charged inside the sim's step time, as in first_token_path_s).
    What is left is the front-end's path before the hand-over and after the first token (HTTP, the bench
    client); the wait for a step in flight, which the sim models itself, is not in it. Requests pair with the
    trace's `enq` in order (sent order = hand-over order); a request whose prompt needed more than its first
    step's budget (chunked: its first token comes later) is left out. [] where the trace has no `enq` (a server
    before session 25) or the counts do not pair up."""
    recs = sorted((r for r in records if r.get("status") == "ok" and r.get("ttft_s") is not None),
                  key=lambda r: r["sent_s"])
    enq = sorted((t, i) for i, d in enumerate(steps) for t in d.get("enq", ()))
    if not recs or len(enq) != len(recs):
        return []
    out = []
    for r, (t, i) in zip(recs, enq):
        d = steps[i]
        if d.get("budget") is not None and r["prompt_tokens"] - (r.get("cached_tokens") or 0) > d["budget"]:
            continue
        pause = steps[i + 1]["t0"] - d["t1"] if i + 1 < len(steps) else 0.0
        out.append(r["ttft_s"] - (d["t1"] - t) - min(max(pause, 0.0), GAP_CAP_S))
    return out


def open_loop_request_s(runs: list[dict], steps: list[dict], run_dir: Path) -> float | None:
    """serving.request_s: the mean of open_loop_paths_s over the open-loop runs (None: no run paired up; the
    one-stream path is used then)."""
    vals = []
    for r in runs:
        f = Path(run_dir) / r["run"] / "requests.jsonl"
        if not f.exists():
            continue
        recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        vals += open_loop_paths_s([d for d in steps if r["t0"] <= d["t0"] <= r["t1"]], recs)
    return float(np.mean(vals)) if vals else None


def one_stream_request_s(one: dict, steps: list[dict], run_dir: Path, coef, serving: dict) -> float:
    """serving.request_s from the one-stream run `one` (a serving.runs entry; its records in run_dir/one["run"]):
    first_token_path_s; where the trace and the records do not pair up (or the records are gone), its median TTFT
    minus the served model's step for its prompt (the method before session 16). >= 0."""
    f = Path(run_dir) / one["run"] / "requests.jsonl"
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []
    request_s = first_token_path_s([d for d in steps if one["t0"] <= d["t0"] <= one["t1"]], recs)
    if request_s is None:
        from tokenmill.sim.cost_model import Calibrated

        p = one["prompt"]
        first = StepShape(tokens=p, prefill_tokens=p, attn_pairs=p * (p + 1) / 2, logits=1, new_requests=1)
        request_s = one["ttft_s"] - Calibrated(coef, {"serving": serving}).step_s(first)
    return max(0.0, float(request_s))


def probe_capacity(url: str, model: str, tokenizer: str, workload: str, out: Path, seed: int,
                   concurrency: int = CAPACITY_PROBE[0], num_requests: int = CAPACITY_PROBE[1], env=None) -> dict:
    """The served engine's capacity (req/s) for `workload`: a `tokenmill bench` closed loop of `concurrency`
    sessions (saturating), capacity_from_ends over its completions. Shared by `tokenmill sim calibrate` (its
    open-loop loads) and benchmarks/sim_fidelity.py (the check's loads), so both are fractions of the same
    measurement."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "tokenmill", "bench", "--target", url, "--model", model, "--tokenizer",
                    tokenizer, "--workload", workload, "--concurrency", str(concurrency), "--num-requests",
                    str(num_requests), "--seed", str(seed), "--out", str(out), "--no-plots", "--no-progress"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    recs = [json.loads(x) for x in (Path(out) / "requests.jsonl").read_text().splitlines() if x.strip()]
    ends = [r["end_s"] for r in recs if r.get("status") == "ok"]
    return {"workload": workload, "concurrency": concurrency, "requests": num_requests, "seed": seed,
            "completed": len(ends), "req_per_s": capacity_from_ends(ends)}


def open_loop_plan(rates, workload: str, num_requests, seed: int) -> list[tuple[str, list[str], dict]]:
    """The open-loop serving runs: (name, `tokenmill bench` flags, record) per rate; run k has seed + 1 + k (fresh
    prompts: a repeated seed replays the earlier run's sessions into the prefix cache) and num_requests[k]."""
    n = tuple(num_requests) if isinstance(num_requests, (tuple, list)) else (num_requests,) * len(rates)
    if len(n) != len(rates):
        raise CLIError(f"{len(rates)} open-loop rates but {len(n)} request counts")
    return [(f"open-{r:g}", ["--workload", workload, "--rate", f"{r:g}", "--num-requests", str(k), "--seed",
                             str(seed + 1 + i)], {"rate": r, "workload": workload, "seed": seed + 1 + i})
            for i, (r, k) in enumerate(zip(rates, n))]


def measure_serving(profile: dict, model: str, engine_args: list[str], fractions=SERVING_LOAD_FRACTIONS,
                    workload: str = SERVING_WORKLOAD, num_requests=SERVING_REQUESTS, seed: int = SERVING_SEED,
                    port: int = 18473, capacity: float | None = None, log=print) -> dict:
    """The serving overhead on top of the engine fit, from a real `tokenmill serve` (admission off) under open-loop
    Poisson traffic (`workload` at `fractions` of the server's capacity for it -- measured by probe_capacity on the
    same server unless `capacity` (req/s) is given -- `num_requests` each) measured by `tokenmill bench` in its own
    process. The server's engine core writes every step it runs (TOKENMILL_STEP_TRACE): what the served engine
    lost beyond the in-process fit at each step (serving_excess: measured step + pause - fit of the same shape)
    is regressed per step kind (decode-only, mixed, prefill-only: fit_serving_kinds) on the step's counts:

        excess of a step of kind k = kinds[k].step_s + kinds[k].scale x engine fit + kinds[k].per_seq_s x tokens
                                     + kinds[k].per_request_s x requests started      (fitted over the open-loop
                                                                                       runs' steps, >= 0)
        request_s = the one-stream run's per-request time outside the steps (first_token_path_s)

    On this kind of machine the excess is CPU time: the engine's torch threads use every core, and each
    CPU-second the front-end and the client take delays it by about one (the profile keeps their CPU seconds
    per run, `cpu_s`, beside the excess). The bench client shares the machine with the server, as it does in
    the fidelity runs; the machine's other load during the runs is kept as `other_cpu_share` (cores).
    `pooled` keeps the one-set fit (SERVING_TERMS, every kind together) of the same steps, for comparison."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import urllib.request

    from tokenmill.sim.cost_model import Calibrated

    fit = Calibrated(profile["coef"], {})
    wide_rows = (profile.get("engine") or {}).get("small_rows")  # steps of more rows: oneDNN's GEMM (wide_scale)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-calibrate-"))
    trace = tmp / "steps.jsonl"
    logf = open(tmp / "server.log", "w")
    server = subprocess.Popen([py, "-m", "tokenmill", "serve", "--model", model, "--port", str(port), "--admission",
                               "off", *engine_args], stdout=logf, stderr=subprocess.STDOUT,
                              env={**env, "TOKENMILL_STEP_TRACE": str(trace)})
    url = f"http://127.0.0.1:{port}"
    results = []
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
        try:
            core_pids = [int(c) for c in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
        except (OSError, ValueError):
            core_pids = []
        import resource

        c, p, o = SERVING_ONE_STREAM
        plan = [(f"c{c}-p{p}-o{o}", ["--workload", f"batch:prompt={p},output={o},spread=0", "--concurrency", str(c),
                                      "--num-requests", str(SERVING_ONE_STREAM_REQUESTS)],
                 {"concurrency": c, "prompt": p, "output": o}), None]
        for item in plan:
            if item is None:  # after the one-stream run: the capacity, then the open loops at its fractions
                if capacity is None:
                    probe = probe_capacity(url, model, tok, workload, tmp / "capacity", seed, env=env)
                    log(f"  serving: capacity probe ({probe['concurrency']} sessions, {probe['completed']} requests):"
                        f" {probe['req_per_s']:.2f} req/s")
                else:
                    probe = {"workload": workload, "req_per_s": float(capacity), "given": True}
                rates = rates_from_capacity(probe["req_per_s"], fractions)
                probe.update(fractions=[float(f) for f in fractions], rates=list(rates))
                plan += open_loop_plan(rates, workload, num_requests, seed)
                continue
            name, flags, meta = item
            out = tmp / name
            pids = {"front-end": server.pid, **{f"core-{q}": q for q in core_pids}}
            cpu0 = {k: process_cpu_s(q) for k, q in pids.items()}
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            m0 = machine_busy_s()
            t0 = time.perf_counter()
            subprocess.run([py, "-m", "tokenmill", "bench", "--target", url, "--model", model, "--tokenizer", tok,
                            *flags, "--out", str(out), "--no-plots", "--no-progress"],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            t1 = time.perf_counter()
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = {k: process_cpu_s(q) - cpu0[k] for k, q in pids.items()}
            cpu["bench"] = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
            cpu["other"] = max(0.0, machine_busy_s() - m0 - sum(cpu.values()))
            s = json.loads((out / "result.json").read_text())["summary"]
            log(f"  serving: {name}: TPOT p50 {s['tpot_ms']['p50']:.2f} ms, TTFT p50 {s['ttft_ms']['p50']:.1f} ms, "
                f"{s.get('request_throughput') or 0:.2f} req/s")
            results.append({"run": name, **meta, "requests": s.get("completed", None), "t0": t0, "t1": t1,
                            "wall_s": t1 - t0, "cpu_s": cpu, "tpot_s": s["tpot_ms"]["p50"] / 1000,
                            "ttft_s": s["ttft_ms"]["p50"] / 1000})
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
        logf.close()
    steps = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()] if trace.exists() else []
    mark_new_shapes(steps)  # over the server's whole trace, from its start
    for r in results:
        r.update(serving_excess([d for d in steps if r["t0"] <= d["t0"] <= r["t1"]], fit.engine_step_s, wide_rows))
    if not any(r["steps"] for r in results):
        raise CLIError(f"calibrate: the server wrote no step trace ({trace})")
    open_runs = [r for r in results if "rate" in r]
    kinds = fit_serving_kinds(open_runs)
    linear_decode = kinds["decode"]
    table = fit_decode_table(open_runs)
    if table is not None:  # decode-only steps: the table (session 15); the linear split kept for comparison
        kinds["decode"] = table
    pooled = fit_serving(open_runs)
    for r in results:
        del r["rows"], r["kind_rows"]
    one_stream = one_stream_request_s(results[0], steps, tmp, profile["coef"], {"kinds": kinds})
    # the path under the open-loop loads (session 25): what the sim's constant stands for, measured where the sim is
    # used (4.3-4.5 ms vs 2.4-2.9 ms at one stream on the AMX machine); the one-stream value where the trace has no
    # hand-over times (docs/benchmarks/sim.md, "Fidelity, session 25")
    loaded = open_loop_request_s(open_runs, steps, tmp)
    request_s = loaded if loaded is not None else one_stream
    wall = sum(r["wall_s"] for r in results)
    other = sum(r["cpu_s"]["other"] for r in results) / wall if wall else 0.0
    if other > 0.1:
        log(f"  warning: other processes used {other:.2f} cores of this machine during the serving runs; the "
            "serving overhead includes their interference (calibrate on a quiet machine)")
    return {"kinds": kinds, **({"wide_rows": int(wide_rows)} if wide_rows is not None else {}),
            "request_s": float(request_s), "request_s_source": "open-loop runs" if loaded is not None else "one stream",
            "request_s_one_stream": float(one_stream), "request_s_open_loop": loaded,
            "other_cpu_share": other, "pooled": pooled,
            "decode_linear": linear_decode, "capacity": probe,
            "runs": results, "dir": str(tmp)}


# -- the draft's passes inside a speculating engine (session 25) ----------------------------------------------------
DRAFT_LOOP_GRID = ((1, 2, 4), (1, 4, 8, 16))  # (k, decode batch)


def calibrate_draft_loop(target: str, draft: str, engine_kwargs: dict | None = None, steps: int = 12, seed: int = 0,
                         log=print) -> dict:
    """The draft's proposal time as the target's speculating engine runs it (its proposer's own loop, not the
    draft as an engine of its own: no scheduling, sampling or output bookkeeping per pass), over a grid of fixed k x
    decode batch: SpecDecoder.propose timed per step, fitted by NNLS on DRAFT_LOOP_FEATURES. The simulator prices a
    calibrated draft's proposals with it (sim/spec.py)."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.sim.spec import DRAFT_LOOP_FEATURES, draft_loop_features

    rng = np.random.default_rng(seed)
    xs, ys = [], []
    t0 = time.perf_counter()
    for k in DRAFT_LOOP_GRID[0]:
        engine = LLMEngine(**{"model": target, **(engine_kwargs or {}), "speculative_model": draft,
                              "num_speculative_tokens": k})
        spec = engine.spec
        inner = spec.propose
        timing: list[tuple[list[float], float]] = []

        def timed(sched, requests, gens, _inner=inner, _spec=spec, _timing=timing):
            seqs = [s for s in sched.seqs if s.num_spec_slots > 0]
            reqs = [requests[s.request_id] for s in seqs]
            starts = _spec.proposer._starts(reqs)  # the draft's KV before this proposal (DraftModelProposer)
            t = time.perf_counter()
            _inner(sched, requests, gens)
            if seqs:
                _timing.append((draft_loop_features([s.num_spec_slots for s in seqs],
                                                    [r.num_tokens - n for r, n in zip(reqs, starts)]),
                                time.perf_counter() - t))

        spec.propose = timed
        vocab = engine.model_config.vocab_size
        for b in DRAFT_LOOP_GRID[1]:
            rids = [f"d{k}-{b}-{i}" for i in range(b)]
            for rid in rids:
                engine.add_request(rid, rng.integers(1, vocab, size=64).tolist(),
                                   SamplingParams(max_tokens=(steps + 8) * (k + 1) + 16, ignore_eos=True,
                                                  temperature=0.0))
            for _ in range(4):  # prefill and the first proposals (the draft's catch-up of each prompt)
                engine.step()
            timing.clear()
            for _ in range(steps):
                engine.step()
            xs += [f for f, _ in timing]
            ys += [s for _, s in timing]
            for rid in rids:
                if rid in engine.scheduler.requests:
                    engine.abort_request(rid)
        log(f"  draft loop k={k}: {len(ys)} proposals timed so far")
        del engine
    x, y = np.asarray(xs), np.asarray(ys)
    coef = nnls(x, y, weights=1.0 / np.maximum(y, 1e-6))
    rel = np.abs(x @ coef / y - 1.0)
    return {"target": target, "features": list(DRAFT_LOOP_FEATURES), "coef": [float(c) for c in coef],
            "samples": int(len(y)), "seconds": time.perf_counter() - t0,
            "median_abs_rel_error": float(np.median(rel)), "p90_abs_rel_error": float(np.quantile(rel, 0.9))}
