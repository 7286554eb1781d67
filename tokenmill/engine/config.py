"""EngineConfig: one validated dataclass for the engine (model, KV cache, scheduler limits)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tokenmill.errors import TokenmillError

GiB = 1 << 30


def parse_bytes(v: str | int) -> int:
    """'4GiB', '512MiB', '2G', '1e9', 1073741824 -> bytes."""
    if isinstance(v, int):
        return v
    s = str(v).strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    for u, mul in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mul)
    return int(float(s))


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3")  # fp8 = fp8_e4m3 (vLLM's two names)
NGRAM_MAX_K, DRAFT_MAX_K = 8, 6  # speculative_max_k defaults (see EngineConfig)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: "torch.dtype") -> "torch.dtype":
    """--kv-cache-dtype -> the KV cache's storage dtype (auto: the model's)."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    return getattr(torch, kv_cache_dtype)


@dataclass
class EngineConfig:
    model: str = "demo"  # a shipped model name (demo, demo-draft) or an HF-format directory
    dtype: str = "auto"  # auto: bf16 on CPUs with native bf16 (avx512_bf16/AMX) else fp32; CUDA: fp16 ckpt -> fp16, else bf16 (sm80+)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    quantization: str = "none"  # none | int8 | fp8 (W8A8 dynamic: weights per channel at load, activations per token)
    # auto (the model's dtype) | float32 | bfloat16 | int8 | fp8 (= fp8_e4m3; int8 and fp8: per-(block, head) scales)
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int = 1 * GiB  # KV capacity in bytes (all layers, K and V)
    block_size: int = 16  # tokens per KV block
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 256  # running requests at most
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096  # bounded waiting queue: add_request refuses beyond it
    seed: int = 0  # for requests without their own seed
    num_threads: int | None = None  # CPU: torch threads (default: torch's choice)
    # KV tiers below the pool (0 / None: off). Host: files on tmpfs, shared by every worker on the host.
    kv_host_bytes: int = 0  # host DRAM tier capacity (shared by all workers using the same kv_host_dir)
    kv_host_dir: str | None = None  # default /dev/shm/tokenmill-kv (only with kv_host_bytes)
    kv_disk_dir: str | None = None  # disk tier directory (needs kv_disk_bytes)
    kv_disk_bytes: int = 0  # disk tier capacity
    kv_disk_fsync: bool = False  # fsync each disk entry before its rename (durability across power loss)
    kv_load_timeout_s: float = 1.0  # a tier load running longer is abandoned: the request recomputes
    # Speculative decoding (None: off). speculative_model: demo-draft | an HF directory (a draft model) | ngram
    # (prompt lookup); num_speculative_tokens: K (a fixed k per step) | "auto" (k per sequence per step, 0..
    # speculative_max_k, chosen from measured acceptance and step cost: engine/spec/policy.py).
    speculative_model: str | None = None
    num_speculative_tokens: int | str | None = None
    # auto's largest k; None: 8 for ngram (a lookup is free, a longer proposal costs only verify rows, which the
    # guard measures), 6 for a draft model (every proposed token is one more draft forward)
    speculative_max_k: int | None = None
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: longest suffix matched (tried first)
    # CUDA: decode steps through captured CUDA graphs (engine/graphs.py); needs a CUDA device and a KV cache in the
    # model's dtype (the int8 / fp8 KV write groups its blocks on the host each step)
    cuda_graphs: bool = False
    # Batch-invariant linears: every row of a linear gets the same bits whatever the number of rows in its step
    # (the engine's own kernels for any row count instead of oneDNN above the small-row limit), so a request's greedy
    # output does not depend on what else was batched with it, and greedy speculation is token for token the output
    # without it (verify steps, preemption and the tail of a batch change the row counts). "auto": on for bf16
    # unquantized linears where the own any-row kernel exists (AMX tiles or AVX-512 BF16; in bf16 the two kernels'
    # last-bit differences flip near-tie argmaxes), off elsewhere (fp32: not observed to flip; int8/fp8: own
    # kernels already); "on" / "off": forced (on with fp32: linear_small over chunks of 8 rows, slow). Attention
    # under it: a prompt's rows with the prefill kernel (its rows' bits do not depend on the chunking), generated
    # tokens' rows as decode rows, also when recomputed after a preemption; "strict": every row as a decode row, so
    # also a prompt holding an earlier answer gets that answer's decode bits whether its KV was cached or evicted
    # (prefill ~0.7x: benchmarks/batch_invariant.py)
    batch_invariant: str = "auto"

    def __post_init__(self):
        self.kv_cache_bytes = parse_bytes(self.kv_cache_bytes)
        self.kv_host_bytes = parse_bytes(self.kv_host_bytes or 0)
        self.kv_disk_bytes = parse_bytes(self.kv_disk_bytes or 0)
        self.num_speculative_tokens = _parse_num_spec(self.num_speculative_tokens)
        if self.speculative_max_k is None:
            self.speculative_max_k = NGRAM_MAX_K if self.speculative_model == "ngram" else DRAFT_MAX_K
        checks = [
            (self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size must be a power of two <= 256"),
            (self.kv_cache_bytes > 0, "kv_cache_bytes must be > 0"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype must be auto|float32|bfloat16|float16"),
            (self.quantization in ("none", "int8", "fp8"), f"unknown quantization {self.quantization!r} (none|int8|fp8)"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"unknown kv_cache_dtype {self.kv_cache_dtype!r} ({'|'.join(KV_CACHE_DTYPES)})"),
            (self.kv_host_bytes >= 0 and self.kv_disk_bytes >= 0, "kv_host_bytes and kv_disk_bytes must be >= 0"),
            (self.kv_host_dir is None or self.kv_host_bytes > 0, "kv_host_dir (--kv-host-dir) is set but kv_host_bytes (--kv-host-bytes) is 0"),
            (self.kv_disk_dir is None or self.kv_disk_bytes > 0, "kv_disk_dir (--kv-disk-dir) is set but kv_disk_bytes (--kv-disk-bytes) is 0"),
            (self.kv_disk_bytes == 0 or self.kv_disk_dir, "kv_disk_bytes (--kv-disk-bytes) is set but kv_disk_dir (--kv-disk-dir) is not"),
            (not self.kv_disk_fsync or self.kv_disk_dir, "kv_disk_fsync (--kv-disk-fsync) is set but kv_disk_dir (--kv-disk-dir) is not"),
            (self.kv_load_timeout_s > 0 and self.kv_load_timeout_s == self.kv_load_timeout_s
             and self.kv_load_timeout_s != float("inf"), "kv_load_timeout_s (--kv-load-timeout) must be a finite number > 0"),
            (self.enable_prefix_caching or not (self.kv_host_bytes or self.kv_disk_dir),
             "KV tiers (kv_host_bytes / kv_disk_dir) need prefix caching (blocks are found by their hash)"),
            (self.speculative_model is None or self.num_speculative_tokens is not None,
             f"speculative_model={self.speculative_model!r} needs num_speculative_tokens (--num-speculative-tokens K|auto)"),
            (self.num_speculative_tokens is None or self.speculative_model is not None,
             "num_speculative_tokens (--num-speculative-tokens) is set but speculative_model (--speculative-model) is not"),
            (self.speculative_model is None or (isinstance(self.speculative_model, str) and self.speculative_model),
             "speculative_model must be demo-draft, ngram or a model directory"),
            (isinstance(self.speculative_max_k, int) and 1 <= self.speculative_max_k <= 16,
             f"speculative_max_k must be an integer in [1, 16], got {self.speculative_max_k!r}"),
            (not self.cuda_graphs or self.kv_cache_dtype not in ("int8", "fp8", "fp8_e4m3"),
             f"cuda_graphs (--cuda-graphs) cannot capture the {self.kv_cache_dtype} KV cache's write (its blocks are "
             f"grouped on the host each step): use --kv-cache-dtype auto|bfloat16|float32"),
            (self.batch_invariant in ("auto", "on", "strict", "off"),
             f"batch_invariant (--batch-invariant) must be auto|on|strict|off, got {self.batch_invariant!r}"),
            (1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             f"prompt lookup needs 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
             f"({self.prompt_lookup_max})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise TokenmillError(f"EngineConfig: {msg}")

    @property
    def spec_enabled(self) -> bool:
        return self.speculative_model is not None

    @property
    def kv_tiers_enabled(self) -> bool:
        return bool(self.kv_host_bytes or self.kv_disk_dir)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TokenmillError(f"unknown engine option(s): {sorted(unknown)}")
        return cls(**kwargs)


def _parse_num_spec(v):
    """K (an int in [1, 16], also as a string) | "auto" | None."""
    if v is None or v == "auto":
        return v
    if isinstance(v, bool):
        raise TokenmillError(f"EngineConfig: num_speculative_tokens must be an integer in [1, 16] or 'auto', got {v!r}")
    try:
        k = int(v) if isinstance(v, int) or str(v).strip().isdigit() else None
    except ValueError:
        k = None
    if k is None or not 1 <= k <= 16:
        raise TokenmillError(f"EngineConfig: num_speculative_tokens must be an integer in [1, 16] or 'auto', got {v!r}")
    return k
