"""The workers as columns: what a routing decision reads of every worker, kept up to date incrementally.

A full `RouteSnapshot` builds a `WorkerView` of every worker per decision (~5 µs each, plus matching the prompt
in every worker's prefix map and scoring every view in Python: ~15 µs per worker per decision, 15 ms at
1,000 workers). `WorkerTable` holds the same numbers, one float64 row per field and one column per worker
(pool order), and re-reads only the workers whose state changed since the last decision
(`WorkerPool.changed`, filled by `WorkerState.__setattr__`); the pool's order is rebuilt when a worker joins
or leaves (`WorkerPool.version`). Every value is the `WorkerView`'s (`WorkerState.view`), stored as float64:
the integer fields are exact there (< 2**53). The one field of the view that depends on `now`,
`pending_slack_s`, is kept as the least pending TTFT deadline (`DEADLINE`, inf when none).

The same numbers are kept as Python floats too, one tuple per worker (`rows`, in FIELDS order): a decision
over a few workers reads them without numpy (numpy costs ~1 µs per call whatever the size; an 8-worker
decision made ~30 such calls). The float64 array is brought up to date only when a decision asks for it
(`array()`: the columns changed since are copied in then).

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
    # every value a Python float (what float64 holds: the integer fields are exact, < 2**53), so the Python
    # arithmetic on a row is numpy's float64 arithmetic on its column
    return (float(w.healthy and not w.draining), float(w.healthy), float(w.outstanding),
            float(max(0, w.prefill_tokens)), float(len(pending)), float(w.decode_streams),
            float(w.external_prefill_tokens), float(prefill.overhead_s), float(prefill.rate_tps),
            float(w.calibration.value or 1.0), float(tpot.a), float(tpot.b), float(prefill.samples),
            float(deadline), float(w.ttft_error_hi.value), float(w.ttft_error_lo.value),
            float(w.slo_margin.value), 0.0)


class WorkerTable:
    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.version = -1
        self.urls: list[str] = []
        self.workers: list[WorkerState] = []
        self.col: dict[str, int] = {}  # url -> column
        self.data = np.zeros((len(FIELDS), 0))
        self.rows: list[tuple[float, ...]] = []  # the same numbers: each worker's column as Python floats
        self.url_rank = np.zeros(0)  # each worker's place in URL order (the policies' last tie-break)
        self.rank: list[int] = []  # the same as Python ints
        self.reads = 0  # workers re-read so far (for tests and profiles)
        self._routable: tuple[np.ndarray, np.ndarray] | None = None  # (mask, index) of the ROUTABLE row
        self._routable_list: list[int] | None = None  # the index as Python ints
        self._stale: set[int] = set()  # columns of `rows` not yet copied into `data`

    def routable(self) -> tuple[np.ndarray, np.ndarray]:
        """(ROUTABLE row != 0, the columns where it is), both read-only; rebuilt only when a worker joined, left
        or changed its routable flag since (a decision with no exclusions reads them as they are)."""
        if self._routable is None:
            mask = self.array()[ROUTABLE] != 0
            idx = np.flatnonzero(mask)
            mask.flags.writeable = idx.flags.writeable = False
            self._routable = (mask, idx)
        return self._routable

    def routable_list(self) -> list[int]:
        """routable()'s index as a list of Python ints (the same columns, kept as long)."""
        if self._routable_list is None:
            self._routable_list = [i for i, row in enumerate(self.rows) if row[ROUTABLE] != 0]
        return self._routable_list

    def refresh_rows(self) -> list[tuple[float, ...]]:
        """Bring `rows` up to date (re-read the workers that changed); returns them (do not modify). The
        float64 array follows when `array()` is called."""
        pool, changed = self.pool, self.pool.changed
        if pool.version != self.version:
            self.version = pool.version
            self.workers = list(pool)
            self.urls = [w.url for w in self.workers]
            self.col = {u: i for i, u in enumerate(self.urls)}
            order = sorted(range(len(self.urls)), key=self.urls.__getitem__)
            self.rank = [0] * len(self.urls)
            for r, i in enumerate(order):
                self.rank[i] = r
            self.url_rank = np.array(self.rank, dtype=float)
            changed.clear()
            self.rows = [row_of(w) for w in self.workers]
            self.data = np.array(self.rows, dtype=float).T.copy() if self.rows else np.zeros((len(FIELDS), 0))
            self._stale.clear()
            self.reads += len(self.workers)
            self._routable = self._routable_list = None
        elif changed:
            rows, col, get, stale = self.rows, self.col, pool.get, self._stale
            for url in changed:
                i = col.get(url)
                if i is not None:
                    row = row_of(get(url))
                    if row[ROUTABLE] != rows[i][ROUTABLE]:
                        self._routable = self._routable_list = None
                    rows[i] = row
                    stale.add(i)
            self.reads += len(changed)
            changed.clear()
        return self.rows

    def array(self) -> np.ndarray:
        """The float64 table as `rows` have it now (rows: FIELDS, columns: workers in pool order), read-only."""
        if self._stale:
            data, rows = self.data, self.rows
            for i in self._stale:
                data[:, i] = rows[i]
            self._stale.clear()
        out = self.data.view()
        out.flags.writeable = False
        return out

    def refresh(self) -> np.ndarray:
        """Bring the table up to date; returns it (rows: FIELDS, columns: workers in pool order), read-only."""
        self.refresh_rows()
        return self.array()
