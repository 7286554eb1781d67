"""One benchmark: find the model and tokenizer, plan the workload, run one load level or a sweep."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from tokenmill.bench.client import Client, ClientConfig, Clock, base_url, list_models
from tokenmill.bench.config import BenchConfig
from tokenmill.bench.metrics import run_duration, summarize, summarize_by_class
from tokenmill.bench.progress import Progress
from tokenmill.bench.record import RequestRecord
from tokenmill.bench.report import BenchResult, RunResult
from tokenmill.bench.runner import LoadConfig, run_load, schedule
from tokenmill.bench.slo import resolve_slos
from tokenmill.bench.sweep import SweepPoint, find_max_rate
from tokenmill.bench.tokenizer import PromptVocab, find_tokenizer, load_vocab
from tokenmill.bench.workloads import Workload, make_workload
from tokenmill.bench.workloads.mix import Mix
from tokenmill.cli import CLIError


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    models = await list_models(cfg.target, cfg.api_key)
    served = [m.get("id") for m in models]
    model = cfg.model or (served[0] if served else None)
    if model is None:
        raise CLIError(f"{cfg.target} lists no models; pass --model NAME")
    if cfg.model and served and cfg.model not in served:
        raise CLIError(f"--model {cfg.model!r} is not served by {cfg.target}; it serves {', '.join(served)}")
    vocab = load_vocab(find_tokenizer(cfg.tokenizer, model), cfg.seed)
    workload = make_workload(cfg.workloads[0], vocab, cfg.seed) if len(cfg.workloads) == 1 else \
        Mix.of_specs(list(cfg.workloads), vocab, cfg.seed)
    prompt_format = cfg.prompt_format or ("tokens" if vocab.exact and cfg.endpoint == "completions" else "text")
    client_cfg = ClientConfig(cfg.target, model, cfg.endpoint, prompt_format, cfg.ignore_eos,
                              cfg.request_timeout_s, cfg.api_key, cfg.extra_body)
    slos = resolve_slos(list(cfg.slos), workload.classes)
    result = BenchResult(
        command=list(cfg.command), seed=cfg.seed, slos=slos, runs=[], tokenizer=vocab.describe(),
        workload=workload.describe(),
        target={"url": base_url(cfg.target), "model": model, "endpoint": cfg.endpoint,
                "prompt_format": prompt_format, "models": models},
    )

    async def run_at(load: LoadConfig) -> RunResult:
        run = await run_level(client_cfg, vocab, workload, load, cfg, slos)
        result.runs.append(run)
        return run

    if cfg.sweep is None:
        await run_at(cfg.load)
        return result

    async def trial(rate: float) -> SweepPoint:
        run = await run_at(replace(cfg.load, mode="rate", rate=rate))
        return SweepPoint(rate, run.summary.slo_attainment or 0.0, run.summary.goodput)

    result.sweep = await find_max_rate(trial, cfg.sweep)
    result.sweep_target = cfg.sweep.target
    return result


async def run_level(client_cfg: ClientConfig, vocab: PromptVocab, workload: Workload, load: LoadConfig,
                    cfg: BenchConfig, slos) -> RunResult:
    progress = Progress(load.num_requests, load.duration_s, f"{load.label} ", enabled=cfg.progress)
    plan = schedule(workload, load, cfg.seed)
    if load.num_requests is not None and not workload.finite:
        plan = iter(list(plan))  # plan up front so planning never delays a send (traces plan lazily: size)
    async with Client(client_cfg, vocab, Clock()) as client:
        client.clock = Clock()  # t = 0: the first request is due now
        records = await run_load(client, plan, load, progress)
    duration = run_duration(records)
    return RunResult(load.label, load, records, summarize(records, slos, duration),
                     summarize_by_class(records, slos, duration), plan_digest(records, load))


def plan_digest(records: list[RequestRecord], load: LoadConfig) -> str:
    """Identifies the requests sent (prompts, max_tokens, and open-loop start times): equal for equal plans."""
    h = hashlib.sha256()
    for rec in sorted(records, key=lambda r: (r.session, r.turn)):
        start = f"{rec.scheduled_s:.6f}" if rec.turn == 0 and load.mode != "concurrency" else ""
        h.update(f"{rec.request_id} {rec.class_name} {rec.digest} {start}\n".encode())
    return h.hexdigest()[:16]
