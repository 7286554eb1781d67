"""The workers as columns: what a routing decision reads of every worker, kept up to date incrementally.

A full `RouteSnapshot` builds a `WorkerView` of every worker per decision (~5 µs each, plus matching the prompt
in every worker's prefix map and scoring every view in Python: ~15 µs per worker per decision, 15 ms at
1,000 workers). `WorkerTable` holds the same numbers, one float64 row per field and one column per worker
(pool order), and re-reads only the workers whose state changed since the last decision
(`WorkerPool.changed`, filled by `WorkerState.__setattr__`); the pool's order is rebuilt when a worker joins
or leaves (`WorkerPool.version`). Every value is the `WorkerView`'s (`WorkerState.view`), stored as float64:
the integer fields are exact there (< 2**53). The one field of the view that depends on `now`,
`pending_slack_s`, is kept as the least pending TTFT deadline (`DEADLINE`, inf when none).

Decisions on the table are in router/table_decisions.py. No clock, no I/O.
"""

from __future__ import annotations

import math

import numpy as np

from tokenmill.router.worker_state import WorkerPool, WorkerState

FIELDS = ("routable", "healthy", "outstanding", "prefill_tokens", "prefill_requests", "decode_streams",
          "external_prefill_tokens", "ttft_base_s", "prefill_rate_tps", "ttft_calibration", "tpot_base_s",
          "tpot_per_stream_s", "rate_samples", "deadline", "ttft_error_hi", "ttft_error_lo", "ttft_slo_margin",
          "passing_share")
(ROUTABLE, HEALTHY, OUTSTANDING, PREFILL_TOKENS, PREFILL_REQUESTS, DECODE_STREAMS, EXTERNAL, BASE, RATE,
 CALIBRATION, TPOT_BASE, TPOT_PER_STREAM, RATE_SAMPLES, DEADLINE, ERROR_HI, ERROR_LO, MARGIN, PASSING) = range(len(FIELDS))


def row_of(w: WorkerState) -> tuple[float, ...]:
    """One worker's column: the fields of w.view() (and its least pending TTFT deadline)."""
    # the same reads as WorkerState.view (test_table_rows_are_the_views...), without building the view
    pending = w._pending
    if pending:  # the least pending deadline, as WorkerState.view keeps it (one scan per change of the least)
        if w._min_deadline is None:
            object.__setattr__(w, "_min_deadline", min([f.ttft_deadline_s for f in pending.values()]))
        deadline = w._min_deadline
    else:
        deadline = math.inf
    prefill, tpot = w.rates.prefill, w.rates.tpot
    return (float(w.healthy and not w.draining), float(w.healthy), w.outstanding, max(0, w.prefill_tokens),
            len(pending), w.decode_streams, w.external_prefill_tokens, prefill.overhead_s, prefill.rate_tps,
            w.calibration.value or 1.0, tpot.a, tpot.b, prefill.samples, deadline, w.ttft_error_hi.value,
            w.ttft_error_lo.value, w.slo_margin.value, 0.0)


class WorkerTable:
    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.version = -1
        self.urls: list[str] = []
        self.workers: list[WorkerState] = []
        self.col: dict[str, int] = {}  # url -> column
        self.data = np.zeros((len(FIELDS), 0))
        self.url_rank = np.zeros(0)  # each worker's place in URL order (the policies' last tie-break)
        self.reads = 0  # workers re-read so far (for tests and profiles)
        self._routable: tuple[np.ndarray, np.ndarray] | None = None  # (mask, index) of the ROUTABLE row

    def routable(self) -> tuple[np.ndarray, np.ndarray]:
        """(ROUTABLE row != 0, the columns where it is), both read-only; rebuilt only when a worker joined, left
        or changed its routable flag since (a decision with no exclusions reads them as they are)."""
        if self._routable is None:
            mask = self.data[ROUTABLE] != 0
            idx = np.flatnonzero(mask)
            mask.flags.writeable = idx.flags.writeable = False
            self._routable = (mask, idx)
        return self._routable

    def refresh(self) -> np.ndarray:
        """Bring the table up to date; returns it (rows: FIELDS, columns: workers in pool order), read-only."""
        pool, changed = self.pool, self.pool.changed
        if pool.version != self.version:
            self.version = pool.version
            self.workers = list(pool)
            self.urls = [w.url for w in self.workers]
            self.col = {u: i for i, u in enumerate(self.urls)}
            self.data = np.zeros((len(FIELDS), len(self.urls)))
            order = sorted(range(len(self.urls)), key=self.urls.__getitem__)
            self.url_rank = np.empty(len(self.urls))
            self.url_rank[order] = np.arange(len(self.urls))
            changed.clear()
            for i, w in enumerate(self.workers):
                self.data[:, i] = row_of(w)
            self.reads += len(self.workers)
            self._routable = None
        elif changed:
            data, col, get = self.data, self.col, pool.get
            routable = data[ROUTABLE]
            for url in changed:
                i = col.get(url)
                if i is not None:
                    row = row_of(get(url))
                    if row[ROUTABLE] != routable[i]:
                        self._routable = None
                    data[:, i] = row
            self.reads += len(changed)
            changed.clear()
        out = self.data.view()
        out.flags.writeable = False
        return out
