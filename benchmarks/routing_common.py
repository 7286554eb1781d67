"""Shared plumbing for the routing benchmarks: local tokenmill workers, a router, a `tokenmill bench` run.

Each run gets fresh workers (cold prefix caches), so policies are compared from the same start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def make_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        subprocess.run([PY, "-m", "tokenmill", "model", "make", "tiny", "--out", str(path), "--seed", "0"], check=True,
                       capture_output=True)
    return path


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f}s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextmanager
def workers(model: Path, n: int, base_port: int, kv_cache_size: str, log_dir: Path):
    """n `tokenmill serve` workers on base_port.. (one torch thread each); yields their URLs."""
    procs, urls = [], []
    try:
        for i in range(n):
            port = base_port + i
            log = open(log_dir / f"worker{i}.log", "w")
            procs.append(subprocess.Popen(
                [PY, "-m", "tokenmill", "serve", "--model", str(model), "--port", str(port), "--num-threads", "1",
                 "--kv-cache-size", kv_cache_size, "--admission", "off"], stdout=log, stderr=subprocess.STDOUT, env=ENV))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_http(url + "/health")
        yield urls
    finally:
        _stop(procs)


def warm_up(urls: list[str]) -> None:
    """One short request per worker, so torch's first-call costs are not in the measurement."""
    body = json.dumps({"prompt": "warm up " * 64, "max_tokens": 4}).encode()
    for url in urls:
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()


def router_env(checkout: str | None) -> tuple[dict, str | None]:
    """Environment and working directory for a `python -m tokenmill` that imports tokenmill from `checkout`.
    The working directory matters: `python -m` puts it first on sys.path, ahead of PYTHONPATH, so a router
    started from this repository's root with only PYTHONPATH=checkout ran this tree's code, not checkout's."""
    if checkout is None:
        return ENV, None
    root = str(Path(checkout).resolve())
    return {**ENV, "PYTHONPATH": root}, root


@contextmanager
def tokenmill_router(urls: list[str], port: int, policy: str, admission: str, log_dir: Path,
                     config: dict | None = None, checkout: str | None = None):
    """`tokenmill route` in front of `urls`; `checkout`: run the router from that source tree instead (an A/B
    of two versions side by side in one run)."""
    cfg_path = (log_dir / f"router-{policy}-{admission}.json").resolve()
    cfg_path.write_text(json.dumps({"workers": urls, "policy": policy, "port": port,
                                    "admission": {"mode": admission}, **(config or {})}))
    log = open(log_dir / f"router-{policy}-{admission}.log", "w")
    env, cwd = router_env(checkout)
    proc = subprocess.Popen([PY, "-m", "tokenmill", "route", "--config", str(cfg_path), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop([proc])


@contextmanager
def sglang_router(urls: list[str], port: int, python: str, log_dir: Path):
    """sglang-router's cache_aware policy (installed in its own venv: `python` is that venv's interpreter)."""
    log = open(log_dir / "sglang-router.log", "w")
    proc = subprocess.Popen([python, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy",
                             "cache_aware", "--port", str(port), "--host", "127.0.0.1", "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop([proc])


# sglang-router answers GET /v1/models with Content-Type text/plain, which `tokenmill bench` refuses to
# decode as JSON; for that target the bench runs with a lenient /v1/models reader patched in.
LENIENT_BENCH = """
import sys, aiohttp
import tokenmill.bench.benchmark as b
async def list_models(target, api_key=None, timeout_s=10.0):
    async with aiohttp.ClientSession() as http:
        async with http.get(target.rstrip('/') + '/v1/models') as r:
            return list((await r.json(content_type=None)).get('data') or [])
b.list_models = list_models
from tokenmill.cli import main
sys.exit(main(sys.argv[1:]))
"""


def bench(target: str, out: Path, model: Path, workloads: list[str], rate: float, duration_s: float,
          slo: str, seed: int = 0, listed_model: str | None = None) -> dict:
    """`listed_model`: the name the target lists in /v1/models when it is not the workers' (sglang-router
    lists "unknown"); the requests still name the workers' model."""
    launcher = [PY, "-m", "tokenmill"] if listed_model is None else [PY, "-c", LENIENT_BENCH]
    cmd = [*launcher, "bench", "--target", target, "--tokenizer", str(model),
           "--model", listed_model or model.name, "--extra-body", json.dumps({"model": model.name}),
           "--prompt-format", "text", "--rate", str(rate), "--duration", str(duration_s), "--slo", slo,
           "--seed", str(seed), "--out", str(out), "--no-plots", "--no-progress"]
    for w in workloads:
        cmd += ["--workload", w]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if done.returncode != 0:
        raise RuntimeError(f"tokenmill bench failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return json.loads((out / "result.json").read_text())


def worker_counters(url: str) -> dict[str, float]:
    """Cumulative counters of one tokenmill worker: requests, prompt tokens, prefix-cache hit tokens."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return {"requests": out.get("vllm:request_success_total", 0.0),
            "prompt_tokens": out.get("tokenmill_prompt_tokens_total", 0.0),
            "hit_tokens": out.get("tokenmill_prefix_cache_hits_tokens_total", 0.0)}


def router_estimates(url: str) -> dict[str, float]:
    """The tokenmill router's own view: estimated prefix-hit tokens vs cached tokens the workers reported."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    learned: dict[str, dict[str, float]] = {}  # per worker: the learned prefill fit
    decisions: dict[str, float] = {}  # "reason/cache" -> attempts
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if s.name == "tokenmill_router_route_decisions_total":
                decisions[f"{s.labels['reason']}/{s.labels['cache']}"] = s.value
            for gauge, key in (("worker_prefill_rate_tokens_per_second", "prefill_rate_tps"),
                               ("worker_prefill_overhead_seconds", "prefill_overhead_s"),
                               ("worker_ttft_calibration", "ttft_calibration"),
                               ("worker_ttft_error_ratio_p90", "ttft_error_p90"),
                               ("worker_ttft_slo_margin", "ttft_slo_margin")):
                if s.name == f"tokenmill_router_{gauge}":
                    learned.setdefault(s.labels.get("worker", ""), {})[key] = s.value
    return {**{k: out.get(f"tokenmill_router_{k}_total", 0.0) for k in
               ("estimated_prefix_hit_tokens", "reported_cached_tokens", "prompt_tokens", "retries")},
            "learned": learned, "decisions": decisions}


def row(name: str, result: dict, counters: list[dict[str, float]]) -> dict:
    s = result["summary"]
    reqs = [c["requests"] for c in counters]
    prompt = sum(c["prompt_tokens"] for c in counters)
    hits = sum(c["hit_tokens"] for c in counters)
    return {
        "router": name, "requests": s["requests"], "goodput": s["goodput"], "attainment": s["slo_attainment"],
        "success": s["completed"] / s["requests"] if s["requests"] else 0.0,
        "rejected": s["rejected"], "failed": s["failed"],
        "ttft_p50_ms": (s["ttft_ms"] or {}).get("p50"), "ttft_p90_ms": (s["ttft_ms"] or {}).get("p90"),
        "tpot_p90_ms": (s["tpot_ms"] or {}).get("p90"),
        "worker_hit_rate": hits / prompt if prompt else 0.0,
        "busiest_share": max(reqs) / sum(reqs) if sum(reqs) else 0.0,
        "per_worker": [int(r) for r in reqs],
    }


def table(rows: list[dict]) -> str:
    head = ("| router | goodput (req/s) | SLO attainment | success | TTFT p50 / p90 (ms) | TPOT p90 (ms) | "
            "prefix-cache hit rate | requests per worker, busiest first |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        ttft = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f}" if r["ttft_p90_ms"] is not None else "-"
        tpot = f"{r['tpot_p90_ms']:.0f}" if r["tpot_p90_ms"] is not None else "-"
        lines.append(f"| {r['router']} | {r['goodput']:.2f} | {100 * r['attainment']:.0f}% | "
                     f"{100 * r['success']:.0f}% | {ttft} | {tpot} | {100 * r['worker_hit_rate']:.0f}% | "
                     f"{' / '.join(map(str, sorted(r['per_worker'], reverse=True)))} |")
    return "\n".join(lines)


def check_port_free(port: int) -> None:
    import socket

    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(f"port {port} is in use; pick another --base-port")


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")

def wait_ready(p: subprocess.Popen, url: str, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"the server exited (rc {p.returncode}); its log {log}:\n{log.read_text()[-1500:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy within {timeout_s:.0f} s (log {log})")
