"""GoodputGuard: `auto`'s check against its own cost model, by measured throughput.

The policy (spec/policy.py) chooses k per sequence from a *model* of the step's cost. When that model is
wrong (a shape priced by the prior, a cost cell measured in a quiet moment and its neighbour in a busy one,
the draft's catch-up after a k = 0 stretch, bookkeeping it does not see), `auto` can keep speculating while
speculation measurably loses: session 6 measured draft `auto` at 0.89x of off at batch 1 and 0.76–0.83x
through the server. The guard makes that impossible to sustain: per batch-size bucket it measures the
throughput actually delivered (tokens emitted / seconds of the step, the engine's own timings) under each
*cap* on k it lets the policy use (arm 0 = speculation off, arm K = the policy with every k ≤ K), and it runs
the policy under the best measured cap.

    bucket(n)      decoding sequences -> 1, 2, 3-4, 5-8, ..., 65+ (batch-size tiers, like vLLM's and SGLang's
                   per-batch-size schedules)
    arm            the k in force for the bucket; starts at 0 (off), the cost model's choice is the first probe
    probe          every `probe_every` steps of a bucket, `probe_len` steps under a neighbouring cap (cur − 1
                   and cur + 1 alternately) and, every other probe, under cap 0 (off), so the reference stays
                   measured at the same batch size and the same moment of the machine's load; while off, the
                   probe is the best cap measured so far. With shadow content (n-gram) in a bucket of fewer than
                   `neighbor_probe_min` sequences the neighbour's slot is skipped (as a failed probe): there a
                   neighbour's extra rows cost less than the machine's noise (the content trigger below still
                   probes a cap that wins on new content). The first probe comes after `min_samples` steps, and
                   a probe of an arm with fewer than `min_samples` samples runs until it has them, so a
                   bucket has its first comparison within ~2·min_samples steps
    ladder         from off, a bucket probes the caps (first, 2, 4, k_max) in turn until each is measured,
                   then the best measured one (a draft model may lose at k = 1 and win at k = 4, at batch 1
                   and at 16 sequences alike); no switch before every rung is measured (one that beats off a
                   little must not win before a better one was tried). The first rung is the cost model's
                   suggestion in a bucket of <= 4 sequences (any bucket with `free_probes`: n-gram, whose
                   probes wake no draft model), k = 1 (the cheapest probe) in bigger ones; the
                   next rung follows at once unless the rungs' measured cost asks a longer wait than the
                   ladder's own length (a big batch, where each probe from off is a draft catch-up of every
                   sequence): then it waits that (the probe-cost amortisation below). The climb stops at a
                   rung that loses to off and to the rung below it (longer drafts only cost more past it)
    switch         to the arm whose measured rate beats the current one's by `margin` (relative), each having
                   at least `min_samples` steps, in two comparisons in a row (after the first win the current
                   arm runs for a probe's length, then the challenger is probed again: one lucky window of a
                   noisy machine does not switch); a failed probe doubles the probe interval (up to
                   `max_probe_every`; `max_probe_every_shadow` where shadow content prices every cap, and
                   there a cap that wins on the current content is probed at once), a switch resets it: at a
                   steady load the guard settles and probes rarely (bounded exploration cost), a changed load
                   is found again.
    probe cost     what a probe measurably cost: the seconds of its steps and of the `settle` steps after it
                   (back at the current arm: a draft catching up on what it skipped) less what the current
                   arm's rate would have taken for the same tokens. The first step of a probe from off is a
                   draft catch-up of *every* sequence (all the tokens since the last probe, a new request's
                   whole prompt): not part of any arm's rate (`settle`), so without this account a big batch
                   paid it unseen every <= 512 steps. After a failed probe the next one waits at least
                   probe_cost / (explore_budget x the current arm's mean step) steps: probing takes at most
                   ~explore_budget of the bucket's time at any batch size (a confirming probe is not delayed,
                   a ladder's rung only as said above; a probe that gained costs nothing).

What a step costs under a cap is everything speculation adds to it: the decoder passes in every step with
decoding sequences, including a new request's first draft catch-up (the draft's prefill of its context,
paid once per request while the cap is on: through the server at 16 sessions that was ~18% of the time, and
leaving those steps out made k = 1 look like a win there) and steps that carry a prefill chunk (their
seconds less the chunk's share, estimated from steps without speculation).

Content-matched comparison. N-gram acceptance is bursty (a repeated span accepts every draft, fresh code none),
so per-cap rates measured on different steps compare different content: whichever cap ran during a repeated span
looked best (session 12, batch-1 n-gram: {0: 250, 2: 175, 4: 260, 5: 543, 6: 1578} tok/s; auto 1.35x where a
fixed k = 4 made 1.56x). The decoder therefore passes each step's per-sequence (drafted k_i, accepted a_i). A
proposal under cap K' <= K is the first K' tokens of the one under K (n-gram: the same match, its first K'
tokens; a draft model: the same autoregressive steps, cut earlier), so on the same step cap K' would have
emitted min(a_i, K') + 1 tokens per sequence: known exactly. And to cover the content cap K covered in that step
(a_i + 1 tokens) cap K' needs (a_i + 1) / (min(a_i, K') + 1) of its own steps (exactly 1 when a_i < K'; when a_i
>= K' the next steps continue the same match). Per bucket and per window W (the steps run at caps >= W) the guard
keeps, for every cap K' <= W, EMAs of the tokens and of the sequence-steps K' would have needed for them; the
tokens per sequence-step of K' on window W is their ratio. An arm's seconds per step and sequences per step
come from its own steps (the cost follows the rows run, not the content), so

    rate(K' | W) = tokens per sequence-step of K' on W x (sequences / seconds) of K's own steps

and two caps A, B are compared on the window max(A, B): content both were (or would have been) run on. Off
is 1 token per sequence-step on any content; a smaller cap than the running one is compared on the running
one's own steps; a larger one on its probes' steps (its extra acceptance is known only where it ran). A step
without the per-sequence counts (tests with synthetic rates) leaves the window tables alone: the arm's own
tokens/seconds are used then (the comparison of rates measured on different steps, as before).

Content from shadow proposals (n-gram only: a lookup costs microseconds, a draft model's proposal is k forwards).
An off bucket has no drafted steps, so its caps were priced on their probes' 8-10 steps: a ladder run on the fresh
opening of an output lost everywhere and kept the bucket off for hundreds of steps after the content had turned
repetitive (session 15). The decoder therefore runs a k_max lookup for a sample of the decoding sequences on every
step and scores the proposal against the tokens the target then emits (what a verify would have kept: exact for
greedy, the same acceptance probability for a sampled point-mass proposal), one k_max proposal per a_i + 1 tokens,
like a speculating sequence's. observe_shadow keeps their tokens and the sequence-steps each cap K' would have
needed (the table above, for every K' <= k_max). While off, every comparison (the ladder's, the switch from off,
which cap to probe) takes its content from there, its seconds per step still from the cap's own probes; and a
measured cap whose rate on that content beats off by the margin is probed at once instead of after the doubled
interval (at most once per max(base interval, amortised probe cost) steps). While on, the same table prices the
caps *above* the running one (a comparison on a window W > the current cap): their content is otherwise known
only from their probes' 8-10 steps, so at batch 1 each one-step climb (4 -> 5 -> .. -> 8) needed two lucky probe
windows and took thousands of steps (session 20: served n-gram auto 1.74x where a fixed k = 8 made 2.03x); a
comparison within the running cap keeps its exact counts (the cf windows).

Each arm's rate is the ratio of two EMAs (tokens and seconds, per observation of that arm), so a step that
emitted 5 tokens and one that emitted 1 weigh by their time. No clock is read here: the engine passes the
measured seconds in (the policy and this guard run in the simulator as well).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuardConfig:
    k_max: int = 6
    probe_every: int = 24  # steps of a bucket between probes (at first, and after a switch)
    max_probe_every: int = 512  # the interval after repeated failed probes (probe cost ~2% when settled)
    # ... in a bucket with shadow content (n-gram): every cap's content is known without probing (above the running
    # cap from the shadow table, at or below it from the exact verify counts), so periodic probes only re-measure
    # seconds per step; a change of content that makes another measured cap win triggers a probe at once
    max_probe_every_shadow: int = 4096
    probe_len: int = 8  # steps a probe runs under the probed cap (the first `settle` not recorded)
    min_samples: int = 8  # steps an arm needs before it can win or lose a comparison
    margin: float = 0.03  # a challenger must beat the current arm's measured rate by this (relative)
    decay: float = 0.95  # EMA weight of an arm's history per new observation of that arm
    # EMA weight per step of the content tables (the tokens each cap would have emitted: cf windows, shadow): the
    # content a switch is judged on (~20 steps). A longer memory was tried against the batch-1 switches k = 8 -> off
    # on a fresh stretch of code seen in a served trace (session 21): 0.98 measured no better through the server
    # (c = 1: 2.28x vs 2.31x of off; c = 8: 1.45x vs 1.47x), 0.97 oscillated in the steady-content test
    content_decay: float = 0.95
    # with shadow content (n-gram), buckets of fewer sequences than this skip the periodic cur +- 1 probes (off stays):
    # there a cap's extra verify rows cost less than the machine's step-to-step noise, so an 8-step probe of a
    # neighbour measured noise, and each lucky window switched the cap and restarted the probe schedule (session 24,
    # batch 1, code workload: 20-30 switches and ~170 probes per 8 x 4 s, auto 0.96-0.98x of a fixed k = 8; without
    # them 5-7 switches, 0.99x). The content of every cap is known there without probing (shadow and verify
    # counts), so a cap that wins on new content is still probed at once (_content_winner). From this size up, where
    # rows cost compute and neighbouring caps differ measurably (32 sequences: k = 3-4 best, 8 0.93x), they stay
    neighbor_probe_min: int = 16
    settle: int = 2  # steps after a change of k that are not recorded (a draft's catch-up, new row counts)
    outlier: float = 4.0  # a step longer than this many times the arm's mean step counts as that long
    # probe cost amortisation: what a probe measurably cost (its steps and the `settle` steps after it, against
    # the current arm's rate: a draft's catch-up of every sequence included) is spread over enough steps that
    # probing takes at most this share of a bucket's time; at a large batch a probe costs in proportion
    explore_budget: float = 0.02
    max_amortised_every: int = 8192  # the longest interval the amortisation may ask for
    # the proposer's lookups are free and wake no draft model (n-gram): a probe from off costs only its verify rows,
    # and the decoder's shadow proposals price every cap's content while off, so a new bucket of any size probes at
    # the base interval from the cost model's suggestion (not at k = 1 after probe_every x size/4 steps: at 32
    # sequences that kept n-gram off for the first ~190-250 steps of a level, ~6% of a 10-s level, session 22)
    free_probes: bool = False
    # with free_probes: a new bucket starts at the cap of the nearest bucket that runs one (not off); see cap()
    warm_start: bool = True

    def __post_init__(self):
        if not 1 <= self.k_max <= 16:
            raise ValueError(f"guard k_max must be in [1, 16], got {self.k_max}")
        if (self.probe_every < 1 or self.max_probe_every < self.probe_every or self.probe_len < 1
                or self.max_probe_every_shadow < self.max_probe_every):
            raise ValueError("guard needs probe_every >= 1, max_probe_every >= probe_every, "
                             "max_probe_every_shadow >= max_probe_every, probe_len >= 1")
        if (self.min_samples < 1 or self.margin < 0 or not 0 < self.decay < 1 or not 0 < self.content_decay < 1
                or self.outlier <= 1):
            raise ValueError("guard needs min_samples >= 1, margin >= 0, decay and content_decay in (0, 1), "
                             "outlier > 1")
        if not 0 < self.explore_budget < 1 or self.max_amortised_every < self.max_probe_every:
            raise ValueError("guard needs explore_budget in (0, 1) and max_amortised_every >= max_probe_every")


def _need(accepted: list[int], cap: int) -> tuple[float, list[float]]:
    """Sequence-steps with a_i accepted drafts each (a_i + 1 tokens emitted): the tokens, and for every cap
    K' <= cap the sequence-steps K' would have needed for them, sum_i (a_i + 1) / (min(a_i, K') + 1) — a sequence
    with a_i <= K' needs one, the others (a_i + 1) / (K' + 1): one pass over the sorted a_i, not one per K'."""
    s = sorted(accepted)
    n = len(s)
    total = float(sum(s) + n)
    need = []
    i, done = 0, 0  # sequences with a_i <= K' so far, and their tokens
    for kk in range(cap + 1):
        while i < n and s[i] <= kk:
            done += s[i] + 1
            i += 1
        need.append(i + (total - done) / (kk + 1))
    return total, need


def bucket(n: int) -> int:
    """Decoding sequences -> bucket: 1, 2, 4 (3-4), 8 (5-8), ..., 64, then 65+ as 128."""
    b = 1
    while b < n and b < 128:
        b *= 2
    return b


class _Arm:
    __slots__ = ("tokens", "seconds", "samples", "nseq", "first")

    def __init__(self):
        self.tokens = 0.0
        self.seconds = 0.0
        self.samples = 0
        self.nseq = 0.0  # EMA of decoding sequences per step (same weights as seconds)
        self.first: list[tuple[float, float, int]] = []  # the first observations, held until FIRST_HELD are in

    def mean_step(self, decay: float) -> float:
        """The EMA's mean seconds per step (0 before any sample)."""
        if not self.samples:
            return 0.0
        return self.seconds * (1 - decay) / (1 - decay ** min(self.samples, 200))

    def add(self, tokens: float, seconds: float, n: int, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.nseq = decay * self.nseq + n
        self.samples += 1

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# An arm's first observations are held until there are this many, then each enters capped at `outlier` x their
# median: the outlier cap needs a mean to compare with, and without one a stall of the shared machine in an arm's
# first steps (a GC pass of a process holding several engines: 45 ms against ~1 ms steps, session 19) made a
# probe's arm look 10x slower than it was, and the probe so costly that the amortisation waited thousands of steps
# before probing again: n-gram auto stayed off where fixed k = 4 ran 2.2x faster
FIRST_HELD = 3


class _Window:
    """Content-matched counts of one window W (the steps run at caps >= W): EMAs of the tokens emitted and, per
    cap K' <= W, of the sequence-steps K' would have needed for them, and the number of steps. `win[K']` is
    (tokens, sequence-steps of K', samples). Tokens and samples are the same for every K' of a window, so they are
    kept once (one update per step instead of W + 1: the guard's bookkeeping was ~5% of a batch-1 step)."""

    __slots__ = ("tokens", "need", "samples")

    def __init__(self, w: int):
        self.tokens = 0.0
        self.need = [0.0] * (w + 1)
        self.samples = 0

    def __getitem__(self, kk: int) -> tuple[float, float, int]:
        return self.tokens, self.need[kk], self.samples

    def __iter__(self):
        return iter(range(len(self.need)))

    def __len__(self) -> int:
        return len(self.need)


class _Bucket:
    __slots__ = ("cur", "arms", "steps", "next_probe", "interval", "probe_arm", "probe_left", "num_probes",
                 "last_cap", "run", "seed", "base", "ladder", "pending", "win", "win_tail", "probe_cost", "_cf",
                 "_cf_run", "last_probe", "shadow", "size", "warm")

    def __init__(self, k_max: int, probe_every: int, first_probe: int, size: int = 1):
        self.cur = k_max
        self.arms: dict[int, _Arm] = {}
        self.steps = 0
        self.interval = probe_every
        self.next_probe = first_probe
        self.probe_arm: int | None = None
        self.probe_left = 0
        self.num_probes = 0
        self.last_cap: int | None = None  # the k of the last observed step, and how many in a row
        self.run = 0
        self.seed = k_max  # the first k probed from off
        self.base = probe_every  # the probe interval after a switch
        self.ladder: tuple[int, ...] = ()  # the caps probed from off, in order, until each is measured
        self.pending: int | None = None  # an arm that won one comparison: switched to if it wins the next
        # the open probe window: [(cap or None for a transition step, seconds) of every step it touched, tokens];
        # a steady step's seconds enter its cost capped at `outlier` x that cap's mean step (_window)
        self.win: list | None = None
        self.win_tail = 0  # steps after the probe still counted to it (the transition back)
        self.probe_cost: float | None = None  # EMA of a probe's measured cost, seconds (vs the current arm)
        # content-matched windows: cf[W][K'] = [tokens, sequence-steps K' would have needed, samples], EMAs over
        # the steps run at caps >= W (every K' <= W updated together: the same steps)
        self._cf: dict[int, _Window] = {}
        # the steps not yet added to the windows, all under one cap: [cap, steps, decay, tokens, need[0..cap]],
        # EMAs from 0 (every window W <= cap gets the same update, so a run of steps is added in one pass when
        # the windows are read or the cap changes: one list update per step instead of cap of them)
        self._cf_run: list | None = None
        self.last_probe = 0  # the step the last probe started at
        # content of the shadow proposals (observe_shadow), shadow[K'] = [tokens, sequence-steps K'
        # would have needed, samples]; None until the decoder sends any (a proposer without free lookups)
        self.shadow: dict[int, list[float]] | None = None
        self.size = size  # the bucket's batch size (1, 2, 4, ...)
        self.warm = False  # started on at a neighbour's cap (warm_start): its ladder is probed while on

    @property
    def cf(self) -> dict[int, _Window]:
        """The content-matched windows, with every observed step in them."""
        self._add_run()
        return self._cf

    def _add_run(self) -> None:
        """The steps of the pending run into every window W <= its cap, in one pass."""
        run = self._cf_run
        if run is not None:
            self._cf_run = None
            cap, m, d, tokens, need = run
            dm = d ** m
            cf = self._cf
            for w in range(1, cap + 1):
                win = cf.get(w)
                if win is None:
                    win = cf[w] = _Window(w)
                win.tokens = dm * win.tokens + tokens
                win.need = [dm * x + y for x, y in zip(win.need, need)]
                win.samples += m

    def add_content(self, cap: int, d: float, tokens: float, need: list[float]) -> None:
        """One step's content under `cap` (GoodputGuard._content): into the run, or a new run (the old one added)."""
        run = self._cf_run
        if run is not None and (run[0] != cap or run[2] != d):
            self._add_run()
            run = None
        if run is None:
            self._cf_run = [cap, 1, d, tokens, need]
        else:
            run[1] += 1
            run[3] = d * run[3] + tokens
            run[4] = [d * x + y for x, y in zip(run[4], need)]


class GoodputGuard:
    def __init__(self, cfg: GuardConfig | None = None):
        self.cfg = cfg or GuardConfig()
        self.buckets: dict[int, _Bucket] = {}
        self.num_switches = 0  # changes of a bucket's arm (reported beside the k switches)

    def _get(self, n: int) -> _Bucket:
        b = self.buckets.get(bucket(n))
        if b is None:
            b = self.buckets[bucket(n)] = _Bucket(self.cfg.k_max, self.cfg.probe_every,
                                                  self.cfg.min_samples + self.cfg.settle + 1, bucket(n))
        return b

    def has_bucket(self, n: int) -> bool:
        return bucket(n) in self.buckets

    def cap(self, n: int, suggest: int | None = None) -> int:
        """The k for a step with n decoding sequences (advances the bucket's probe schedule). A bucket not
        seen yet starts off (k = 0: speculation must be measured to pay before it runs); `suggest` (the cost
        model's choice) is the first k it probes, default k_max. With free probes (n-gram) and `warm_start` it
        starts at the cap of the nearest bucket that runs one, if any (its first periodic probe is off)."""
        if bucket(n) not in self.buckets:
            b = self._get(n)
            b.cur = 0
            bk = bucket(n)
            # a probe wakes every sequence's draft (a catch-up) and verifies k more rows per sequence: at a
            # large batch it costs in proportion, so big buckets start their ladder at k = 1 (the cheapest
            # probe) and probe less often; a rung that lost delays the next by its measured cost (_amortised)
            free = self.cfg.free_probes
            b.seed = 1 if bk > 4 and not free else max(1, min(self.cfg.k_max, suggest or self.cfg.k_max))
            # from off, probe a ladder of caps, not only the suggestion and its neighbours: a draft model can
            # lose at k = 1 and win at k = 4 (its forward has a fixed cost per draft step): measured at batch 1
            # (session 9) and at 16 sequences (session 11, AVX2: k = 1 0.79x of off's rate on its steps, k = 4
            # level with off; session 9, AVX-512: fixed k = 4 1.10x of off at 16 sessions), so "if one draft
            # does not pay, longer ones do not" is false at every batch size
            b.ladder = tuple(dict.fromkeys([b.seed] + [k for k in (2, 4, self.cfg.k_max) if k <= self.cfg.k_max]))
            b.base = b.interval = min(self.cfg.max_probe_every, self.cfg.probe_every * (1 if free else max(1, bk // 4)))
            b.next_probe = max(b.next_probe, b.interval)
            if free and self.cfg.warm_start:
                # n-gram: a new batch size starts at the cap of the nearest bucket that runs one, not off (whose
                # ladder kept the first ~100 steps of a new load level off or probing: ~4% of a 10-s level at 32
                # sequences, session 24); its first periodic probe is off, so a load where speculation loses is
                # found within ~probe_every + probe_len steps, then its ladder's rungs follow while it runs on
                near = [(abs(other.bit_length() - bk.bit_length()), other) for other, ob in self.buckets.items()
                        if other != bk and ob.cur > 0]
                if near:
                    b.cur = self.buckets[min(near)[1]].cur
                    b.warm = True  # off first, then its ladder's rungs at once: the best cap here may be far
        b = self._get(n)
        b.steps += 1
        if b.probe_left > 0:
            b.probe_left -= 1
            return b.probe_arm
        if b.probe_arm is not None:  # a probe just ended: compare
            b.win_tail = self.cfg.settle  # the transition back is the probe's cost too
            self._decide(b)
            b.probe_arm = None
        if b.steps >= b.next_probe:
            arm = self._probe_target(b)
            b.next_probe = b.steps + b.interval
            if arm is not None:
                b.num_probes += 1
                b.last_probe = b.steps
                a = b.arms.get(arm)  # an arm not yet measured enough gets a probe long enough to compare
                need = self.cfg.min_samples + self.cfg.settle - (a.samples if a is not None else 0)
                length = max(self.cfg.probe_len, need)
                b.probe_arm, b.probe_left = arm, length - 1
                if b.win is None:
                    b.win = [[], 0.0]
                b.win_tail = 0
                return arm
        return b.cur

    def _probe_target(self, b: _Bucket) -> int | None:
        k_max = self.cfg.k_max
        if b.pending is not None:  # an arm that won once is probed again: a switch needs two wins in a row
            return b.pending
        if b.cur == 0:  # off: the ladder's next rung, then the best cap measured so far
            k = self._next_rung(b)
            if k is not None:
                return k
            on = [(self._ratio(b, k, 0), k) for k, a in b.arms.items() if k and a.samples]
            return max(on)[1] if on else b.seed
        if b.warm and (k := self._next_rung(b)) is not None:
            # warm-started: the off reference, then the ladder's rungs (the cap inherited from a neighbouring
            # bucket may be far from this one's best: 8 at 8 sequences, 3-4 at 32 on code, session 24)
            off = b.arms.get(0)
            return 0 if off is None or off.samples < self.cfg.min_samples else k
        up = self._content_winner(b)
        if up is not None:
            return up
        if b.num_probes % 2 == 0:
            return 0  # keep the off reference measured at this batch size
        if b.shadow is not None and b.size < self.cfg.neighbor_probe_min:
            # with shadow content in a small bucket the neighbour's slot is skipped, as if its probe had failed (the
            # interval doubles; the next slot is off again): the off reference keeps its old frequency, not twice
            # it (an off probe costs ~8 steps' tokens where every draft is kept: batch workload, session 24)
            b.num_probes += 1
            b.interval = min(self.cfg.max_probe_every_shadow, b.interval * 2)
            return None
        step = 1 if (b.num_probes // 2) % 2 else -1
        for cand in (b.cur + step, b.cur - step):
            if 1 <= cand <= k_max:
                return cand
        return None

    def _content_winner(self, b: _Bucket) -> int | None:
        """While on, with shadow content: the measured cap (above or below the running one, off included) that
        beats the running one by the margin on the content around now (above it: the shadow table; below: the
        running cap's exact counts), the best such, else None."""
        if b.cur == 0 or b.shadow is None:
            return None
        bar = 1 + self.cfg.margin
        up = [(r, k) for k, a in b.arms.items() if k != b.cur and a.samples >= self.cfg.min_samples
              and (r := self._ratio(b, k, b.cur)) > bar]
        return max(up)[1] if up else None

    def _decide(self, b: _Bucket) -> None:
        cfg = self.cfg
        cur = b.arms.get(b.cur)
        if cur is None or cur.samples < cfg.min_samples:
            return
        if (b.cur == 0 or b.warm) and self._next_rung(b) is not None:
            # from off, the whole ladder is measured before any switch: a rung that beats off a little must not
            # win before a better one was tried (batch 1, draft: k = 1 won, k = 4 was never probed again). The
            # next rung follows at once, unless the rungs so far measurably cost (a big batch: a draft catch-up
            # of every sequence per probe): then it waits their amortised interval (_window sets it)
            b.next_probe = b.steps + cfg.probe_len + cfg.settle
            return
        best, best_score = b.cur, 1 + cfg.margin
        for k, arm in b.arms.items():  # each challenger against the current arm on content both ran on
            if k != b.cur and arm.samples >= cfg.min_samples and (s := self._ratio(b, k, b.cur)) > best_score:
                best, best_score = k, s
        # the second win in a row: switch. From off, the two wins may be two different caps (batch 1, n-gram on the
        # edit workload: k = 4 and k = 6 within a few % of each other, each beating off by ~25%, took turns as the
        # pending challenger and kept the bucket off for ~90 more steps, session 15): speculation beating off was
        # confirmed twice, the best cap now wins, the +-1 probes refine it from there
        if best != b.cur and (best == b.pending or (b.cur == 0 and b.pending is not None)):
            b.cur, b.pending = best, None
            self.num_switches += 1
            b.interval = b.base
        elif best != b.cur:  # a first win (it may be a lucky window on a noisy machine): re-measure the current
            b.pending = best  # arm for a probe's length, then probe the challenger again
            b.next_probe = b.steps + cfg.probe_len + cfg.settle
            return
        else:
            b.pending = None
            b.interval = min(cfg.max_probe_every_shadow if b.shadow is not None else cfg.max_probe_every,
                             b.interval * 2)
        b.next_probe = b.steps + max(b.interval, self._amortised(b))

    def _amortised(self, b: _Bucket) -> int:
        """Steps between probes so that their measured cost is at most `explore_budget` of the bucket's time
        (0 while not measured). A pure function of measured state: the probe's cost in seconds over the current
        arm's mean step."""
        cur = b.arms.get(b.cur)
        if b.probe_cost is None or cur is None or cur.samples < FIRST_HELD or b.probe_cost <= 0:
            return 0
        step_s = cur.mean_step(self.cfg.decay)
        if not step_s > 0:
            return 0
        return min(self.cfg.max_amortised_every, int(b.probe_cost / (self.cfg.explore_budget * step_s)))

    def _window(self, b: _Bucket, cap: int, tokens: int, seconds: float, settling: bool) -> None:
        """Account a step to the open probe window; closed after the probe's transition back: its cost is its
        seconds less what the current arm would have taken for the same tokens (negative: the probe gained). The
        transitions (`settle` steps after a change of k: a draft's catch-up of every sequence) count in full; a
        steady step at most `outlier` x its cap's mean step (a stall of the machine is not the probe's cost)."""
        w = b.win
        w[0].append((None if settling else cap, seconds))
        w[1] += tokens
        if b.probe_arm is None:  # the probe ended: these are the tail steps
            if b.win_tail > 0:
                b.win_tail -= 1
            if b.win_tail <= 0:
                b.win = None
                cur = b.arms.get(b.cur)
                r = cur.rate() if cur is not None else 0.0
                if r > 0:
                    spent = 0.0
                    for k, sec in w[0]:
                        a = b.arms.get(k) if k is not None else None
                        mean = a.mean_step(self.cfg.decay) if a is not None and a.samples >= FIRST_HELD else 0.0
                        spent += min(sec, self.cfg.outlier * mean) if mean > 0 else sec
                    cost = spent - w[1] / r
                    b.probe_cost = cost if b.probe_cost is None else 0.5 * (b.probe_cost + cost)
                    ladder_open = (b.cur == 0 or b.warm) and self._next_rung(b) is not None
                    # a confirming probe is not delayed; a ladder's next rung neither while the rungs' cost is under
                    # a probe's own length (a small batch: the undelayed ladder turns it on within ~200 steps) or a
                    # rung measured so far beats the current arm (a switch follows: the catch-ups are repaid)
                    wait = self._amortised(b)
                    # (a warm-started bucket's rungs are n-gram caps on top of an on bucket: never delayed by
                    # the cost of its off probe)
                    if b.pending is None and (not ladder_open or (
                            not b.warm and wait > self.cfg.probe_len * len(b.ladder) and not self._rung_wins(b))):
                        b.next_probe = max(b.next_probe, b.steps + wait)

    def _next_rung(self, b: _Bucket) -> int | None:
        """The ladder's first rung not measured yet (None: the ladder is done). The climb stops early at a rung
        that loses to off and to the rung below it, each by the margin: past it, longer drafts only cost more
        (each rung is a draft catch-up of every sequence and k more verify rows; at 32 sequences on the AVX2
        box, session 11, decode-only steps of the draft's rungs: k = 1, 2, 4, 6 at 0.72, 0.97, 0.67, 0.76x of
        off's rate in the same window, so the climb would stop at k = 4, sparing the k_max probe). A rung that
        beats off keeps the climb going even when below the one before (batch 1: k = 2 measured below k = 1,
        k = 4-6 best)."""
        min_s = self.cfg.min_samples
        off = b.arms.get(0)
        off_measured = off is not None and off.samples >= min_s
        lose = 1 / (1 + self.cfg.margin)
        prev = None
        for k in b.ladder or (b.seed,):
            a = b.arms.get(k)
            if a is None or a.samples < min_s:
                return k
            if off_measured and prev is not None and self._ratio(b, k, 0) < lose and self._ratio(b, k, prev) < lose:
                return None
            prev = k
        return None

    def _rung_wins(self, b: _Bucket) -> bool:
        """A measured rung of the ladder beats the current arm by the margin (content-matched)."""
        bar = 1 + self.cfg.margin
        return any(a.samples >= self.cfg.min_samples and self._ratio(b, k, b.cur) > bar
                   for k in b.ladder if k != b.cur and (a := b.arms.get(k)) is not None)

    def _rate(self, b: _Bucket, k: int, w: int) -> float:
        """Arm k's tokens/s on the content of the window w (steps run at caps >= w, w >= k): its tokens per
        sequence-step there times its own steps' sequences per second. Without window counts (steps observed
        without per-sequence counts, or fewer than min_samples of them): the arm's own tokens/seconds."""
        a = b.arms.get(k)
        if a is None or not a.seconds > 0:
            return 0.0
        if b.shadow is not None and k > 0 and (b.cur == 0 or w > b.cur):
            # off, or a window above the running cap: the content of the shadow proposals around now
            c = b.shadow[k]
            if c[2] >= self.cfg.min_samples and c[1] > 0 and a.nseq > 0:
                return c[0] / c[1] * a.nseq / a.seconds
        win = b.cf.get(w) if w > 0 else None
        if win is None or k >= len(win.need) or win.samples < self.cfg.min_samples or not win.need[k] > 0 \
                or not a.nseq > 0:
            return a.rate()
        return win.tokens / win.need[k] * a.nseq / a.seconds

    def _ratio(self, b: _Bucket, k: int, ref: int) -> float:
        """Arm k's rate over arm ref's, both on the content of the window max(k, ref) (0: ref not measured)."""
        w = max(k, ref)
        r = self._rate(b, ref, w)
        return self._rate(b, k, w) / r if r > 0 else 0.0

    def _content(self, b: _Bucket, cap: int, seqs) -> None:
        """A step under `cap` with per-sequence (drafted, accepted): for every window W <= cap and cap K' <= W,
        the tokens it emitted and the sequence-steps K' would have needed for them (module docstring)."""
        if cap <= 0:
            return
        d = self.cfg.content_decay
        tokens, need = _need([a for _k, a in seqs], cap)
        b.add_content(cap, d, tokens, need)

    def observe_shadow(self, n: int, seqs) -> None:
        """Shadow proposals scored on steps of n decoding sequences (the decoder's _shadow_step, n-gram): per
        proposal (drafted k_i <= k_max, kept a_i), what a verify would have kept, covering a_i + 1 tokens like a
        sequence-step under a cap >= k_i. They fill the bucket's shadow table (for every cap K' <= k_max: tokens,
        and the sequence-steps K' would have needed for them, EMAs as in _content), the content every comparison
        uses while the bucket is off and every comparison on a window above the running cap while on (_rate): a
        rung probed on a stretch of fresh code is judged on the content of the steps around it (its probe
        measures its seconds per step). While off, a measured cap whose rate on that content beats off by the
        margin is probed at once, not after the doubled interval (the content changed since the last comparison;
        at most once per max(base interval, amortised probe cost) steps)."""
        b = self.buckets.get(bucket(n))
        if b is None or not seqs:
            return
        k_max = self.cfg.k_max
        for k, a in seqs:
            if not 0 <= a <= k <= k_max:
                raise ValueError(f"guard observe_shadow: accepted {a} / drafted {k} outside 0 <= a <= k <= {k_max}")
        d = self.cfg.content_decay
        tokens, need = _need([a for _k, a in seqs], k_max)
        if b.shadow is None:
            b.shadow = {kk: [0.0, 0.0, 0] for kk in range(k_max + 1)}
        for kk, c in b.shadow.items():
            c[0] = d * c[0] + tokens
            c[1] = d * c[1] + need[kk]
            c[2] += 1
        self._probe_on_content(b)

    def content_check(self, n: int) -> None:
        """A step of n decoding sequences whose shadow proposals the decoder skipped (the bucket runs k_max: the
        verify's exact counts already price every cap at or below it, the only ones there are): the content
        trigger of observe_shadow still runs (a cap below that wins on the content around now is probed at once)."""
        b = self.buckets.get(bucket(n))
        if b is not None and b.shadow is not None:
            self._probe_on_content(b)

    def _probe_on_content(self, b: _Bucket) -> None:
        if b.cur != 0 and b.steps % 8:  # on, the trigger looks every 8 steps: the cheap test first (it runs on
            return  # every step of a bucket at k_max, ~12 us of the checks below at batch 1)
        if (b.probe_arm is None and b.pending is None and b.steps < b.next_probe
                and b.steps - b.last_probe >= max(b.base, self._amortised(b)) and self._next_rung(b) is None):
            if b.cur == 0:
                bar = 1 + self.cfg.margin
                if any(a.samples >= self.cfg.min_samples and self._ratio(b, k, 0) > bar
                       for k, a in b.arms.items() if k):
                    b.next_probe = b.steps  # the next cap() probes: _probe_target picks the best measured cap
            elif b.steps % 8 == 0 and self._content_winner(b) is not None:  # every 8 steps: it rates every arm
                b.next_probe = b.steps  # on: another cap wins on this content; _probe_target probes it

    def probe_cost(self, n: int) -> float | None:
        """The measured cost of a probe in this bucket, seconds (None: not measured)."""
        b = self.buckets.get(bucket(n))
        return b.probe_cost if b is not None else None

    def observe(self, n: int, cap: int, tokens: int, seconds: float, seqs=None) -> None:
        """A decode-only step with n decoding sequences ran under `cap`, emitted `tokens` in `seconds`. `seqs`:
        per decoding sequence (drafted k_i <= cap, accepted a_i <= k_i), for the content-matched comparison."""
        if n <= 0 or tokens <= 0 or not seconds > 0:
            return
        b = self._get(n)
        if seqs is not None:
            if len(seqs) != n:
                raise ValueError(f"guard observe: {len(seqs)} per-sequence counts for {n} decoding sequences")
            for k, a in seqs:
                if not 0 <= a <= k <= cap:
                    raise ValueError(f"guard observe: accepted {a} / drafted {k} outside 0 <= a <= k <= cap {cap}")
            self._content(b, cap, seqs)
        arm = b.arms.get(cap)
        if arm is None:
            arm = b.arms[cap] = _Arm()
        if cap != b.last_cap:
            b.last_cap, b.run = cap, 0
        b.run += 1
        settling = b.run <= self.cfg.settle
        if b.win is not None:
            self._window(b, cap, tokens, seconds, settling)
        if settling:  # the steps right after a change of k are not that k's steady rate
            return
        d = self.cfg.decay
        if arm.samples < FIRST_HELD:  # a stall of the shared machine (another process, a GC pause) must not decide
            arm.first.append((tokens, seconds, n))
            if len(arm.first) < FIRST_HELD:
                return
            med = sorted(sec for _t, sec, _n in arm.first)[FIRST_HELD // 2]
            for t, sec, m in arm.first:
                arm.add(t, min(sec, self.cfg.outlier * med), m, d)
            arm.first = []
            return
        arm.add(tokens, min(seconds, self.cfg.outlier * arm.mean_step(d)), n, d)

    def off_step_s(self, n: int) -> float | None:
        """Measured mean seconds of a step of n decoding sequences with speculation off (None: not measured)."""
        b = self.buckets.get(bucket(n))
        a = b.arms.get(0) if b is not None else None
        if a is None or a.samples < FIRST_HELD or a.tokens <= 0:
            return None
        return n * a.seconds / a.tokens  # off emits one token per sequence per step

    def current(self, n: int) -> int:
        b = self.buckets.get(bucket(n))
        return b.cur if b is not None else 0

    def rates(self, n: int) -> dict[int, float]:
        """Each arm's tokens/s on its own steps (not content-matched)."""
        b = self.buckets.get(bucket(n))
        return {k: a.rate() for k, a in sorted(b.arms.items())} if b is not None else {}

    def matched_rates(self, n: int) -> dict[int, float]:
        """Each arm's tokens/s on the content of the window max(arm, current arm): what the guard compares."""
        b = self.buckets.get(bucket(n))
        if b is None:
            return {}
        return {k: self._rate(b, k, max(k, b.cur)) for k in sorted(b.arms)}
