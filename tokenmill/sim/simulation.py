"""`tokenmill sim`: plan the bench's workload, run one load level or a sweep on simulated workers, and
write the bench's result.json / summary.md / plots (bench/report.py), plus a `sim` section (cost model,
cluster, events per second, cost per million tokens)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tokenmill.bench.benchmark import plan_digest
from tokenmill.bench.metrics import run_duration, summarize, summarize_by_class
from tokenmill.bench.report import BenchResult, RunResult
from tokenmill.bench.runner import LoadConfig, schedule
from tokenmill.bench.slo import SLO, resolve_slos
from tokenmill.bench.sweep import SweepConfig, SweepPoint, find_max_rate
from tokenmill.bench.tokenizer import approximate_vocab, find_tokenizer, load_vocab
from tokenmill.bench.workloads import make_workload
from tokenmill.bench.workloads.mix import Mix
from tokenmill.cli import CLIError
from tokenmill.router.config import RouterConfig
from tokenmill.router.prefix_index import PrefixIndexConfig
from tokenmill.sim.cluster import ClusterSim, LevelStats
from tokenmill.sim.cost_model import Calibrated, CostModel, Roofline, RooflineParams
from tokenmill.sim.hardware import get_hardware
from tokenmill.sim.models import CATALOG as MODEL_CATALOG
from tokenmill.sim.models import ModelShape, get_model
from tokenmill.sim.spec import Acceptance, SpecSimConfig
from tokenmill.sim.tiers import TierConfig, TierIO
from tokenmill.sim.worker import WorkerConfig


@dataclass(frozen=True)
class SimConfig:
    model: str
    hardware: str  # a calibration profile (JSON) or a catalog GPU
    out: Path
    workers: int = 1
    router: RouterConfig = field(default_factory=RouterConfig)
    workloads: tuple[str, ...] = ("chat",)
    load: LoadConfig = field(default_factory=lambda: LoadConfig("rate", rate=1.0, num_requests=100))
    sweep: SweepConfig | None = None
    slos: tuple[str, ...] = ()
    seed: int = 0
    plots: bool = True
    roofline: RooflineParams = field(default_factory=RooflineParams)
    kv_cache_bytes: int | None = None  # per worker; default: calibrated -> the profile's engine, roofline -> HBM left
    block_size: int | None = None  # KV block tokens; None: block_size_for(workload) (a Mooncake trace's 512)
    max_num_batched_tokens: int | None = None  # default: the profile's engine (calibrated), else 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    step_budget: bool = True
    fast_forward: bool = True  # steady decode steps in one event (sim/decode_run.py): same results, faster
    token_free: bool = False  # Mooncake trace prompts by their hash_ids block names, no token ids (token_free_workload)
    price_per_hour: float | None = None  # per GPU
    record_chunks: bool = True  # every token's time (ITL); off for very large runs
    # speculative decoding (sim/spec.py), `tokenmill serve`'s flags: ngram | a draft model (catalog name or
    # config.json: a roofline of it on --hardware; on a calibration profile: the draft's own profile JSON)
    speculative_model: str | None = None
    num_speculative_tokens: int | str | None = None  # K | "auto"
    speculative_max_k: int | None = None
    spec_acceptance: str | None = None  # ALPHA[:span=L]: what drafts get right (sim/spec.py Acceptance)
    spec_lookup_us: float = 15.0  # n-gram: microseconds per lookup
    # KV tiers below the pool (sim/tiers.py; the server's --kv-host-bytes / --kv-disk-bytes); 0: off
    kv_host_bytes: int = 0  # per worker, or the cluster's one host tier with kv_host_shared
    kv_disk_bytes: int = 0  # per worker
    kv_host_shared: bool = False
    kv_load_timeout_s: float = 1.0
    tier_io: dict = field(default_factory=dict)  # TierIO overrides (bytes/s, s); link_bw default: the GPU's PCIe
    command: tuple[str, ...] = ()

    def __post_init__(self):
        if self.workers < 1:
            raise CLIError("--workers must be >= 1")
        if self.price_per_hour is not None and not self.price_per_hour >= 0:
            raise CLIError("--price-per-hour must be >= 0")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise CLIError("--kv-cache-bytes must be > 0")
        if self.block_size is not None and self.block_size < 1:
            raise CLIError("--block-size must be >= 1")
        on = [self.speculative_model is not None, self.num_speculative_tokens is not None]
        if any(on) and not all(on):
            raise CLIError("speculative decoding needs both --speculative-model and --num-speculative-tokens")
        if (self.speculative_max_k is not None or self.spec_acceptance is not None) and not all(on):
            raise CLIError("--speculative-max-k / --spec-acceptance need --speculative-model and "
                           "--num-speculative-tokens")
        if all(on) and self.spec_acceptance is None:
            raise CLIError("simulated speculative decoding needs --spec-acceptance ALPHA[:span=L] (the share of "
                           "output positions a draft gets right; the sim has no model to measure it)")
        if self.kv_host_bytes < 0 or self.kv_disk_bytes < 0:
            raise CLIError("--kv-host-bytes and --kv-disk-bytes must be >= 0")
        if self.kv_host_shared and not self.kv_host_bytes:
            raise CLIError("--kv-host-shared needs --kv-host-bytes")
        if (self.kv_host_bytes or self.kv_disk_bytes) and not self.enable_prefix_caching:
            raise CLIError("KV tiers (--kv-host-bytes / --kv-disk-bytes) need prefix caching (blocks are found by "
                           "their hash)")
        if (self.kv_host_bytes or self.kv_disk_bytes) and self.token_free:
            raise CLIError("--token-free with KV tiers is not supported (tier keys hash token ids)")
        if not self.kv_load_timeout_s > 0:
            raise CLIError("--kv-load-timeout-s must be > 0")


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block, as the engine's (EngineConfig.block_size) and vLLM's GPU default


def block_size_for(workload) -> tuple[int, str]:
    """The simulated KV block size when --block-size is not given, and why. A Mooncake trace names its
    prompts' shared prefixes only per 512-token `hash_ids` block, so finer blocks cannot find more sharing
    in it: the sim uses the trace's block (32x fewer block hashes, allocations and prefix lookups than 16)
    and says so in its output. Everything else: the engine's 16."""
    from tokenmill.bench.workloads.trace import BLOCK_TOKENS, Trace

    if isinstance(workload, Trace) and workload.rows[0].hash_ids is not None:
        return BLOCK_TOKENS, f"auto: the Mooncake trace's hash block ({BLOCK_TOKENS} tokens)"
    return DEFAULT_BLOCK_SIZE, "auto: the engine's default"


def token_free_workload(workload, block_size: int, chunk_tokens: int):
    """`--token-free`: the Mooncake trace's prompts as named blocks (its hash_ids) instead of synthesized token
    ids -- the real scheduler, KV manager and router run on them (engine/kv/named_tokens.py), with the same
    results as on the ids except for chance coincidences with the placeholder output token; the records' digest
    is then of the names. Needs the trace's own block size for the KV blocks and the router's chunks."""
    from tokenmill.bench.workloads.trace import BLOCK_TOKENS, Trace

    if not isinstance(workload, Trace):
        raise CLIError("--token-free replays a Mooncake trace (--workload trace:FILE.jsonl) only")
    try:
        workload = workload.named()
    except ValueError as e:
        raise CLIError(f"--token-free: {e}") from None
    if block_size != BLOCK_TOKENS or chunk_tokens != BLOCK_TOKENS:
        raise CLIError(f"--token-free needs the trace's {BLOCK_TOKENS}-token blocks: KV --block-size {block_size}, "
                       f"router chunk {chunk_tokens} tokens")
    return workload


@dataclass
class Built:
    cost: CostModel
    shape: ModelShape
    worker: WorkerConfig
    gpus_per_worker: int
    hardware_name: str
    draft_cost: CostModel | None = None  # speculative decoding with a draft model: its forward passes


def _num_spec(value) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CLIError(f"--num-speculative-tokens {value!r}: an integer or auto") from None


def _spec(cfg: "SimConfig", hw) -> tuple[SpecSimConfig | None, CostModel | None, ModelShape | None, float]:
    """(spec config, the draft's cost model, the draft's shape, its KV bytes per value) or Nones: off."""
    if cfg.speculative_model is None:
        return None, None, None, 0.0
    kind = "ngram" if cfg.speculative_model == "ngram" else "draft"
    spec = SpecSimConfig(kind, _num_spec(cfg.num_speculative_tokens), Acceptance.parse(cfg.spec_acceptance),
                         cfg.speculative_max_k, cfg.spec_lookup_us * 1e-6, cfg.seed)
    if kind == "ngram":
        return spec, None, None, 0.0
    if hw is None:  # a calibration profile: the draft's own profile on this machine
        if not is_profile(cfg.speculative_model):
            raise CLIError(f"--speculative-model {cfg.speculative_model!r}: with a calibration profile as --hardware "
                           "the draft model is its own calibration profile (`tokenmill sim calibrate --model "
                           "DRAFT --out DRAFT.json`), or ngram")
        draft = Calibrated.load(cfg.speculative_model)
        name = draft.profile.get("model")
        if not name:
            raise CLIError(f"--speculative-model {cfg.speculative_model}: the profile names no model")
        bpv = float(draft.profile.get("engine", {}).get("kv_bytes_per_value", 2.0))
        return spec, draft, get_model(name), bpv
    if is_profile(cfg.speculative_model):
        raise CLIError("--speculative-model: a calibration profile of a draft goes with a calibration profile as "
                       "--hardware; on a catalog GPU give the draft's catalog name or config.json")
    shape = get_model(cfg.speculative_model)
    return spec, Roofline(shape, hw, cfg.roofline), shape, cfg.roofline.kv_bytes


def is_profile(hardware: str) -> bool:
    return hardware.endswith(".json") or Path(hardware).is_file()


def build(cfg: SimConfig) -> Built:
    if cfg.block_size is None:
        cfg = replace(cfg, block_size=DEFAULT_BLOCK_SIZE)
    shape = get_model(cfg.model)
    if is_profile(cfg.hardware):
        cost = Calibrated.load(cfg.hardware)
        eng = cost.profile.get("engine", {})
        prof_model = cost.profile.get("model")
        if prof_model and prof_model != cfg.model:
            raise CLIError(f"--hardware {cfg.hardware} was calibrated on model {prof_model!r}, not {cfg.model!r}")
        kv_bytes = cfg.kv_cache_bytes or int(eng.get("kv_cache_bytes", 1 << 30))
        bytes_per_value = float(eng.get("kv_bytes_per_value", 2.0))
        spec, draft_cost, draft_shape, draft_bpv = _spec(cfg, None)
        per_token = shape.kv_bytes_per_token(bytes_per_value) + (  # a draft's KV shares the blocks (as the engine's)
            draft_shape.kv_bytes_per_token(draft_bpv) if draft_shape is not None else 0.0)
        capacity = int(kv_bytes // (per_token * cfg.block_size)) * cfg.block_size
        max_batched = cfg.max_num_batched_tokens or int(eng.get("max_num_batched_tokens", 2048))
        gpus, hw_name = 1, f"calibrated: {cost.profile.get('isa', 'this machine')}"
        block_bytes, link_bw = shape.kv_bytes_per_token(bytes_per_value) * cfg.block_size, None  # memcpy: TierIO's
    else:
        hw = get_hardware(cfg.hardware)
        cost = Roofline(shape, hw, cfg.roofline)
        spec, draft_cost, draft_shape, _ = _spec(cfg, hw)
        if draft_shape is None:
            capacity = (int(cfg.kv_cache_bytes // shape.kv_bytes_per_token(cfg.roofline.kv_bytes))
                        if cfg.kv_cache_bytes else cost.kv_capacity_tokens())
        else:  # the draft's weights take HBM, its KV shares the blocks
            kv = shape.kv_bytes_per_token(cfg.roofline.kv_bytes) + draft_shape.kv_bytes_per_token(cfg.roofline.kv_bytes)
            free = cfg.kv_cache_bytes or (cost.kv_capacity_tokens() * shape.kv_bytes_per_token(cfg.roofline.kv_bytes)
                                          - draft_shape.params_total() * cfg.roofline.weight_bytes)
            if free <= 0:
                raise CLIError(f"the draft {draft_shape.name} leaves no HBM for the KV cache")
            capacity = int(free // kv)
        max_batched = cfg.max_num_batched_tokens or 8192
        gpus, hw_name = cfg.roofline.tp, hw.name
        block_bytes = shape.kv_bytes_per_token(cfg.roofline.kv_bytes) * cfg.block_size
        link_bw = hw.host_link_bw * cfg.roofline.tp  # a block is split over the worker's GPUs, each on its link
    blocks = capacity // cfg.block_size
    if blocks < 1:
        raise CLIError(f"the KV cache of a worker holds no block of {cfg.block_size} tokens")
    max_len = min(cfg.max_model_len or shape.max_position, blocks * cfg.block_size)
    worker = WorkerConfig(num_blocks=blocks, block_size=cfg.block_size, max_num_batched_tokens=max_batched,
                          max_num_seqs=cfg.max_num_seqs, max_model_len=max_len,
                          enable_prefix_caching=cfg.enable_prefix_caching, step_budget=cfg.step_budget,
                          fast_forward=cfg.fast_forward, spec=spec, tiers=_tiers(cfg, int(block_bytes), link_bw))
    return Built(cost, shape, worker, gpus, hw_name, draft_cost)


def _tiers(cfg: SimConfig, block_bytes: int, link_bw: float | None) -> TierConfig | None:
    if not (cfg.kv_host_bytes or cfg.kv_disk_bytes):
        return None
    io = dict(cfg.tier_io)
    if link_bw is not None:
        io.setdefault("link_bw", link_bw)
    try:
        return TierConfig(cfg.kv_host_bytes, cfg.kv_disk_bytes, cfg.kv_host_shared, cfg.kv_load_timeout_s,
                          block_bytes, TierIO(**io))
    except (TypeError, ValueError) as e:
        raise CLIError(f"KV tiers: {e}") from None


def _vocab(cfg: SimConfig):
    if cfg.model.lower() in MODEL_CATALOG:
        return approximate_vocab()  # token ids only need to be equal where prompts share text
    try:
        from tokenmill.model.loader import resolve_model_path

        path = resolve_model_path(cfg.model)
    except Exception:  # noqa: BLE001 - a config.json path: no tokenizer
        return approximate_vocab()
    return load_vocab(find_tokenizer(None, str(path)), cfg.seed)


def run_simulation(cfg: SimConfig) -> tuple[BenchResult, dict]:
    vocab = _vocab(cfg)
    workload = make_workload(cfg.workloads[0], vocab, cfg.seed) if len(cfg.workloads) == 1 else \
        Mix.of_specs(list(cfg.workloads), vocab, cfg.seed)
    if cfg.block_size is None:
        size, block_source = block_size_for(workload)
        cfg = replace(cfg, block_size=size)
    else:
        block_source = "--block-size"
    built = build(cfg)
    slos = resolve_slos(list(cfg.slos), workload.classes)
    router_cfg = _router_with_slos(_router_chunks(cfg.router, cfg.block_size), slos, cfg.slos)
    if cfg.token_free:
        workload = token_free_workload(workload, cfg.block_size, router_cfg.prefix_index.chunk_tokens)
    result = BenchResult(
        command=list(cfg.command), seed=cfg.seed, slos=slos, runs=[], tokenizer=vocab.describe(),
        workload=workload.describe(),
        target={"url": f"sim://{cfg.workers}x{built.hardware_name}", "model": cfg.model, "endpoint": "completions",
                "prompt_format": "tokens", "models": [{"id": cfg.model, "max_model_len": built.worker.max_model_len}]})
    levels: list[dict] = []

    def run_at(load: LoadConfig) -> RunResult:
        plan = schedule(workload, load, cfg.seed)
        sim = ClusterSim(router_cfg, cfg.workers, built.worker, built.cost, record_chunks=cfg.record_chunks,
                         draft_cost=built.draft_cost, tier_model=cfg.model)
        t0, c0 = time.perf_counter(), time.process_time()
        records, stats = sim.run(plan, load)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        duration = run_duration(records)
        run = RunResult(load.label, load, records, summarize(records, slos, duration),
                        summarize_by_class(records, slos, duration), plan_digest(records, load))
        result.runs.append(run)
        levels.append(_level_json(run, stats, wall, cfg, built, cpu))
        return run

    if cfg.sweep is None:
        run_at(cfg.load)
    else:
        async def trial(rate: float) -> SweepPoint:
            run = run_at(replace(cfg.load, mode="rate", rate=rate))
            return SweepPoint(rate, run.summary.slo_attainment or 0.0, run.summary.goodput)

        result.sweep = asyncio.run(find_max_rate(trial, cfg.sweep))
        result.sweep_target = cfg.sweep.target
    sim_json = {
        "cost_model": built.cost.describe(), "hardware": built.hardware_name, "workers": cfg.workers,
        "gpus_per_worker": built.gpus_per_worker, "router": {"policy": router_cfg.policy,
                                                               "admission": router_cfg.admission.mode,
                                                               "chunk_tokens": router_cfg.prefix_index.chunk_tokens},
        "worker": dataclasses.asdict(built.worker), "block_size_source": block_source,
        "prompts": "token-free: the trace's hash_ids as block names" if cfg.token_free else "token ids",
        "price_per_gpu_hour": cfg.price_per_hour, "levels": levels,
    }
    if built.worker.spec is not None:
        sim_json["spec"] = {**built.worker.spec.describe(),
                            "draft_cost_model": built.draft_cost.describe() if built.draft_cost is not None else None}
    return result, sim_json


def _router_chunks(router: RouterConfig, block_size: int) -> RouterConfig:
    """The router's prefix index chunks token prompts at the workers' KV block size (PrefixIndexConfig:
    "match the workers' KV block size"): with the default 16-token chunks and 512-token blocks it would count
    up to 511 tokens of a partial block as cached. A router config that sets chunk_tokens to anything but the
    default keeps it."""
    if router.prefix_index.chunk_tokens != PrefixIndexConfig().chunk_tokens or block_size == DEFAULT_BLOCK_SIZE:
        return router
    return replace(router, prefix_index=replace(router.prefix_index, chunk_tokens=block_size))


def _router_with_slos(router: RouterConfig, slos: dict[str, SLO], given: tuple[str, ...]) -> RouterConfig:
    """`--slo` overrides also set the router classes' SLOs (admission aims at what the run measures)."""
    if not given:
        return router
    classes = []
    for c in router.classes:
        s = slos.get(c.name)
        if s is None:
            classes.append(c)
            continue
        classes.append(replace(c, ttft_slo_s=(s.ttft_ms / 1000) if s.ttft_ms else c.ttft_slo_s,
                               tpot_slo_s=(s.tpot_ms / 1000) if s.tpot_ms else c.tpot_slo_s))
    return replace(router, classes=tuple(classes))


def _level_json(run: RunResult, stats: LevelStats, wall_s: float, cfg: SimConfig, built: Built,
                cpu_s: float | None = None) -> dict:
    s = run.summary
    gpus = cfg.workers * built.gpus_per_worker
    busy = sum(stats.busy_s) / max(1, len(stats.busy_s)) / stats.sim_end_s if stats.sim_end_s > 0 else 0.0
    out = {"label": run.label, "events": stats.events, "steps": stats.steps, "wall_s": wall_s,
           "cpu_s": cpu_s,  # this process's CPU time in the loop (wall_s minus waiting on a shared machine)
           "events_per_s": stats.events / wall_s if wall_s > 0 else None, "simulated_s": stats.sim_end_s,
           "speedup_vs_real_time": stats.sim_end_s / wall_s if wall_s > 0 else None,
           "mean_worker_busy": busy, "gpus": gpus, "prompt_tokens": stats.prompt_tokens,
           "output_tokens": stats.output_tokens, "fast_forward": stats.fast_forward}
    if stats.spec is not None:
        out["spec"] = stats.spec
    if stats.tiers is not None:
        out["kv_tiers"] = stats.tiers
    if cfg.price_per_hour is not None and s.duration_s > 0:
        cost = cfg.price_per_hour * gpus * s.duration_s / 3600.0
        tokens = s.prompt_tokens + s.output_tokens
        out["cost"] = {"usd": cost, "per_completed_request": cost / s.completed if s.completed else None,
                       "per_good_request": cost / s.good if s.good else None,
                       "per_million_output_tokens": cost / s.output_tokens * 1e6 if s.output_tokens else None,
                       "per_million_tokens": cost / tokens * 1e6 if tokens else None}
    return out
