"""Speculative decoding in the simulator: the engine's own SpecDecoder (the `auto` policy, its cost model and
GoodputGuard, fixed k, verification and rollback) on the virtual clock, with the model's content and the
proposer's forward passes replaced by models.

Content. The sim has no model, so what a draft gets right is a property of each request's output, fixed
before any step: output position i is *draftable* (token DRAFTABLE, the token every simulated draft proposes)
or not (token OTHER). A two-state Markov chain over positions (Acceptance): draftable with stationary share
`alpha`, in runs of mean length `span` (None: positions independent, a draft model's i.i.d. acceptance; a
long span: n-gram's repeated spans in code, long runs every draft is right, then fresh text none is). A verify
of k drafts at output position n keeps the leading draftable positions of n..n+k-1, and emits the content at
n..n+kept: the real `verify_greedy` on argmax rows taken from the content. So speculation never changes the
output (lossless, as greedy speculation is), only how many steps it takes; and `auto`'s n-gram shadow
proposals (the counterfactual acceptance of caps not running, spec/decoder.py `_shadow_step`) compare against
the same content, through the decoder's own code.

Cost. The verify rows are tokens of the target's step (StepShape counts them as a decode's verify rows, priced
by the step's cost model: the roofline's FLOPs, bytes and logits; a calibrated profile's per-logits-row and
attention terms, which carry a decode row's own cost). The proposal's cost is added to the step:
  - a draft model (`has_kv`): its forward passes, priced by a cost model of the draft (a roofline of the draft's
    shape on the same GPU, or a calibration profile of the draft on this machine): one catch-up pass per
    proposal (the tokens the draft has not seen: its whole context the first time, or after a preemption; the
    tracking is the engine DraftModelProposer's rule) and k - 1 single-token passes. A draft profile calibrated
    with `--draft-for TARGET` prices a proposal (catch-up of <= 16 tokens) by its measured loop instead
    (calibrate.calibrate_draft_loop: SpecDecoder.propose timed inside TARGET's speculating engine); pricing the
    passes as whole engine steps of the draft overstated them ~1.8x on this CPU (docs/benchmarks/sim.md);
  - n-gram: `lookup_s` per lookup (the proposal's and the shadow lookups).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from tokenmill.cli import CLIError
from tokenmill.engine.config import DRAFT_MAX_K, NGRAM_MAX_K
from tokenmill.sim.cost_model import Calibrated, CostModel, Roofline, StepShape

SHORT_CATCHUP = 16  # = spec/decoder.SHORT_CATCHUP (tests/sim): a longer catch-up is a prefill through the runner

DRAFTABLE = 1  # the token of a draftable output position, and every simulated draft token
OTHER = 2  # an output position no draft gets right


# a calibrated draft's proposal time (calibrate.calibrate_draft_loop fits it): coef . these features
DRAFT_LOOP_FEATURES = ("one", "passes", "rows", "catchup_tokens")


def draft_loop_features(ks: list[int], catchups: list[int]) -> list[float]:
    """One proposal's features: passes (the longest k), rows (single-token passes' sequences, summed over passes
    after the first) and catch-up tokens (the first pass: each sequence's tokens the draft had not seen)."""
    kmax = max(ks) if ks else 0
    rows = sum(sum(1 for k in ks if k > j) for j in range(1, kmax))
    return [1.0, float(kmax), float(rows), float(sum(catchups))]


def catchup_shape(starts: list[int], catchups: list[int]) -> StepShape:
    """The draft's first pass as a step: each sequence's catch-up tokens from its draft-KV start (one token: a
    decode row; more: a prefill chunk)."""
    tokens = prefill = decodes = dctx = pctx = 0
    pairs = 0.0
    for n, c in zip(starts, catchups):
        tokens += c
        pairs += c * (n + (c + 1) / 2)
        if c == 1:
            decodes += 1
            dctx += n + 1
        else:
            prefill += c
            pctx += n
    return StepShape(tokens, prefill, decodes, pairs, dctx, pctx, len(starts))


@dataclass(frozen=True)
class Acceptance:
    """alpha: share of output positions a draft gets right; span: mean run of such positions (None: i.i.d.)."""

    alpha: float
    span: float | None = None

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise CLIError(f"--spec-acceptance: alpha must be in [0, 1], got {self.alpha}")
        if self.span is not None:
            if self.alpha >= 1.0 or self.span < 1.0:
                raise CLIError("--spec-acceptance: a span needs alpha < 1 and span >= 1")
            if self.alpha / (self.span * (1.0 - self.alpha)) > 1.0:
                raise CLIError(f"--spec-acceptance: alpha {self.alpha} needs span >= alpha / (1 - alpha) = "
                               f"{self.alpha / (1 - self.alpha):.3g} (runs between non-draftable positions)")

    @staticmethod
    def parse(text: str) -> "Acceptance":
        """'ALPHA' or 'ALPHA:span=L'."""
        head, _, rest = text.partition(":")
        try:
            alpha = float(head)
        except ValueError:
            raise CLIError(f"--spec-acceptance {text!r}: expected ALPHA or ALPHA:span=L (e.g. 0.7 or 0.6:span=20)") \
                from None
        span = None
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if key != "span" or not eq:
                raise CLIError(f"--spec-acceptance {text!r}: unknown option {item!r} (known: span=L)")
            try:
                span = float(value)
            except ValueError:
                raise CLIError(f"--spec-acceptance {text!r}: span must be a number") from None
        return Acceptance(alpha, span)

    def transitions(self) -> tuple[float, float]:
        """(P(draftable | draftable before), P(draftable | not draftable before))."""
        if self.span is None:
            return self.alpha, self.alpha
        stay = 1.0 - 1.0 / self.span
        return stay, self.alpha / (self.span * (1.0 - self.alpha))

    def describe(self) -> str:
        return f"{self.alpha:g}" + (f":span={self.span:g}" if self.span is not None else "")


class Content:
    """Each request's output tokens (DRAFTABLE / OTHER), drawn lazily from its own generator (seeded by the
    request id: the same content on any worker, in any run with the same seed)."""

    def __init__(self, acceptance: Acceptance, seed: int = 0):
        self.stay, self.enter = acceptance.transitions()
        self.alpha = acceptance.alpha
        self.seed = seed
        self._req: dict[str, tuple[random.Random, bytearray]] = {}

    def token(self, request_id: str, i: int) -> int:
        st = self._req.get(request_id)
        if st is None:
            st = self._req[request_id] = (random.Random(zlib.crc32(f"{self.seed}:{request_id}".encode())),
                                          bytearray())
        rng, toks = st
        while len(toks) <= i:
            p = self.alpha if not toks else (self.stay if toks[-1] == DRAFTABLE else self.enter)
            toks.append(DRAFTABLE if rng.random() < p else OTHER)
        return toks[i]

    def forget(self, request_id: str) -> None:
        self._req.pop(request_id, None)


@dataclass(frozen=True)
class SpecSimConfig:
    proposer: str  # "ngram" or "draft" (a draft model, priced by SimProposer's draft cost model)
    num_speculative_tokens: int | str  # K or "auto"
    acceptance: Acceptance
    max_k: int | None = None  # auto's largest k (default: the engine's, NGRAM_MAX_K / DRAFT_MAX_K)
    lookup_s: float = 15e-6  # n-gram: seconds per lookup (the engine thread's CPU time; ~7-25 us measured)
    seed: int = 0

    def __post_init__(self):
        if self.proposer not in ("ngram", "draft"):
            raise CLIError(f"speculative proposer {self.proposer!r}: ngram or a draft model")
        k = self.num_speculative_tokens
        if not (k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16)):
            raise CLIError(f"--num-speculative-tokens {k!r}: an integer in [1, 16] or auto")
        if self.max_k is not None and not (isinstance(self.max_k, int) and 1 <= self.max_k <= 16):
            raise CLIError(f"--speculative-max-k {self.max_k!r}: an integer in [1, 16]")
        if self.lookup_s < 0:
            raise CLIError("--spec-lookup-us must be >= 0")

    @property
    def k_max(self) -> int:
        if self.max_k is not None:
            return self.max_k
        return NGRAM_MAX_K if self.proposer == "ngram" else DRAFT_MAX_K

    def describe(self) -> dict:
        return {"proposer": self.proposer, "num_speculative_tokens": self.num_speculative_tokens,
                "max_k": self.k_max, "acceptance": self.acceptance.describe(), "lookup_s": self.lookup_s}


def draft_step_s(cost: CostModel, shape: StepShape) -> float:
    """One forward pass of the draft inside the target's step: its compute/memory time and per-layer launches
    (a roofline: no per-step overhead, which the target's step already pays), or a calibrated profile's
    in-process engine fit (no serving terms: the draft runs inside the engine's step)."""
    if isinstance(cost, Roofline):
        return max(cost.bound_s(shape)) + cost.model.layers * cost.p.layer_overhead_s
    if isinstance(cost, Calibrated):
        return cost.engine_step_s(shape)
    return cost.step_s(shape)


class SimProposer:
    """The proposer the engine's SpecDecoder calls (the interface of spec/proposers.py): every draft token is
    DRAFTABLE; what it costs is summed into `pending_s` for the worker's step."""

    def __init__(self, cfg: SpecSimConfig, draft_cost: CostModel | None):
        if cfg.proposer == "draft" and draft_cost is None:
            raise CLIError("a simulated draft model needs its cost model (--speculative-model)")
        self.name = cfg.proposer
        self.has_kv = cfg.proposer == "draft"
        self.shadow = cfg.proposer == "ngram"  # auto's counterfactual lookups (spec/decoder.py _shadow_step)
        self.last_catchup = 0
        self.lookup_s = cfg.lookup_s
        self.draft_cost = draft_cost
        self.computed: dict[str, tuple[int, int]] = {}  # rid -> (preemptions when computed, draft KV tokens)
        self.pending_s = 0.0  # the proposals' seconds since the worker last took them
        self.draft_passes = 0
        self.lookups = 0
        loop = (draft_cost.profile.get("draft_loop") if isinstance(draft_cost, Calibrated) else None) or None
        if loop is not None and list(loop.get("features", [])) != list(DRAFT_LOOP_FEATURES):
            raise CLIError(f"draft profile: draft_loop features {loop.get('features')} differ from "
                           f"{list(DRAFT_LOOP_FEATURES)}; calibrate the draft again")
        self.loop_coef = [float(c) for c in loop["coef"]] if loop is not None else None
        self.loop_target = loop.get("target") if loop is not None else None

    def take_s(self) -> float:
        s, self.pending_s = self.pending_s, 0.0
        return s

    def lookup(self, tokens, k: int, end: int | None = None, key: str | None = None) -> list[int]:
        self.lookups += 1
        self.pending_s += self.lookup_s
        return [DRAFTABLE] * max(0, k)

    def propose(self, reqs, ks, seqs, gens):
        from tokenmill.engine.spec.proposers import Draft

        if not self.has_kv:
            self.lookups += len(reqs)
            self.pending_s += self.lookup_s * len(reqs)
            return [Draft([DRAFTABLE] * k) for k in ks]
        # DraftModelProposer's rule: draft KV valid for [0, start); a catch-up pass of the tokens after it
        starts = []
        for r in reqs:
            pre, n = self.computed.get(r.request_id, (r.num_preemptions, 0))
            starts.append(min(0 if pre != r.num_preemptions else n, r.num_tokens - 1))
        catchups = [r.num_tokens - n for r, n in zip(reqs, starts)]
        self.last_catchup = max(catchups)
        passes = max(ks)
        loop = self.loop_coef
        if loop is not None and self.last_catchup <= SHORT_CATCHUP:
            # a calibrated draft loop (tokenmill sim calibrate --draft-for): the proposal as the engine's proposer
            # runs it, timed inside the target's speculating engine (DRAFT_LOOP_FEATURES)
            s = sum(c * x for c, x in zip(loop, draft_loop_features(list(ks), catchups)))
        else:
            s = draft_step_s(self.draft_cost, catchup_shape(starts, catchups))
            if loop is not None:  # a long catch-up is a prefill through the runner; the passes after it: the loop's
                rows = sum(sum(1 for k in ks if k > j) for j in range(1, passes))
                s += loop[1] * (passes - 1) + loop[2] * rows
            else:
                for j in range(1, passes):  # single-token passes of the sequences still drafting
                    rows = [r.num_tokens + j - 1 for r, k in zip(reqs, ks) if k > j]
                    ctx = sum(rows) + len(rows)
                    s += draft_step_s(self.draft_cost,
                                      StepShape(len(rows), 0, len(rows), float(ctx), ctx, 0, len(rows)))
        self.pending_s += s
        self.draft_passes += passes
        for r, k in zip(reqs, ks):
            self.computed[r.request_id] = (r.num_preemptions, r.num_tokens + k - 1)
        return [Draft([DRAFTABLE] * k) for k in ks]

    def rollback(self, req, num_computed: int) -> None:
        if self.has_kv:
            pre, n = self.computed.get(req.request_id, (req.num_preemptions, 0))
            self.computed[req.request_id] = (pre, min(n, num_computed))

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
