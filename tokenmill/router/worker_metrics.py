"""Parse a worker's Prometheus /metrics into the few gauges the router uses (tokenmill, vLLM, SGLang).

The scrape runs every `health_interval_s` per worker, on the same cores as the workers in small setups, so
this is a line scanner, not `prometheus_client.parser` (~12 ms per tokenmill scrape on a slow core, most of
the router's idle CPU): a sample line is matched by one regex, only the gauges below keep their values,
and every line must still be a comment, blank, or `name[{labels}] value [timestamp]` (else ValueError).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")  # all 0..1
QUEUED_PREFILL = ("tokenmill_waiting_uncached_prompt_tokens",)  # prefill work queued at the worker (tokens)
WANTED = frozenset(RUNNING + WAITING + KV_USAGE + QUEUED_PREFILL)
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?[ \t]+([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*")
_COMMENT = re.compile(r"#[ \t]+(?:HELP|TYPE)[ \t]+([a-zA-Z_:][a-zA-Z0-9_:]*)")


@dataclass(frozen=True)
class WorkerGauges:
    kind: str  # "tokenmill" | "vllm" | "sglang" | "openai" (no known metric names)
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    queued_prefill_tokens: int | None = None  # uncached prompt tokens in the worker's waiting queue


def parse_worker_metrics(text: str) -> WorkerGauges:
    """Sum each gauge over its label sets (several models or DP ranks); ValueError on unparsable text."""
    values: dict[str, float] = {}
    names: set[str] = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line[0] == "#":
            m = _COMMENT.match(line)
            if m:
                names.add(m.group(1))
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line[:80]!r}")
        name, value = m.group(1), float(m.group(2))  # float() raises ValueError on a bad value
        names.add(name)
        if name in WANTED:
            values[name] = values.get(name, 0.0) + value

    def first(candidates) -> float | None:
        return next((values[n] for n in candidates if n in values), None)

    running, waiting, queued = first(RUNNING), first(WAITING), first(QUEUED_PREFILL)
    return WorkerGauges(
        kind=_kind(names),
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_usage=first(KV_USAGE),
        queued_prefill_tokens=None if queued is None else int(queued),
    )


def _kind(names) -> str:
    if any(n.startswith("tokenmill") for n in names):
        return "tokenmill"
    if any(n.startswith("sglang:") for n in names):
        return "sglang"
    if any(n.startswith("vllm:") for n in names):
        return "vllm"
    return "openai"
