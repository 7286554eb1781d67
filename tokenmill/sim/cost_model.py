"""Cost models: the seconds one engine step takes, from the step's shape (what the real scheduler put in it).

    StepShape.of(SchedulerOutput)   per step: new tokens, prefill tokens, decodes, (query, context) pairs,
                                    context read by decodes, logits rows (a speculating decode's verify rows
                                    are tokens and logits rows of its decode: sim/spec.py)

Roofline (a model shape on a catalog GPU, `tp` GPUs per worker):

    flops   = 2 x (active params - lm_head) x tokens + 2 x vocab x hidden x logits + attn_flops_per_pair x pairs
    bytes   = weights read (MoE: the experts the step's tokens route to) x weight bytes
              + KV bytes per token x (context read + new tokens written)
    step_s  = max(flops / (tp x peak x mfu), bytes / (tp x hbm_bw x mbu))
              + step_overhead_s + layers x layer_overhead_s
              + (tp > 1) 2 x layers x (2 (tp-1)/tp x tokens x hidden x 2 B / link_bw + link_latency_s)

Calibrated (this machine, `tokenmill sim calibrate`): step_s = c · features, the coefficients fitted by
non-negative least squares to the real engine's measured steps (calibrate.py), plus the serving overhead
measured through a real `tokenmill serve` (what the engine loses to the serving side per step, per streamed
token and per request, and the per-request delay before a request reaches the engine):

    step_s += serving.step_s + serving.per_seq_s x logits + serving.per_request_s x new_requests
              + serving.per_prefill_token_s x prefill_tokens
    request_overhead_s = serving.request_s
    (prefill-token and attention coefficients x serving.prefill_scale: profiles before per_request_s)

or, where the profile has `serving.kinds` (calibrated from open-loop runs, session 14), per step kind --
decode-only, mixed (decodes beside prefill tokens) and prefill-only steps apart (STEP_KINDS, step_kind):

    step_s = engine fit x (1 + kinds[k].scale + kinds[k].wide_scale x [tokens > serving.wide_rows])
             + kinds[k].step_s + kinds[k].per_seq_s x logits + kinds[k].per_request_s x new_requests
             (+ kinds[k].new_shape_s where the worker runs a wide step of this row count for the first time)
             (+ decode-only steps, where kinds.decode has a `table` (session 15): table_excess(decode seqs))

On a CPU the serving overhead is mostly CPU time: the engine's torch threads use every core, so each
CPU-second the HTTP front-end and the client take (per step result, per streamed token, per request) delays
the engine by about a second (docs/benchmarks/sim.md, "Fidelity on an AVX2 machine").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tokenmill.cli import CLIError
from tokenmill.sim.hardware import Hardware
from tokenmill.sim.models import ModelShape

FEATURES = ("one", "prefill_tokens", "decode_seqs", "attn_pairs", "decode_ctx", "logits", "mixed_decodes")
# profiles calibrated before "mixed_decodes" (coefficient 0 for it: the same step times as then)
FEATURES_V1 = FEATURES[:6]
PROFILE_KIND = "tokenmill-sim-calibration"
# serving terms per step kind (serving.kinds): the decode-only, mixed and prefill-only steps of a served engine
# lose different shares of their time to the serving side (docs/benchmarks/sim.md, sessions 13-14)
STEP_KINDS = ("decode", "mixed", "prefill")
KIND_TERMS = ("step_s", "scale", "per_seq_s", "per_request_s", "wide_scale", "new_shape_s")
# wide_scale (session 18): a further share of the engine fit that a served step with more than serving.wide_rows rows
# (the engine's small-row limit, runner.small_rows: AMX's amx_rows() = 256 on an AMX CPU) loses. Up to that many
# rows every linear runs the small-row kernel; beyond it oneDNN's GEMM on every thread, which loses more to the
# front-end and the client on the same cores (docs/benchmarks/sim.md, "Fidelity on an Intel AMX machine": served
# prefill steps of 257-512 rows took 1.7x the in-process fit, those of 129-256 rows 1.15x). new_shape_s (session 18):
# the first wide step of a row count a worker has not run before pays this once more (oneDNN creates its GEMM
# primitives per row count: ~8.5 ms on the AMX machine, every time a fresh server meets a new prefill size; a row
# count it has run before: ~1 ms). The simulated worker keeps the row counts it has run (worker.py: new_shape_s).
# decode-only steps (session 15): the serving excess as a table over the decode batch size instead of the linear
# split above, whose per-step / per-token shares moved between calibrations (they are near-collinear on decode
# steps): serving.kinds.decode.table = [[decode seqs, excess s], ...] (knots, increasing), linear between them,
# the first knot's value below it, the last's + table_slope_s per sequence beyond it; added to the linear terms
DECODE_TABLE_TERMS = ("table", "table_slope_s", "table_steps")  # table_steps: the steps behind each knot (a record)


def table_excess(knots: list[tuple[float, float]], slope: float, d: float) -> float:
    """The decode table's excess at batch size d (DECODE_TABLE_TERMS)."""
    x0, y0 = knots[0]
    if d <= x0:
        return y0
    for x1, y1 in knots[1:]:
        if d <= x1:
            return y0 + (y1 - y0) * (d - x0) / (x1 - x0)
        x0, y0 = x1, y1
    return y0 + slope * (d - x0)


def step_kind(prefill_tokens: int, decode_seqs: int) -> str:
    """decode-only (no prefill tokens), mixed (prefill tokens beside decodes) or prefill-only."""
    return "decode" if not prefill_tokens else ("mixed" if decode_seqs else "prefill")


@dataclass(frozen=True)
class StepShape:
    tokens: int = 0  # new tokens, all sequences
    prefill_tokens: int = 0  # new tokens of sequences with more than one (prefill chunks)
    decode_seqs: int = 0  # sequences with one new token
    attn_pairs: float = 0.0  # (query, context) pairs attended: sum of n x (start + (n + 1) / 2)
    decode_ctx: int = 0  # context tokens the decodes read
    prefill_ctx: int = 0  # context before the chunk that prefill chunks read
    logits: int = 0  # rows sent through the LM head
    new_requests: int = 0  # requests scheduled for the first time (the serving side's per-request work)
    verify_tokens: int = 0  # speculative decoding: draft rows verified beside their decode (in tokens and logits)

    @staticmethod
    def of(sched) -> "StepShape":
        tokens = prefill = decodes = dctx = pctx = logits = verify = 0
        pairs = 0.0
        for s in sched.seqs:
            n, start = len(s.token_ids), s.start_pos
            tokens += n
            logits += s.num_logits
            pairs += n * (start + (n + 1) / 2)
            if n == 1 or s.num_spec_slots:  # a decode, with its drafts' verify rows when speculating
                decodes += 1
                dctx += start + 1
                verify += n - 1
            else:
                prefill += n
                pctx += start
        return StepShape(tokens, prefill, decodes, pairs, dctx, pctx, logits, len(sched.first_scheduled), verify)

    @property
    def mixed_decodes(self) -> int:
        """Decodes that share a step with prefill tokens. The engine runs a decode-only step on its fused
        decode path and a mixed step on the general one, where each decode costs more (measured on an AVX2
        CPU: a 16-token chunk beside 16 decodes took ~1.3x the fit without this term)."""
        return self.decode_seqs if self.prefill_tokens else 0

    def features(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_seqs, self.attn_pairs, self.decode_ctx, self.logits,
                         self.mixed_decodes])


class CostModel:
    name = "abstract"
    request_overhead_s = 0.0  # from a request's arrival at the worker to its entering the engine (HTTP, tokenize)
    wide_rows: int | None = None  # steps of more rows are wide: new_shape_s applies to them (None: to none)

    def new_shape_s(self, shape: StepShape) -> float:
        """The once-per-worker cost of the first wide step of shape.tokens rows (on top of step_s)."""
        return 0.0

    def step_s(self, shape: StepShape) -> float:
        raise NotImplementedError

    def decode_run_s(self, shape: StepShape, n: int) -> list[float]:
        """step_s of steps 1 .. n-1 of a run of decode-only steps whose step 0 has `shape` (decode_run.py: each
        step reads one more context token per decode). Subclasses compute it in one numpy pass with the same
        float operations as step_s, term by term (tests/sim: equal bit for bit)."""
        d = shape.decode_seqs
        return [self.step_s(StepShape(shape.tokens, 0, d, shape.attn_pairs + d * i, shape.decode_ctx + d * i, 0,
                                      shape.logits)) for i in range(1, n)]

    def describe(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class RooflineParams:
    dtype: str = "bf16"  # weights and math: bf16 | fp8 | fp4
    kv_bytes: float = 2.0  # per cached value (bf16 2, fp8 1)
    mfu: float = 0.5  # share of peak tensor FLOPs a step gets
    mbu: float = 0.8  # share of peak HBM bandwidth
    step_overhead_s: float = 0.002  # scheduler, launch and sampling per step
    layer_overhead_s: float = 10e-6  # kernel launches per layer
    tp: int = 1  # GPUs per worker (tensor parallel)

    def __post_init__(self):
        if self.dtype not in ("bf16", "fp8", "fp4"):
            raise CLIError(f"--dtype {self.dtype!r}: choose bf16, fp8 or fp4")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise CLIError("--mfu and --mbu must be in (0, 1]")
        if self.tp < 1 or self.step_overhead_s < 0 or self.layer_overhead_s < 0 or self.kv_bytes <= 0:
            raise CLIError("--tp must be >= 1, overheads >= 0, kv bytes > 0")

    @property
    def weight_bytes(self) -> float:
        return {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5}[self.dtype]


class Roofline(CostModel):
    name = "roofline"

    def __init__(self, model: ModelShape, hw: Hardware, p: RooflineParams = RooflineParams()):
        self.model, self.hw, self.p = model, hw, p
        self._flops = hw.peak_flops(p.dtype) * p.mfu * p.tp
        self._bw = hw.hbm_bw * p.mbu * p.tp
        self._linear = 2.0 * (model.params_active() - model.vocab * model.hidden)
        self._head = 2.0 * model.vocab * model.hidden
        self._pair = model.attn_flops_per_pair()
        self._kv = model.kv_bytes_per_token(p.kv_bytes)
        self._fixed = p.step_overhead_s + model.layers * p.layer_overhead_s
        self._weights_dense = None if model.moe else model.weight_params_read(1) * p.weight_bytes

    @property
    def fixed_s(self) -> float:
        """Seconds every step pays besides compute and memory (step overhead + per-layer launches)."""
        return self._fixed

    def bound_s(self, s: StepShape) -> tuple[float, float]:
        """The step's compute seconds and memory seconds at this roofline's MFU and MBU (step_s: their max plus
        the fixed cost; calibrate.fit_roofline: the same terms at MFU = MBU = 1)."""
        flops = self._linear * s.tokens + self._head * s.logits + self._pair * s.attn_pairs
        weights = (self._weights_dense if self._weights_dense is not None
                   else self.model.weight_params_read(s.tokens) * self.p.weight_bytes)
        kv = self._kv * (s.decode_ctx + s.prefill_ctx + s.tokens)
        return flops / self._flops, (weights + kv) / self._bw

    def step_s(self, s: StepShape) -> float:
        m, p = self.model, self.p
        t = max(self.bound_s(s)) + self._fixed
        if p.tp > 1:
            per = 2 * (p.tp - 1) / p.tp * s.tokens * m.hidden * 2.0 / self.hw.link_bw + self.hw.link_latency_s
            t += 2 * m.layers * per
        return t

    def decode_run_s(self, shape: StepShape, n: int) -> list[float]:
        if n < 2:
            return []
        m, p, d = self.model, self.p, shape.decode_seqs
        di = d * np.arange(1, n, dtype=np.int64)  # step i: attn_pairs + d·i, decode_ctx + d·i
        flops = self._linear * shape.tokens + self._head * shape.logits + self._pair * (shape.attn_pairs + di)
        weights = self._weights_dense if self._weights_dense is not None else \
            m.weight_params_read(shape.tokens) * p.weight_bytes
        kv = self._kv * (shape.decode_ctx + di + 0 + shape.tokens)  # decode_ctx + prefill_ctx (0) + tokens
        t = np.maximum(flops / self._flops, (weights + kv) / self._bw) + self._fixed
        if p.tp > 1:
            per = 2 * (p.tp - 1) / p.tp * shape.tokens * m.hidden * 2.0 / self.hw.link_bw + self.hw.link_latency_s
            t += 2 * m.layers * per
        return t.tolist()

    def kv_capacity_tokens(self, mem_fraction: float = 0.9) -> int:
        """KV tokens a worker holds: mem_fraction of its HBM after the weights."""
        free = self.hw.hbm_bytes * self.p.tp * mem_fraction - self.model.params_total() * self.p.weight_bytes
        if free <= 0:
            raise CLIError(f"{self.model.name} ({self.model.params_total() / 1e9:.0f}B params in {self.p.dtype}) does "
                           f"not fit {self.p.tp} x {self.hw.name}: raise --tp or lower --dtype")
        return int(free // self._kv)

    def describe(self) -> dict:
        return {"kind": "roofline", "model": self.model.describe(), "hardware": asdict(self.hw),
                "params": asdict(self.p)}


@dataclass
class Calibrated(CostModel):
    """step_s = coef · StepShape.features(), from a `tokenmill sim calibrate` profile."""

    coef: list[float]
    profile: dict = field(default_factory=dict)
    name: str = "calibrated"

    def __post_init__(self):
        if len(self.coef) == len(FEATURES_V1):
            self.coef = [*self.coef, 0.0]
        if len(self.coef) != len(FEATURES) or any(c < 0 for c in self.coef):
            raise CLIError(f"calibration profile: coef must be {len(FEATURES)} non-negative numbers ({FEATURES})")
        self._c = np.asarray(self.coef, dtype=np.float64)
        self._dtab = self._dtable = None
        serving = self.profile.get("serving") or {}
        wide = serving.get("wide_rows")
        if wide is not None and (not isinstance(wide, int) or isinstance(wide, bool) or wide < 1):
            raise CLIError(f"calibration profile: serving.wide_rows must be a positive integer (rows); got {wide!r}")
        self._wide_rows = self.wide_rows = wide  # steps of more tokens take kinds[k].wide_scale / new_shape_s
        self._wide = {}  # kind -> coefficients of its wide steps (where its wide_scale is not 0)
        self._new_shape = dict.fromkeys(STEP_KINDS, 0.0)  # kind -> new_shape_s
        kinds = serving.get("kinds")
        if kinds is None:  # one set of serving terms for every step (profiles before session 14)
            c = [float(c) for c in self.coef]
            scale = float(serving.get("prefill_scale", 1.0))  # a prefill runs this much slower inside the server
            c[1] *= scale
            c[3] *= scale
            c[0] += float(serving.get("step_s", 0.0))
            c[5] += float(serving.get("per_seq_s", 0.0))
            c[1] += float(serving.get("per_prefill_token_s", 0.0))
            per_request = float(serving.get("per_request_s", 0.0))
            if per_request < 0:
                raise CLIError("calibration profile: serving.per_request_s must be >= 0")
            self._kind = {k: (c, per_request) for k in STEP_KINDS}
        else:
            self._kind = {k: self._kind_terms(kinds, k) for k in STEP_KINDS}
            flat = sorted(set(serving) & {"step_s", "per_seq_s", "per_request_s", "per_prefill_token_s",
                                           "prefill_scale"})
            if flat:
                raise CLIError(f"calibration profile: serving has both `kinds` and the one-set terms {flat}; "
                               "keep one of the two")
        self._k_decode, self._k_mixed, self._k_prefill = (self._kind[k] for k in STEP_KINDS)
        self._w_decode, self._w_mixed, self._w_prefill = (self._wide.get(k, self._kind[k]) for k in STEP_KINDS)
        self._c_list = self._k_decode[0]  # decode runs (decode_run_s) are decode-only
        self.request_overhead_s = float(serving.get("request_s", 0.0))

    def _kind_terms(self, kinds, kind: str) -> tuple[list[float], float]:
        if not isinstance(kinds, dict) or set(kinds) != set(STEP_KINDS):
            raise CLIError(f"calibration profile: serving.kinds must have exactly the step kinds {list(STEP_KINDS)}; "
                           f"got {sorted(kinds) if isinstance(kinds, dict) else kinds!r}")
        t = kinds[kind]
        known = KIND_TERMS + (DECODE_TABLE_TERMS if kind == "decode" else ())
        unknown = sorted(set(t) - set(known)) if isinstance(t, dict) else None
        if unknown is None or unknown:
            raise CLIError(f"calibration profile: serving.kinds.{kind}: unknown terms {unknown}; known: "
                           f"{list(known)}")
        if kind == "decode" and "table" in t:
            self._set_decode_table(t["table"], t.get("table_slope_s", 0.0))
        elif "table_slope_s" in t:
            raise CLIError("calibration profile: serving.kinds.decode.table_slope_s without a table")
        v = {k: float(t.get(k, 0.0)) for k in KIND_TERMS}
        if any(x < 0 for x in v.values()):
            raise CLIError(f"calibration profile: serving.kinds.{kind}: terms must be >= 0 ({v})")
        if (v["wide_scale"] or v["new_shape_s"]) and self._wide_rows is None:
            raise CLIError(f"calibration profile: serving.kinds.{kind}: wide_scale / new_shape_s without "
                           "serving.wide_rows (the row count above which a step is wide)")
        self._new_shape[kind] = v["new_shape_s"]

        def terms(share: float) -> list[float]:
            c = [x * (1.0 + share) for x in self.coef]
            c[0] += v["step_s"]
            c[5] += v["per_seq_s"]
            return c

        if v["wide_scale"]:
            self._wide[kind] = (terms(v["scale"] + v["wide_scale"]), v["per_request_s"])
        return terms(v["scale"]), v["per_request_s"]

    _TABLE_SIZE = 1025  # decode batch sizes whose table excess is precomputed (the hot path: one list index)

    def _set_decode_table(self, table, slope) -> None:
        try:
            knots = [(float(d), float(e)) for d, e in table]
            slope = float(slope)
        except (TypeError, ValueError):
            raise CLIError("calibration profile: serving.kinds.decode.table must be [[decode seqs, seconds], ...] and "
                           "table_slope_s a number") from None
        xs = [d for d, _ in knots]
        if not knots or xs[0] < 1 or any(b <= a for a, b in zip(xs, xs[1:])) or slope < 0 or \
                not all(np.isfinite([*xs, *(e for _, e in knots), slope])):
            raise CLIError("calibration profile: serving.kinds.decode.table: knots need decode seqs >= 1, strictly "
                           "increasing, finite seconds; table_slope_s >= 0")
        self._dtable = (knots, slope)
        self._dtab = [table_excess(knots, slope, d) for d in range(self._TABLE_SIZE)]

    def decode_table_s(self, d: int) -> float:
        """The decode table's excess for a decode-only step of d sequences (0.0 without a table)."""
        if self._dtab is None:
            return 0.0
        return self._dtab[d] if d < self._TABLE_SIZE else table_excess(*self._dtable, d)

    def new_shape_s(self, s: StepShape) -> float:
        if self._wide_rows is None or s.tokens <= self._wide_rows:
            return 0.0
        return self._new_shape[step_kind(s.prefill_tokens, s.decode_seqs)]

    def engine_step_s(self, s: StepShape) -> float:
        """The engine alone (no serving overhead): the in-process fit."""
        return float(self._c @ s.features())

    def step_s(self, s: StepShape) -> float:
        # step_kind, inline (the simulator's hot path)
        if self._wide_rows is not None and s.tokens > self._wide_rows:
            c, per_request = (self._w_decode if not s.prefill_tokens
                              else self._w_mixed if s.decode_seqs else self._w_prefill)
        else:
            c, per_request = (self._k_decode if not s.prefill_tokens
                              else self._k_mixed if s.decode_seqs else self._k_prefill)
        t = (c[0] + c[1] * s.prefill_tokens + c[2] * s.decode_seqs + c[3] * s.attn_pairs + c[4] * s.decode_ctx
             + c[5] * s.logits)
        if s.prefill_tokens and s.decode_seqs:  # mixed_decodes (0 in a decode run: decode_run_s)
            t += c[6] * s.decode_seqs
        elif self._dtab is not None and not s.prefill_tokens:  # decode-only: the decode table
            t += self.decode_table_s(s.decode_seqs)
        if s.new_requests:  # never in a decode run (decode_run_s): nothing is waiting there
            t += per_request * s.new_requests
        return t

    def decode_run_s(self, shape: StepShape, n: int) -> list[float]:
        if n < 2:
            return []
        d = shape.decode_seqs
        c = self._w_decode[0] if self._wide_rows is not None and d > self._wide_rows else self._c_list
        di = d * np.arange(1, n, dtype=np.int64)
        t = ((c[0] + c[1] * 0 + c[2] * d + c[3] * (shape.attn_pairs + di) + c[4] * (shape.decode_ctx + di))
             + c[5] * shape.logits)
        if self._dtab is not None:
            t = t + self.decode_table_s(d)
        return t.tolist()

    def describe(self) -> dict:
        return {"kind": "calibrated", "features": list(FEATURES), "coef": [float(v) for v in self._c],
                **{k: v for k, v in self.profile.items() if k not in ("coef", "features", "samples", "sample_shapes")}}

    @staticmethod
    def load(path: str | Path) -> "Calibrated":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CLIError(f"--hardware {path}: cannot read the calibration profile ({e})") from None
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise CLIError(f"--hardware {path}: not a calibration profile (kind {PROFILE_KIND!r}); "
                           "make one with `tokenmill sim calibrate`")
        if data.get("features") not in (list(FEATURES), list(FEATURES_V1)):
            raise CLIError(f"--hardware {path}: features {data.get('features')} differ from {list(FEATURES)}; "
                           "calibrate again")
        return Calibrated(list(data["coef"]), data)


def nnls(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Non-negative least squares (active set: drop the most negative coefficient and refit)."""
    if weights is not None:
        x, y = x * weights[:, None], y * weights
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef
