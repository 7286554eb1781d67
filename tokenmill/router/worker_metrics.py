"""Parse a worker's Prometheus /metrics into the few gauges the router uses (tokenmill, vLLM, SGLang)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")  # all 0..1


@dataclass(frozen=True)
class WorkerGauges:
    kind: str  # "tokenmill" | "vllm" | "sglang" | "openai" (no known metric names)
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None


def parse_worker_metrics(text: str) -> WorkerGauges:
    """Sum each gauge over its label sets (several models or DP ranks); ValueError on unparsable text."""
    values: dict[str, float] = {}
    names: list[str] = []
    for family in text_string_to_metric_families(text):
        names.append(family.name)
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value

    def first(candidates) -> float | None:
        return next((values[n] for n in candidates if n in values), None)

    running, waiting = first(RUNNING), first(WAITING)
    return WorkerGauges(
        kind=_kind(names),
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_usage=first(KV_USAGE),
    )


def _kind(names: list[str]) -> str:
    if any(n.startswith("tokenmill") for n in names):
        return "tokenmill"
    if any(n.startswith("sglang:") for n in names):
        return "sglang"
    if any(n.startswith("vllm:") for n in names):
        return "vllm"
    return "openai"
