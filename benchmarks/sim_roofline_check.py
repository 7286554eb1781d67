"""The simulator's roofline against step times measured on real hardware (a `tokenmill sim calibrate` profile).

    python benchmarks/sim_roofline_check.py benchmarks/data/h200_eager.json --hardware h200 \
        --model llama-3.1-8b --layers 8

For every measured step of the profile (its `sample_shapes`: the real scheduler's StepShape) the roofline
(sim/cost_model.py Roofline, this hardware's catalog entry) predicts a time; the table gives measured/predicted
per step kind at the catalog defaults (MFU 0.5, MBU 0.8, 2 ms per step, 10 us per layer) and after fitting
MFU, MBU and the per-step overhead to the measured steps (sim/calibrate.py fit_roofline, what `tokenmill sim
calibrate` reports on a GPU of the catalog: a grid search on the median |log ratio|, ties broken by the mean), beside the
profile's own linear fit. What it says: how far the catalog entry is from this engine on that GPU, and which
term is off (compute-bound prefill, bandwidth-bound decode, fixed cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.sim.calibrate import fit_roofline  # noqa: E402
from tokenmill.sim.cost_model import FEATURES, Roofline, RooflineParams, StepShape, step_kind  # noqa: E402
from tokenmill.sim.hardware import get_hardware  # noqa: E402
from tokenmill.sim.models import get_model  # noqa: E402


def errors(pred: np.ndarray, meas: np.ndarray) -> tuple[float, float, float]:
    """(median measured/predicted, median |rel err|, p90 |rel err|)."""
    rel = np.abs(pred - meas) / meas
    return float(np.median(meas / pred)), float(np.median(rel)), float(np.percentile(rel, 90))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--model", default="llama-3.1-8b", help="catalog name or config.json of the calibrated model")
    ap.add_argument("--layers", type=int, help="the calibrated model kept this many of the model's layers")
    args = ap.parse_args(argv)
    prof = json.loads(Path(args.profile).read_text())
    if "sample_shapes" not in prof:
        print(f"{args.profile}: no sample_shapes (calibrated before they were recorded): calibrate again",
              file=sys.stderr)
        return 2
    shapes = [StepShape(*s) for s in prof["sample_shapes"]]
    meas = np.array([s[-1] for s in prof["samples"]])
    model = get_model(args.model)
    if args.layers:
        model = dataclasses.replace(model, layers=args.layers)
    hw = get_hardware(args.hardware)
    kinds = np.array([step_kind(s.prefill_tokens, s.decode_seqs) for s in shapes])
    lin = np.array([s.features() for s in shapes]) @ np.array(prof["coef"]) if prof["features"] == list(FEATURES) \
        else None

    def predict(p: RooflineParams) -> np.ndarray:
        r = Roofline(model, hw, p)
        return np.array([r.step_s(s) for s in shapes])

    default = RooflineParams()
    fit = fit_roofline(shapes, meas, model, hw)  # the same fit `tokenmill sim calibrate` reports on a GPU
    best = RooflineParams(mfu=fit["mfu"], mbu=fit["mbu"], step_overhead_s=fit["step_overhead_ms"] / 1000)
    print(f"# profile {args.profile}: {prof['isa']}; engine {prof['engine'].get('device', 'cpu')} "
          f"{prof['engine']['dtype']}, cuda_graphs={prof['engine'].get('cuda_graphs', False)}; {len(shapes)} steps")
    print(f"# model {model.name} ({model.layers} layers); hardware {hw.name} (catalog: "
          f"{hw.peak_flops('bf16') / 1e12:.0f} TFLOP/s bf16, {hw.hbm_bw / 1e12:.1f} TB/s)")
    print(f"# fitted roofline: MFU {best.mfu}, MBU {best.mbu}, step overhead {best.step_overhead_s * 1e3:.1f} ms")
    print("\n| step kind | steps | measured ms (median) | catalog roofline: measured/predicted | median abs err | "
          "p90 | fitted roofline: median abs err | p90 | profile's linear fit: median abs err | p90 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    pd, pb = predict(default), predict(best)
    for k in ("decode", "mixed", "prefill", "all"):
        m = np.ones(len(shapes), bool) if k == "all" else kinds == k
        if not m.any():
            continue
        r0, e0, q0 = errors(pd[m], meas[m])
        _, e1, q1 = errors(pb[m], meas[m])
        cells = [k, str(int(m.sum())), f"{np.median(meas[m]) * 1e3:.2f}", f"{r0:.2f}", f"{100 * e0:.0f}%",
                 f"{100 * q0:.0f}%", f"{100 * e1:.0f}%", f"{100 * q1:.0f}%"]
        if lin is not None:
            _, e2, q2 = errors(np.maximum(lin[m], 1e-9), meas[m])
            cells += [f"{100 * e2:.0f}%", f"{100 * q2:.0f}%"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
