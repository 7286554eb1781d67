"""Routing policies and leading admission on the worker table: the same decisions as policies.py and
admission.py on a full RouteSnapshot, computed over columns (numpy) instead of one WorkerView per worker.

A `TableSnapshot` is what a decision is a function of: the table's columns (router/worker_table.py, read-only),
this request's estimated cached prefix per worker (zero except where the prefix index has a hit:
router/holder_index.py), the routable mask (healthy, not draining, not excluded) and the `RouteRequest`.
Each function here mirrors its scalar original term by term, in the same floating-point operations in the
same order (so ties, guards and SLO tests come out bit-identical), and breaks ties the same way (the
tuple keys of `min(..., key=...)`, the URL last). `TABLE_POLICIES` maps a policy function of policies.py to
its table form; a policy without one (a new or monkeypatched policy) is decided on the full snapshot.
tests/router/test_router_table.py checks every decision against the full snapshot on random event
sequences. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tokenmill.router import policies
from tokenmill.router.admission import Admission, AdmissionConfig, idle_budget_s
from tokenmill.router.classes import WorkloadClass
from tokenmill.router.policies import NO_WORKER, PolicyParams, RouteChoice
from tokenmill.router.snapshot import RouteRequest
from tokenmill.router.worker_table import (BASE, CALIBRATION, DECODE_STREAMS, DEADLINE, ERROR_HI, ERROR_LO,
                                           EXTERNAL, MARGIN, OUTSTANDING, PASSING, PREFILL_REQUESTS,
                                           PREFILL_TOKENS, RATE, RATE_SAMPLES, ROUTABLE, TPOT_BASE,
                                           TPOT_PER_STREAM, WorkerTable)


@dataclass(frozen=True)
class TableSnapshot:
    rows: list[tuple[float, ...]]  # WorkerTable.rows: each worker's column as Python floats (pool order), read-only
    urls: list[str]
    col: dict[str, int]  # url -> column
    rank: list[int]  # each worker's place in URL order (the last tie-break)
    hits: dict[int, int]  # column -> estimated cached prefix tokens of this request, where > 0 (else 0)
    idx: list[int]  # the routable, not excluded columns, in pool order
    request: RouteRequest
    table: WorkerTable  # the float64 forms below, built only when a decision takes the numpy path

    # The numpy forms of the same snapshot (decisions over more than SMALL workers, and the rare branches of
    # admission). Built on first use, from the table as it is then: a snapshot is decided at once (the router
    # makes no change to its workers in between).
    @cached_property
    def data(self) -> np.ndarray:  # WorkerTable rows x workers (pool order), read-only
        return self.table.array()

    @cached_property
    def url_rank(self) -> np.ndarray:
        return self.table.url_rank

    @cached_property
    def cached(self) -> np.ndarray:  # estimated cached prefix tokens of this request per worker (float64)
        cached = np.zeros(len(self.urls))
        for i, hit in self.hits.items():
            cached[i] = hit
        return cached

    @cached_property
    def mask(self) -> np.ndarray:  # routable and not excluded, a boolean per worker
        mask = self.table.routable()[0]
        if self.request.exclude:
            mask = mask.copy()
            for url in self.request.exclude:
                i = self.col.get(url)
                if i is not None:
                    mask[i] = False
        return mask

    @cached_property
    def routable(self) -> np.ndarray:  # `idx` as a numpy index
        return np.flatnonzero(self.mask) if self.request.exclude else self.table.routable()[1]

    def allowed(self, i: int) -> bool:
        """Column i is routable and not excluded (`mask[i]`)."""
        return self.rows[i][ROUTABLE] != 0 and self.urls[i] not in self.request.exclude

    def unc(self, i: int) -> float:
        """_uncached(ts)[i] as a Python float: max(0, prompt tokens - cached) (integers: exact)."""
        return float(max(0, self.request.prompt_tokens - self.hits.get(i, 0)))


SMALL = 64  # candidate sets up to this size are reduced in Python (numpy costs ~1 µs per call whatever the size)


def _lexmin(idx: np.ndarray, *keys: np.ndarray) -> int:
    """The index in `idx` with the least (keys[0], keys[1], ...) (full-length arrays); the last key is unique.
    Small sets: the least tuple in Python (the same comparisons: ==, then <, key by key)."""
    if 1 < len(idx) <= SMALL:
        return min(zip(*[k[idx].tolist() for k in keys], idx.tolist()))[-1]
    for k in keys:
        if len(idx) == 1:
            break
        v = k[idx]
        idx = idx[v == v.min()]
    return int(idx[0])


def _queue_s(d: np.ndarray, p: PolicyParams) -> np.ndarray:
    """policies.queue_s: base * prefill_requests + ((prefill + external tokens) + λ * streams) / rate."""
    work = (d[PREFILL_TOKENS] + d[EXTERNAL]) + p.decode_stream_tokens * d[DECODE_STREAMS]
    return d[BASE] * d[PREFILL_REQUESTS] + work / d[RATE]


def _uncached(ts: TableSnapshot) -> np.ndarray:
    """max(0, prompt tokens - cached) per worker; computed once per snapshot (the policy and admission both
    read it)."""
    unc = ts.__dict__.get("_uncached")
    if unc is None:
        unc = np.maximum(0.0, ts.request.prompt_tokens - ts.cached)
        object.__setattr__(ts, "_uncached", unc)
    return unc


def round_robin(ts: TableSnapshot, p: PolicyParams) -> RouteChoice:
    idx = ts.routable
    if not len(idx):
        return NO_WORKER
    return RouteChoice(ts.urls[int(idx[ts.request.seq % len(idx)])], "round-robin")


def least_load(ts: TableSnapshot, p: PolicyParams) -> RouteChoice:
    idx = ts.routable
    if not len(idx):
        return NO_WORKER
    d = ts.data
    return RouteChoice(ts.urls[_lexmin(idx, d[OUTSTANDING], _queue_s(d, p), ts.url_rank)], "least-load")


def prefix(ts: TableSnapshot, p: PolicyParams) -> RouteChoice:
    idx = ts.routable
    if not len(idx):
        return NO_WORKER
    d = ts.data
    best = _lexmin(idx, -ts.cached, d[OUTSTANDING], _queue_s(d, p), ts.url_rank)
    return RouteChoice(ts.urls[best], "prefix-hit" if ts.cached[best] > 0 else "least-load")


def prefix_only(ts: TableSnapshot, p: PolicyParams) -> RouteChoice:
    idx = ts.routable
    if not len(idx):
        return NO_WORKER
    c = ts.cached[idx]
    longest = c.max()
    ties = idx[c == longest]
    best = int(ties[policies._spread(ts.request.seq, len(ties))])
    return RouteChoice(ts.urls[best], "prefix-hit" if longest > 0 else "random")


def _predicted_ttft(d: np.ndarray, uncached: np.ndarray, cols=slice(None)) -> np.ndarray:
    """snapshot.predicted_ttft_s: cal * ((base * prefill_requests + queued tokens / rate) / (1 - passing)
    + (base * 1 + uncached / rate))."""
    base, rate = d[BASE, cols], d[RATE, cols]
    wait = (base * d[PREFILL_REQUESTS, cols] + (d[PREFILL_TOKENS, cols] + d[EXTERNAL, cols]) / rate) / \
        (1.0 - d[PASSING, cols])
    return d[CALIBRATION, cols] * (wait + (base * 1 + uncached / rate))


def _rows_ok(rows: list[tuple[float, ...]], idx: list[int]) -> bool:
    """Whether Python floats decide over these columns as numpy does: a few of them (SMALL), and no zero
    rate and no passing share of 1 (where numpy's division gives inf / nan, Python's raises)."""
    if len(idx) > SMALL:
        return False
    for i in idx:
        c = rows[i]
        if c[RATE] == 0 or c[PASSING] == 1.0:
            return False
    return True


def prefix_load(ts: TableSnapshot, p: PolicyParams) -> RouteChoice:
    if not ts.idx:
        return NO_WORKER
    if _rows_ok(ts.rows, ts.idx):
        return _prefix_load_rows(ts, p)
    idx = ts.routable
    d, r = ts.data, ts.request
    queue = _queue_s(d, p)
    cost = (d[BASE] * 1 + ((1 + p.miss_weight) * _uncached(ts)) / d[RATE]) + queue
    out = d[OUTSTANDING]
    best = _lexmin(idx, cost, out, queue, ts.url_rank)
    o = out[idx]
    least = o.min()
    ob, lf = float(out[best]), float(least)  # the guard on the cheapest worker alone first (the test of `allowed`)
    if not (ob - lf > p.guard_abs and ob > p.guard_rel * lf):
        return RouteChoice(ts.urls[best], "least-cost")
    allowed = idx[~((o - least > p.guard_abs) & (o > p.guard_rel * least))]
    spread = _lexmin(allowed, cost, out, queue, ts.url_rank)
    col = slice(spread, spread + 1)
    if _predicted_ttft(d, _uncached(ts)[col], col)[0] <= r.ttft_budget_s:
        return RouteChoice(ts.urls[spread], "load-guard")
    return RouteChoice(ts.urls[best], "saturated")


def _prefix_load_rows(ts: TableSnapshot, p: PolicyParams) -> RouteChoice:
    """prefix_load over a few workers in Python floats: the same operations in the same order per worker
    (_queue_s, the cost, the guard, _predicted_ttft), and _lexmin's least tuple."""
    rows, rank, r = ts.rows, ts.rank, ts.request
    lam, kappa = p.decode_stream_tokens, 1 + p.miss_weight
    keys = []  # (cost, outstanding, queue, URL rank, column) per candidate: _lexmin's keys
    for i in ts.idx:
        c = rows[i]
        base, rate = c[BASE], c[RATE]
        queue = base * c[PREFILL_REQUESTS] + ((c[PREFILL_TOKENS] + c[EXTERNAL]) + lam * c[DECODE_STREAMS]) / rate
        cost = (base * 1 + (kappa * ts.unc(i)) / rate) + queue
        keys.append((cost, c[OUTSTANDING], queue, rank[i], i))
    best_key = min(keys)
    best = best_key[-1]
    least = min([k[1] for k in keys])
    ob = best_key[1]
    if not (ob - least > p.guard_abs and ob > p.guard_rel * least):
        return RouteChoice(ts.urls[best], "least-cost")
    spread = min([k for k in keys if not (k[1] - least > p.guard_abs and k[1] > p.guard_rel * least)])[-1]
    if _ttft_of(rows[spread], ts.unc(spread)) <= r.ttft_budget_s:
        return RouteChoice(ts.urls[spread], "load-guard")
    return RouteChoice(ts.urls[best], "saturated")


TABLE_POLICIES = {
    policies.POLICIES["round-robin"]: round_robin,
    policies.POLICIES["least-load"]: least_load,
    policies.POLICIES["prefix"]: prefix,
    policies.POLICIES["prefix-only"]: prefix_only,
    policies.POLICIES["prefix-load"]: prefix_load,
}
TABLE_ADMISSION = ("leading", "off")  # admission modes decided on the table (lagging: on the full snapshot)


def _ttft_of(c: list[float], uncached: float) -> float:
    """_predicted_ttft of one worker's column `c` (a list of Python floats): the same operations in the same
    order. ZeroDivisionError where numpy would give inf / nan (a zero rate, a passing share of 1)."""
    base, rate = c[BASE], c[RATE]
    wait = (base * c[PREFILL_REQUESTS] + (c[PREFILL_TOKENS] + c[EXTERNAL]) / rate) / (1.0 - c[PASSING])
    return c[CALIBRATION] * (wait + (base * 1 + uncached / rate))


def _chosen_test(c: list[float], unc: float, cls: WorkloadClass, cfg: AdmissionConfig, budget: float,
                 idle_budget: float, now: float) -> tuple[float | None, bool, bool]:
    """admit's `meets_polite` on the chosen worker's column `c` alone, in Python floats: (predicted TTFT,
    meets, polite). (None, False, False) when a denominator is 0: the numpy path then decides, with its inf
    / nan."""
    if c[RATE] == 0 or c[PASSING] == 1.0:
        return None, False, False
    pred = _ttft_of(c, unc)
    if c[OUTSTANDING] == 0 and c[EXTERNAL] == 0:  # idle
        return pred, True, True
    ok = pred * c[ERROR_HI] * c[MARGIN] <= min(budget, idle_budget)
    if cfg.check_tpot:
        ok = c[TPOT_BASE] + c[TPOT_PER_STREAM] * (c[DECODE_STREAMS] + 1) <= cls.tpot_slo_s and ok
    warm = c[RATE_SAMPLES] >= cfg.warmup_samples or c[PREFILL_TOKENS] == 0
    deadline = c[DEADLINE]
    polite = warm and (deadline == np.inf or c[CALIBRATION] * (c[BASE] * 1 + unc / c[RATE]) <= deadline - now)
    return pred, bool(ok), bool(polite)


def admit(ts: TableSnapshot, choice: RouteChoice, cls: WorkloadClass, classes: tuple[WorkloadClass, ...],
          cfg: AdmissionConfig, queue_room: int, held: bool = False) -> Admission:
    """admission.admit (modes leading and off) on the table."""
    r = ts.request
    chosen = ts.col.get(choice.worker, -1) if choice.worker is not None else -1
    if not ts.idx or chosen < 0 or not ts.allowed(chosen):
        return Admission("reject", reason="no-worker", retry_after_s=1.0)
    c = ts.rows[chosen]
    if cfg.mode == "off":
        if c[RATE] != 0 and c[PASSING] != 1.0:  # (in Python floats: the same operations)
            return Admission("admit", ts.urls[chosen], _ttft_of(c, ts.unc(chosen)))
        col = slice(chosen, chosen + 1)
        return Admission("admit", ts.urls[chosen], float(_predicted_ttft(ts.data, _uncached(ts)[col], col)[0]))
    if cfg.mode != "leading":
        raise ValueError(f"admission mode {cfg.mode!r} is not decided on the table")
    budget = cls.ttft_slo_s - (r.now - r.arrival_s)  # admission.ttft_budget_s
    idle_budget = idle_budget_s(cls, classes, cfg) if cls.sheddable else float("inf")  # (its value then)

    def meets_polite(cols):
        """(predicted TTFT, meets its SLO, polite) of the workers in `cols` (all: slice(None))."""
        dc = d[:, cols]
        pred = _predicted_ttft(d, unc[cols], cols)
        idle = (dc[OUTSTANDING] == 0) & (dc[EXTERNAL] == 0)
        if cfg.check_tpot:
            tpot_ok = dc[TPOT_BASE] + dc[TPOT_PER_STREAM] * (dc[DECODE_STREAMS] + 1) <= cls.tpot_slo_s
            meets = idle | (tpot_ok & (pred * dc[ERROR_HI] * dc[MARGIN] <= min(budget, idle_budget)))
        else:
            meets = idle | (pred * dc[ERROR_HI] * dc[MARGIN] <= min(budget, idle_budget))
        warm = (dc[RATE_SAMPLES] >= cfg.warmup_samples) | (dc[PREFILL_TOKENS] == 0)
        own = dc[CALIBRATION] * (dc[BASE] * 1 + unc[cols] / dc[RATE])  # snapshot.own_prefill_s
        deadline = dc[DEADLINE]
        slack_ok = (deadline == np.inf) | (own <= deadline - r.now)
        polite = idle | (warm & slack_ok)
        return pred, meets, polite

    # the chosen worker alone first: when it meets the SLO and is polite it is admitted (below: `best =
    # chosen`), and no other worker's prediction is needed -- the same operations on one column, in Python
    # floats (IEEE double, as numpy's float64: the same results; numpy on a 1-element array costs ~1 µs per op)
    pred_c, meets_c, polite_c = _chosen_test(c, ts.unc(chosen), cls, cfg, budget, idle_budget, r.now)
    if meets_c and polite_c:
        return Admission("admit", ts.urls[chosen], pred_c)
    if meets_c and pred_c is not None:
        # polite needs idle or warm: when no candidate is either, none is polite, `nice` below is empty and the
        # chosen worker (meeting) is admitted -- known without the other workers' predictions
        if len(ts.idx) <= SMALL:
            rows, warmup = ts.rows, cfg.warmup_samples
            some = any((w[OUTSTANDING] == 0 and w[EXTERNAL] == 0) or w[RATE_SAMPLES] >= warmup
                       or w[PREFILL_TOKENS] == 0 for w in map(rows.__getitem__, ts.idx))
        else:
            dr = ts.data[:, ts.routable]
            some = (((dr[OUTSTANDING] == 0) & (dr[EXTERNAL] == 0)) | (dr[RATE_SAMPLES] >= cfg.warmup_samples)
                    | (dr[PREFILL_TOKENS] == 0)).any()
        if not some:
            return Admission("admit", ts.urls[chosen], pred_c)
    # the other workers' predictions: on the numpy forms
    idx, d, unc = ts.routable, ts.data, _uncached(ts)
    pred, meets, polite = meets_polite(slice(None))
    meeting = idx[meets[idx]]
    if len(meeting):
        nice = meeting[polite[meeting]]
        if polite[chosen] and meets[chosen]:
            best = chosen
        elif len(nice):
            best = _lexmin(nice, pred, ts.url_rank)
        else:
            best = chosen if meets[chosen] else _lexmin(meeting, pred, ts.url_rank)
        return Admission("admit", ts.urls[best], float(pred[best]))

    pw = pred[idx]
    gap_s = max(0.0, float(pw.min()) - min(budget, idle_budget))
    least_base = float(d[BASE, idx].min())
    wait_s = max(0.0, cls.hold_deadline_s(r.arrival_s, least_base) - r.now)
    share = 1.0 / len(idx)
    if not (cfg.hold == "sheddable" and not cls.sheddable):
        dd = d[:, idx]
        base, rate = dd[BASE], dd[RATE]
        ahead = (base * (dd[PREFILL_REQUESTS] + share * r.ahead_requests)
                 + ((dd[PREFILL_TOKENS] + dd[EXTERNAL]) + share * r.ahead_tokens) / rate) / (1.0 - dd[PASSING])
        behind = dd[CALIBRATION] * (ahead + (base * 1 + unc[idx] / rate))  # snapshot.behind_ttft_s
        lo, hi = dd[ERROR_LO], dd[ERROR_HI]
        drain = {"fast": 1.0 / lo, "expected": 1.0, "slow": 1.0 / hi}[cfg.hold_drain]
        left_s = np.maximum(0.0, behind - wait_s * drain)
        hopeless = (behind * lo > budget) | (left_s * hi > min(budget - wait_s, idle_budget))
        all_hopeless = bool(hopeless.all())
    if (cfg.hold == "sheddable" and not cls.sheddable) or all_hopeless:
        return Admission("reject", reason="deadline" if held else "slo", retry_after_s=gap_s)
    # admission._hold
    deadline_s = cls.hold_deadline_s(r.arrival_s, least_base)
    if held and r.now >= deadline_s:
        return Admission("reject", reason="deadline", retry_after_s=gap_s)
    if not held and queue_room <= 0:
        return Admission("reject", reason="queue-full", retry_after_s=gap_s)
    return Admission("hold", reason="slo", retry_after_s=gap_s)

