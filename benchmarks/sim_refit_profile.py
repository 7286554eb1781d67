"""Refit a calibration profile offline from measurements already taken (no new measurement):

    python benchmarks/sim_refit_profile.py GRID.json SERVING.json OUT.json [--keep-engine] [--decode-table]

GRID.json: a profile whose `samples` are the grid steps (features[1:] + seconds, in grid order); they are refit
with the current FEATURES on per-cell medians (a cell: consecutive samples of the same prefill chunk and decode
count). SERVING.json: a profile whose `serving.dir` still holds the serving runs step trace (steps.jsonl) and
`serving.runs` their windows; the serving terms are refit against the refit engine (calibrate.fit_serving, or
fit_serving_kinds where the runs are open-loop ones: per step kind).
For when one part of `tokenmill sim calibrate` was measured on a quiet machine and the other was not, or the
cost model gained a feature after the measurements (docs/benchmarks/sim.md, session 13). --keep-engine: GRID's
engine fit as it is (coefficients and fit statistics), only the serving terms refit (session 14).
--decode-table: decode-only steps by calibrate.fit_decode_table (a table over the decode batch size, as
`tokenmill sim calibrate` fits them since session 15) instead of the linear per-kind terms."""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np

from tokenmill.sim.calibrate import (cell_medians, fit_decode_table, fit_serving, fit_serving_kinds,
                                     mark_new_shapes, one_stream_request_s, serving_excess)
from tokenmill.sim.cost_model import FEATURES, Calibrated, StepShape, nnls


def main() -> None:
    argv = [a for a in sys.argv[1:] if a not in ("--keep-engine", "--decode-table")]
    if len(argv) != 3 or len(sys.argv) - 1 - len(argv) > 2:
        sys.exit(__doc__)
    grid, serving, out = argv
    g = json.load(open(grid))
    sv = json.load(open(serving))["serving"]
    if "--keep-engine" in sys.argv:  # GRID's engine fit as it is: only the serving terms are refit
        prof = {k: v for k, v in g.items() if k != "serving"}
        coef, rel = np.array(g["coef"]), np.array([g["fit"]["median_abs_rel_error"]] * 2)
        return refit_serving(prof, coef, rel, sv, serving, out)
    rows = g["samples"]  # [prefill_tokens, decode_seqs, attn_pairs, decode_ctx, logits, (mixed_decodes,) seconds]
    samples, cells = [], []
    for k, (_, grp) in enumerate(itertools.groupby(rows, key=lambda r: (r[0], r[1]))):
        for r in grp:
            shape = StepShape(tokens=int(r[0] + r[1]), prefill_tokens=int(r[0]), decode_seqs=int(r[1]),
                              attn_pairs=r[2], decode_ctx=int(r[3]), logits=int(r[4]))
            samples.append((shape, r[-1]))
            cells.append((k,))
    x, y = cell_medians(samples, cells)
    coef = nnls(x, y, weights=1.0 / y)
    rel = np.abs(x @ coef - y) / y
    prof = {k: v for k, v in g.items() if k != "serving"}
    prof.update(features=list(FEATURES), coef=[float(v) for v in coef],
                fit={**g["fit"], "cells": len(y), "median_abs_rel_error": float(np.median(rel)),
                     "p90_abs_rel_error": float(np.percentile(rel, 90)),
                     "refit": f"{grid} grid samples, per-cell medians, features {list(FEATURES)}"},
                samples=[[*s.features().tolist()[1:], t] for s, t in samples])
    refit_serving(prof, coef, rel, sv, serving, out)


def refit_serving(prof: dict, coef, rel, sv: dict, serving: str, out: str) -> None:
    fit = Calibrated(prof["coef"], {})
    steps = mark_new_shapes([json.loads(line) for line in open(sv["dir"] + "/steps.jsonl")])
    wide_rows = (prof.get("engine") or {}).get("small_rows")  # wide steps (cost_model.KIND_TERMS: wide_scale)
    runs = [dict(r, **serving_excess([d for d in steps if r["t0"] <= d["t0"] <= r["t1"]], fit.engine_step_s,
                                     wide_rows)) for r in sv["runs"]]
    open_runs = [r for r in runs if "rate" in r]  # open-loop runs (session 14): terms per step kind
    terms = {"kinds": fit_serving_kinds(open_runs)} if open_runs else fit_serving(runs)
    if open_runs and "--decode-table" in sys.argv and (table := fit_decode_table(open_runs)) is not None:
        terms["decode_linear"] = terms["kinds"]["decode"]
        terms["kinds"]["decode"] = table
    pooled = fit_serving(open_runs) if open_runs else None
    request_s = one_stream_request_s(runs[0], steps, sv["dir"], prof["coef"], terms)
    for r in runs:
        r.pop("rows")
        r.pop("kind_rows")
    if wide_rows is not None:
        terms["wide_rows"] = int(wide_rows)
    prof["serving"] = {**terms, "request_s": request_s, "other_cpu_share": sv["other_cpu_share"], "runs": runs,
                       "dir": sv["dir"], "refit": f"{serving} serving runs against the refit engine"}
    if pooled:
        prof["serving"]["pooled"] = pooled
    json.dump(prof, open(out, "w"), indent=1)
    print("coef (us)", {k: round(v * 1e6, 3) for k, v in zip(FEATURES, coef)},
          f"fit median {np.median(rel):.3f} p90 {np.percentile(rel, 90):.3f}")
    print("serving", json.dumps(terms), f"request_s {1e3 * request_s:.2f} ms")


if __name__ == "__main__":
    main()
