"""BenchConfig: every setting of one `tokenmill bench` invocation, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.runner import LoadConfig
from tokenmill.bench.slo import parse_slo
from tokenmill.bench.sweep import SweepConfig
from tokenmill.bench.workloads import workload_class
from tokenmill.cli import CLIError

DEFAULT_NUM_REQUESTS = 100  # when neither --duration nor --num-requests is given (traces: the whole trace)


@dataclass(frozen=True)
class BenchConfig:
    target: str
    out: Path
    workloads: tuple[str, ...] = ("chat",)  # several: a mix, SPEC[@WEIGHT] each
    model: str | None = None  # None: the first model GET /v1/models lists
    tokenizer: str | None = None  # None: the model directory when --model is one, else approximate
    endpoint: str = "completions"
    prompt_format: str | None = None  # None: tokens with a tokenizer on completions, else text
    load: LoadConfig = field(default_factory=lambda: LoadConfig("rate", rate=1.0, num_requests=DEFAULT_NUM_REQUESTS))
    sweep: SweepConfig | None = None
    slos: tuple[str, ...] = ()
    seed: int = 0
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    progress: bool = True
    plots: bool = True
    command: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.target.startswith(("http://", "https://")):
            raise CLIError(f"--target {self.target!r}: expected a URL such as http://127.0.0.1:8000")
        for spec in self.workloads:
            workload_class(spec.rpartition("@")[0] if len(self.workloads) > 1 and "@" in spec else spec)
        for spec in self.slos:
            parse_slo(spec)  # raises CLIError on a bad spec
        if self.out.exists() and not self.out.is_dir():
            raise CLIError(f"--out {self.out}: exists and is not a directory")

    @staticmethod
    def from_args(args) -> BenchConfig:
        workloads, load, sweep = load_from_args(args)
        try:
            extra = json.loads(args.extra_body) if args.extra_body else {}
        except json.JSONDecodeError as e:
            raise CLIError(f"--extra-body: not JSON ({e})") from None
        if not isinstance(extra, dict):
            raise CLIError("--extra-body: expected a JSON object")
        return BenchConfig(
            target=args.target, out=Path(args.out), workloads=workloads, model=args.model,
            tokenizer=args.tokenizer, endpoint=args.endpoint, prompt_format=args.prompt_format, load=load,
            sweep=sweep, slos=tuple(args.slo or ()), seed=args.seed, ignore_eos=not args.no_ignore_eos,
            request_timeout_s=args.request_timeout, api_key=args.api_key, extra_body=extra,
            progress=args.progress, plots=not args.no_plots, command=tuple(args.command_line))


def load_from_args(args) -> tuple[tuple[str, ...], LoadConfig, SweepConfig | None]:
    """The workload specs, load level and sweep of the shared flags (bench/cli.add_workload_args): `tokenmill
    bench` and `tokenmill sim` read them the same way."""
    workloads = tuple(args.workload or ["chat"])
    finite = len(workloads) == 1 and workload_class(workloads[0]).finite
    num_requests = args.num_requests
    if num_requests is None and args.duration is None and not finite:
        num_requests = DEFAULT_NUM_REQUESTS
    if args.sweep and args.concurrency is not None:
        raise CLIError("--sweep searches a request rate; it cannot be combined with --concurrency")
    if args.concurrency is not None:
        mode = "concurrency"
    elif args.rate is not None or args.sweep:
        mode = "rate"
    elif finite:
        mode = "trace"
    else:
        raise CLIError("give the load: --rate R (requests/s), --concurrency C, or --sweep")
    rate = args.rate if args.rate is not None else (1.0 if args.sweep else None)
    load = LoadConfig(mode, rate=rate, concurrency=args.concurrency, arrival=args.arrival,
                      burstiness=args.burstiness, duration_s=args.duration, num_requests=num_requests)
    sweep = SweepConfig(target=args.sweep_target, start_rate=rate, max_trials=args.sweep_trials,
                        rel_tol=args.sweep_tol) if args.sweep else None
    return workloads, load, sweep
