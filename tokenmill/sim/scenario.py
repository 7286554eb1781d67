"""`tokenmill sim scenario NAME|FILE`: a shipped comparison of `tokenmill sim` runs, side by side.

A scenario is a JSON file (tokenmill/sim/scenarios/*.json, or any path):

    {"name": ..., "description": ..., "documented": "docs/benchmarks/sim.md#...",
     "common": [tokenmill sim flags every run takes],
     "runs": [{"name": "row label", "args": [this run's flags]}, ...],
     "quick": [flags appended with --quick: a shorter run for a smoke check]}

Each run is exactly `tokenmill sim COMMON ARGS --out OUT/NN-slug` (its result.json / summary.md as any sim run's);
the table beside them compares the rows (goodput, throughput, TTFT, TPOT, cost, cache hits, speculation) and is
written to OUT/scenario.md. The documented result of each shipped scenario is in docs/benchmarks/sim.md.
"""

from __future__ import annotations

import json
import re
import shlex
from importlib import resources
from pathlib import Path

from tokenmill.cli import CLIError

SCENARIO_KEYS = {"name", "description", "documented", "common", "runs", "quick"}


def shipped() -> dict[str, Path]:
    root = resources.files("tokenmill.sim") / "scenarios"
    return {p.name[:-5]: Path(str(p)) for p in root.iterdir() if p.name.endswith(".json")}


def load(name_or_path: str) -> dict:
    known = shipped()
    path = known.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise CLIError(f"scenario {name_or_path!r}: not a shipped scenario ({', '.join(sorted(known))}) nor a file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(f"scenario {path}: {e}") from None
    if not isinstance(data, dict) or not SCENARIO_KEYS >= set(data) or "runs" not in data:
        raise CLIError(f"scenario {path}: a JSON object with keys among {sorted(SCENARIO_KEYS)} and `runs`")
    runs = data["runs"]
    if not isinstance(runs, list) or not runs or not all(
            isinstance(r, dict) and set(r) == {"name", "args"} and _strings(r["args"]) for r in runs):
        raise CLIError(f"scenario {path}: runs must be a non-empty list of {{\"name\", \"args\": [flags]}}")
    for key in ("common", "quick"):
        if not _strings(data.get(key, [])):
            raise CLIError(f"scenario {path}: {key} must be a list of strings")
    return data


def _strings(x) -> bool:
    return isinstance(x, list) and all(isinstance(a, str) for a in x)


def _slug(i: int, name: str) -> str:
    return f"{i:02d}-" + (re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "run")


def _row(name: str, result, sim: dict) -> dict:
    best = result.best or (result.runs[-1] if result.runs else None)
    s = best.summary if best is not None else None
    level = sim["levels"][result.runs.index(best)] if best is not None else {}
    spec = level.get("spec") or {}
    cost = level.get("cost") or {}

    def p(d, q):
        return getattr(d, q) if d is not None else None

    return {"run": name, "load": best.label if best is not None else None,
            "completed": s.completed if s else 0, "rejected": s.rejected if s else 0,
            "attainment": s.slo_attainment if s else None, "goodput_req_s": s.goodput if s else None,
            "output_tok_s": s.output_throughput if s else None,
            "ttft_p50_ms": p(s.ttft_ms, "p50") if s else None, "ttft_p90_ms": p(s.ttft_ms, "p90") if s else None,
            "tpot_p50_ms": p(s.tpot_ms, "p50") if s else None,
            "cache_hit": s.prefix_cache_hit_rate if s else None,
            "spec_acceptance": spec.get("acceptance_rate"),
            "usd_per_m_tokens": cost.get("per_million_tokens"),
            "usd_per_m_output": cost.get("per_million_output_tokens"),
            "max_rate": result.sweep.max_rate if result.sweep is not None else None}


COLUMNS = [("run", "run", "{}"), ("load", "load", "{}"), ("completed", "done", "{}"), ("rejected", "429/503", "{}"),
           ("attainment", "SLO att.", "{:.1%}"), ("goodput_req_s", "goodput req/s", "{:.2f}"),
           ("output_tok_s", "output tok/s", "{:.0f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
           ("ttft_p90_ms", "TTFT p90 ms", "{:.1f}"), ("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"),
           ("cache_hit", "cache hit", "{:.1%}"), ("spec_acceptance", "draft acc.", "{:.1%}"),
           ("usd_per_m_tokens", "$/M tok", "{:.3g}"), ("usd_per_m_output", "$/M output tok", "{:.3g}"), ("max_rate", "max rate", "{:.3g}")]


def table(rows: list[dict]) -> str:
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    out = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join("-" if r.get(k) is None else fmt.format(r[k]) for k, _, fmt in cols) + " |")
    return "\n".join(out)


def run_scenario(name_or_path: str, out: Path, quick: bool = False, only: list[str] | None = None,
                 log=print) -> list[dict]:
    import argparse
    import dataclasses

    from tokenmill.hardware import capabilities
    from tokenmill.sim.cli import add_parser, build_config, simulate_and_write

    data = load(name_or_path)
    parser = argparse.ArgumentParser(prog="tokenmill")
    add_parser(parser.add_subparsers(dest="command"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = [r for r in data["runs"] if only is None or r["name"] in only]
    if only is not None and len(runs) != len(only):
        raise CLIError(f"--only: no run named {sorted(set(only) - {r['name'] for r in data['runs']})} in the "
                       f"scenario (runs: {[r['name'] for r in data['runs']]})")
    for i, r in enumerate(runs):
        argv = ["sim", *data.get("common", []), *r["args"], *(data.get("quick", []) if quick else []),
                "--out", str(out / _slug(i, r["name"]))]
        log(f"[{i + 1}/{len(runs)}] {r['name']}: tokenmill {shlex.join(argv)}")
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            raise CLIError(f"scenario run {r['name']!r}: bad flags {shlex.join(argv)}") from None
        if getattr(args, "sim_command", None):
            raise CLIError(f"scenario run {r['name']!r}: a run is a simulation, not `sim {args.sim_command}`")
        cfg = dataclasses.replace(build_config(args), command=("tokenmill", *argv))
        result, sim = simulate_and_write(cfg)
        rows.append(_row(r["name"], result, sim))
    text = (f"# Scenario {data.get('name', name_or_path)}\n\n{data.get('description', '')}\n\n"
            f"Machine running the simulation: {capabilities().summary()}\n"
            + (f"Documented result: {data['documented']}\n" if data.get("documented") else "")
            + ("(--quick: shortened runs, a smoke check; not the documented numbers)\n" if quick else "")
            + "\n" + table(rows) + "\n")
    (out / "scenario.md").write_text(text)
    (out / "scenario.json").write_text(json.dumps({"scenario": data, "quick": quick, "rows": rows}, indent=2) + "\n")
    log(text)
    return rows
