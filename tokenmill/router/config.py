"""RouterConfig: everything `tokenmill route` can be told, validated at construction.

A config file (JSON, or TOML on Python >= 3.11) mirrors the dataclasses; unknown keys are errors:

    {"workers": ["http://127.0.0.1:8001", {"url": "http://10.0.0.2:8000", "kind": "vllm"}],
     "policy": "prefix-load", "port": 8080,
     "classes": [{"name": "interactive", "ttft_slo_s": 0.5}],      # overrides fields of a default class
     "api_keys": {"sk-batch-team": "batch"},
     "admission": {"mode": "leading"}, "policy_params": {"guard_abs": 4},
     "prefix_index": {"chunk_chars": 64}, "rate_priors": {"prefill_rate_tps": 4096},
     "worker_dns": ["tokenmill-workers.default.svc.cluster.local:8000"], "dns_interval_s": 5, "epp_port": 9002}
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.router.admission import AdmissionConfig
from tokenmill.router.discovery import DnsTarget
from tokenmill.router.classes import DEFAULT_CLASSES, WorkloadClass
from tokenmill.router.policies import POLICIES, PolicyParams
from tokenmill.router.prefix_index import PrefixIndexConfig
from tokenmill.router.rates import RatePriors
from tokenmill.router.worker_state import WorkerSpec


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[WorkerSpec, ...] = ()  # may start empty: workers can be added at runtime
    policy: str = "prefix-load"
    host: str = "127.0.0.1"
    port: int = 8080
    classes: tuple[WorkloadClass, ...] = DEFAULT_CLASSES
    default_class: str = "interactive"
    api_keys: tuple[tuple[str, str], ...] = ()  # (API key, class name)
    policy_params: PolicyParams = field(default_factory=PolicyParams)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    prefix_index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    rate_priors: RatePriors = field(default_factory=RatePriors)
    health_interval_s: float = 1.0  # GET /health and /metrics of every worker this often
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2  # consecutive failed checks (a refused connection counts at once)
    max_attempts: int = 3  # per request: tries on distinct workers while no token has been sent
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 300.0  # an attempt without a first token by then is retried elsewhere
    read_timeout_s: float = 300.0  # longest gap between two chunks of a stream
    max_body_bytes: int = 16 * 2**20
    max_in_flight: int = 4096  # requests in flight + held, router-wide (then 503): nothing is unbounded
    worker_dns: tuple[DnsTarget, ...] = ()  # live discovery: every A/AAAA record of NAME is a worker at PORT
    dns_interval_s: float = 5.0  # re-resolve worker_dns this often (discovery.py)
    epp_port: int | None = None  # also serve Envoy ext_proc (Gateway API Inference Extension EPP) here, on `host`
    epp_transport: str = "frames"  # the EPP's gRPC server: frames (epp_h2.py on grpc_frames.py), h2 (epp_h2.py on
    # the h2 library) or grpcio (grpc.aio, the reference)
    epp_trace: str | None = None  # diagnostics: every EPP stream's hop time stamps (CLOCK_MONOTONIC ns: the socket
    # read that carried its request, the decision's start and end, the write of its answer) as CSV to this file at
    # shutdown (frames transport only; benchmarks/epp_latency.py --hops joins them with its client's)
    # what a decision reads: "table" (columns kept up to date per changed worker + prefix holders,
    # router/worker_table.py, table_decisions.py; same decisions) or "full" (a WorkerView of every worker)
    snapshot: str = "table"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from {', '.join(sorted(POLICIES))}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"workload class names must be unique and non-empty, got {names}")
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not a workload class ({', '.join(names)})")
        for key, cls in self.api_keys:
            if cls not in names:
                raise ValueError(f"api_keys maps a key to unknown class {cls!r} ({', '.join(names)})")
        urls = [w.url for w in self.workers]
        if len(set(urls)) != len(urls):
            raise ValueError("a worker URL is listed twice")
        if self.epp_port is not None and not 0 <= self.epp_port <= 65535:
            raise ValueError(f"epp_port must be in 0..65535, got {self.epp_port}")
        if self.snapshot not in ("table", "full"):
            raise ValueError(f"unknown snapshot {self.snapshot!r}; choose from table, full")
        if self.epp_transport not in ("frames", "h2", "grpcio"):
            raise ValueError(f"unknown epp_transport {self.epp_transport!r}; choose from frames, h2, grpcio")
        if self.epp_trace is not None and self.epp_transport != "frames":
            raise ValueError(f"epp_trace needs epp_transport frames (got {self.epp_transport!r})")
        for name in ("dns_interval_s", "health_interval_s", "health_timeout_s", "connect_timeout_s", "first_token_timeout_s",
                     "read_timeout_s"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be > 0")
        if self.unhealthy_after < 1 or self.max_attempts < 1 or self.max_in_flight < 1 or self.max_body_bytes < 1:
            raise ValueError("unhealthy_after, max_attempts, max_in_flight and max_body_bytes must be >= 1")

    def class_of_key(self, api_key: str) -> str | None:
        return dict(self.api_keys).get(api_key)


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a table/object, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**data)
    except TypeError as e:  # a missing required field
        raise ValueError(f"{where}: {e}") from None


def _classes(items) -> tuple[WorkloadClass, ...]:
    if not isinstance(items, list):
        raise ValueError("classes must be a list of tables/objects")
    out = {c.name: c for c in DEFAULT_CLASSES}
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "name" not in item:
            raise ValueError(f"classes[{i}] needs a 'name'")
        base = out.get(item["name"])
        merged = {**dataclasses.asdict(base), **item} if base else item
        out[item["name"]] = _build(WorkloadClass, merged, f"classes[{i}]")
    return tuple(out.values())


def _worker(item, i: int) -> WorkerSpec:
    if isinstance(item, str):
        return WorkerSpec.parse(item)
    return _build(WorkerSpec, item, f"workers[{i}]")


def config_from_dict(data: dict) -> RouterConfig:
    if not isinstance(data, dict):
        raise ValueError("the router config must be a table/object")
    data = dict(data)
    nested = {"policy_params": PolicyParams, "admission": AdmissionConfig, "prefix_index": PrefixIndexConfig,
              "rate_priors": RatePriors}
    for key, cls in nested.items():
        if key in data:
            data[key] = _build(cls, data[key], key)
    if "classes" in data:
        data["classes"] = _classes(data["classes"])
    if "workers" in data:
        data["workers"] = tuple(_worker(w, i) for i, w in enumerate(data["workers"]))
    if "worker_dns" in data:
        if not isinstance(data["worker_dns"], list):
            raise ValueError("worker_dns must be a list of \"[KIND=]NAME:PORT\" strings")
        data["worker_dns"] = tuple(DnsTarget.parse(str(t)) for t in data["worker_dns"])
    if "api_keys" in data:
        if not isinstance(data["api_keys"], dict):
            raise ValueError("api_keys must map API key -> class name")
        data["api_keys"] = tuple(sorted(data["api_keys"].items()))
    return _build(RouterConfig, data, "router config")


def load_config(path: str | Path) -> RouterConfig:
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:
            raise ValueError("TOML router configs need Python >= 3.11; use JSON") from None
        data = tomllib.loads(text)
    else:
        data = json.loads(text)
    return config_from_dict(data)
