"""Write a run's results: result.json (schema in docs/benchmarks/bench.md), requests.jsonl, summary.md,
and PNG plots (matplotlib, imported lazily with the Agg backend)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.bench.metrics import Distribution, Summary
from tokenmill.bench.record import RequestRecord
from tokenmill.bench.runner import LoadConfig
from tokenmill.bench.slo import SLO
from tokenmill.bench.sweep import SweepOutcome
from tokenmill.hardware import capabilities

SCHEMA_VERSION = 1
SEND_LAG_WARN_MS = 50.0


@dataclass
class RunResult:
    """One load level: its config, what every request measured, and the summaries."""

    label: str  # "rate=4", "concurrency=8", "trace"
    load: LoadConfig
    records: list[RequestRecord]
    summary: Summary
    classes: dict[str, Summary]
    plan_digest: str


@dataclass
class BenchResult:
    command: list[str]
    target: dict  # url, model, endpoint, prompt_format, models as listed by the server
    tokenizer: dict
    workload: dict
    seed: int
    slos: dict[str, SLO]
    runs: list[RunResult]
    sweep: SweepOutcome | None = None
    sweep_target: float | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def best(self) -> RunResult | None:
        """The single run, or for a sweep the run at the highest passing rate."""
        if self.sweep is None:
            return self.runs[0]
        passing = [r for r in self.runs if r.load.rate == self.sweep.max_rate]
        return passing[0] if passing else None


def write_report(result: BenchResult, out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    result.warnings.extend(_warnings(result))
    written = [out / "result.json", out / "summary.md"]
    (out / "result.json").write_text(json.dumps(to_json(result), indent=2) + "\n")
    for run in result.runs:
        path = out / "requests.jsonl" if result.sweep is None else out / "runs" / run.label / "requests.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for rec in sorted(run.records, key=lambda r: (r.session, r.turn)):
                f.write(json.dumps(rec.to_json()) + "\n")
        written.append(path)
    (out / "summary.md").write_text(markdown(result))
    if plots:
        try:
            written += write_plots(result, out)
        except ImportError as e:  # the results are written already; a missing plotting library costs only plots
            print(f"warning: plots skipped ({e}); result.json and summary.md are complete", file=sys.stderr)
    return written


def to_json(result: BenchResult) -> dict:
    best = result.best
    return {
        "schema_version": SCHEMA_VERSION,
        "command": result.command,
        "target": result.target,
        "tokenizer": result.tokenizer,
        "workload": result.workload,
        "seed": result.seed,
        "slos": {c: s.as_dict() for c, s in result.slos.items()},
        "load": asdict(best.load) if best else None,
        "plan_digest": best.plan_digest if best else None,
        "summary": best.summary.as_dict() if best else None,
        "classes": {c: s.as_dict() for c, s in best.classes.items()} if best else {},
        "sweep": None if result.sweep is None else {
            "target_attainment": result.sweep_target,
            "max_rate": result.sweep.max_rate,
            "bracketed": result.sweep.bracketed,
            "points": [{**asdict(p), "label": run.label, "plan_digest": run.plan_digest,
                        "summary": run.summary.as_dict(),
                        "classes": {c: s.as_dict() for c, s in run.classes.items()}}
                       for p, run in zip(result.sweep.points, result.runs)],
        },
        "warnings": result.warnings,
        "environment": {"client": capabilities().to_json()},  # the machine that ran the benchmark
    }


def _warnings(result: BenchResult) -> list[str]:
    notes = []
    if result.tokenizer["kind"] != "exact" or not result.tokenizer["text_exact"]:
        notes.append(f"prompt lengths: {result.tokenizer['note']}")
    for run in result.runs:
        s = run.summary
        if s.send_lag_ms and s.send_lag_ms.p99 > SEND_LAG_WARN_MS and run.load.mode != "concurrency":
            notes.append(f"{run.label}: the client fell behind its schedule (send lag p99 {s.send_lag_ms.p99:.0f} "
                         "ms); the offered load was lower than asked")
        max_len = _served_max_model_len(result)
        if max_len:
            over = sum(r.prompt_tokens + r.max_tokens > max_len for r in run.records)
            if over:
                notes.append(f"{run.label}: {over} of {len(run.records)} requests planned prompt + max_tokens over "
                             f"the server's max_model_len {max_len}: the server refuses or truncates them "
                             "(shorten the workload's prompts/outputs or serve a longer context)")
        errors: dict[str, int] = {}
        for rec in run.records:
            if rec.error:
                errors[rec.error[:120]] = errors.get(rec.error[:120], 0) + 1
        for error, n in sorted(errors.items(), key=lambda kv: -kv[1])[:3]:
            notes.append(f"{run.label}: {n} x {error}")
    return notes


def _served_max_model_len(result: BenchResult) -> int | None:
    """max_model_len of the benchmarked model as GET /v1/models reports it (vLLM and tokenmill do)."""
    for m in result.target.get("models") or []:
        if m.get("id") == result.target.get("model") and isinstance(m.get("max_model_len"), int):
            return m["max_model_len"]
    return None


def _ms(d: Distribution | None, *keys: str) -> str:
    return " / ".join(f"{getattr(d, k):.1f}" for k in keys) if d else "-"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _class_table(summaries: dict[str, Summary], slos: dict[str, SLO]) -> list[str]:
    lines = [
        "| class | SLO ttft/tpot ms | sent | done | rejected | failed | attainment | goodput req/s | goodput tok/s "
        "| tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p99 ms | e2e p50/p99 ms | cache hit |",
        "|" + "---|" * 15,
    ]
    for name, s in summaries.items():
        slo = slos.get(name, SLO()) if name != "all" else SLO()
        bound = " / ".join("-" if b is None else f"{b:g}" for b in (slo.ttft_ms, slo.tpot_ms))
        lines.append(
            f"| {name} | {bound} | {s.requests} | {s.completed} | {s.rejected} | {s.failed} | "
            f"{_pct(s.slo_attainment)} | {s.goodput:.2f} | {s.goodput_output_throughput:.1f} | "
            f"{s.output_throughput:.1f} | {_ms(s.ttft_ms, 'p50', 'p90', 'p99')} | "
            f"{_ms(s.tpot_ms, 'p50', 'p90', 'p99')} | {_ms(s.itl_ms, 'p50', 'p99')} | "
            f"{_ms(s.e2e_ms, 'p50', 'p99')} | {_pct(s.prefix_cache_hit_rate)} |")
    return lines


def markdown(result: BenchResult) -> str:
    t = result.target
    lines = [
        "# tokenmill bench",
        "",
        f"- command: `{' '.join(result.command)}`",
        f"- target: {t['url']} model `{t['model']}` ({t['endpoint']}, {t['prompt_format']} prompts)",
        f"- workload: `{json.dumps(result.workload['params'], default=str)}` ({result.workload['name']}), "
        f"seed {result.seed}",
        f"- tokenizer: {result.tokenizer['note']}",
    ]
    best = result.best
    if result.sweep is not None:
        bound = "" if result.sweep.bracketed else " (a lower bound: no failing rate was found)"
        lines += ["", f"## Sweep: max rate with SLO attainment >= {100 * result.sweep_target:.0f}%: "
                      f"**{result.sweep.max_rate:.3g} req/s**{bound}", "",
                  "| rate req/s | attainment | goodput req/s | throughput req/s | TTFT p90 ms | TPOT p90 ms |",
                  "|---|---|---|---|---|---|"]
        for run in sorted(result.runs, key=lambda r: r.load.rate):
            s = run.summary
            lines.append(f"| {run.load.rate:.3g} | {_pct(s.slo_attainment)} | {s.goodput:.2f} | "
                         f"{s.request_throughput:.2f} | {_ms(s.ttft_ms, 'p90')} | {_ms(s.tpot_ms, 'p90')} |")
    if best is not None:
        s = best.summary
        lines += ["", f"## Run `{best.label}` ({s.duration_s:.1f} s, plan {best.plan_digest})", "",
                  f"Goodput **{s.goodput:.2f} req/s** ({s.goodput_output_throughput:.1f} output tok/s), "
                  f"SLO attainment {_pct(s.slo_attainment)}, throughput {s.request_throughput:.2f} req/s "
                  f"({s.output_throughput:.1f} output tok/s, {s.input_throughput:.1f} prompt tok/s).", ""]
        lines += _class_table({**best.classes, "all": s}, result.slos)
    if result.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in result.warnings]
    return "\n".join(lines) + "\n"


def write_plots(result: BenchResult, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    best = result.best
    if best is not None and any(r.ok for r in best.records):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (title, get, bound) in zip(axes, [("TTFT", lambda r: r.ttft_s, "ttft_ms"),
                                                  ("TPOT", lambda r: r.tpot_s, "tpot_ms"),
                                                  ("e2e latency", lambda r: r.e2e_s, "e2e_ms")]):
            for cls in sorted({r.class_name for r in best.records}):
                ms = np.sort([get(r) * 1000 for r in best.records
                              if r.ok and r.class_name == cls and get(r) is not None])
                if ms.size:
                    line, = ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=cls)
                    slo = getattr(result.slos.get(cls, SLO()), bound)
                    if slo:
                        ax.axvline(slo, color=line.get_color(), linestyle="--", linewidth=1)
            ax.set(title=f"{title} CDF (dashed: SLO)", xlabel="ms", ylabel="fraction of requests")
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(_save(fig, out / "latency_cdf.png"))

        fig, ax = plt.subplots(figsize=(10, 4))
        for cls in sorted({r.class_name for r in best.records}):
            rs = [r for r in best.records if r.class_name == cls]
            ax.scatter([r.sent_s for r in rs if r.ok], [r.ttft_s * 1000 for r in rs if r.ok], s=6, label=cls)
            bad = [r.sent_s for r in rs if not r.ok]
            if bad:
                ax.scatter(bad, [0] * len(bad), marker="x", color="red", label=f"{cls}: rejected/failed")
        ax.set(title=f"TTFT over time ({best.label})", xlabel="send time (s)", ylabel="TTFT (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / "ttft_over_time.png"))

    if result.sweep is not None:
        runs = sorted(result.runs, key=lambda r: r.load.rate)
        rates = [r.load.rate for r in runs]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(rates, [r.summary.goodput for r in runs], "o-", label="goodput (req/s)")
        ax.plot(rates, [r.summary.request_throughput for r in runs], "s--", label="throughput (req/s)")
        ax.set(xlabel="offered rate (req/s)", ylabel="req/s", title="Goodput and SLO attainment vs rate")
        ax2 = ax.twinx()
        ax2.plot(rates, [100 * (r.summary.slo_attainment or 0) for r in runs], "^-", color="green",
                 label="attainment (%)")
        ax2.axhline(100 * result.sweep_target, color="green", linestyle=":", linewidth=1)
        ax2.set(ylabel="SLO attainment (%)", ylim=(0, 105))
        if result.sweep.max_rate:
            ax.axvline(result.sweep.max_rate, color="gray", linestyle="--", linewidth=1)
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper left")
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "sweep.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
