"""Online estimates of a worker's speed, learned from what the router observes.

Prefill: a service-time model fitted over busy windows, not a latency regression. While the worker has
prefill pending (router-sent, first token not seen) its busy clock runs; each first token adds one request
and that request's uncached prompt tokens to the work done. A window (requests n, tokens N, busy seconds T)
closes after at least `window_s` busy seconds, at a first token that leaves nothing pending (the end of a
busy period), and

    T ≈ overhead_s · n + N / prefill_rate_tps

holds there exactly: every prompt the busy time worked on is counted. A window that closed at any
first token would count one prompt while, under continuous batching, others are half-prefilled: T then
includes work N does not (and N work T did not), the regressors are noisy, and least squares shrinks the
per-token slope toward zero (regression dilution: a worker of ~5000 tok/s learned 285,000). Under load a
busy period can last long, so a window also closes before the drain when the prefills pending at its two
ends are small against what it counts (exactness counted / (counted + pending at open + pending now), in
the current fit's seconds, ≥ `min_exact`; it then weighs `exactness` windows); one that reaches
`max_window_s` busy seconds without either is dropped, so under sustained overload (nothing drains) the fit
keeps what it learned rather than learn from windows it cannot measure (the TTFT calibration covers that).

The model is fitted by exponentially-forgetting least squares without intercept (decay per window, memory
~1/(1-decay) windows) plus a fixed prior, half of its weight on a pseudo-window of one request and no
tokens (T = overhead prior) and half on one of `token_scale` tokens and no request (T = token_scale /
rate prior). `overhead_s` is what every request costs whatever its length (scheduling, the engine step it
waits for, its first decode step, HTTP); `prefill_rate_tps` is the marginal cost of a prompt token. One
rate, tokens / busy seconds, mixes the two: a worker serving mostly prefix-cache hits does few tokens per
request, so its rate looks several times lower than a worker of the same speed serving misses, and a
policy that divides tokens by that rate moves hot prompts away from the worker that caches them. With
the two separated, workers of the same speed learn the same per-token rate whatever their hit mix (as
long as the mix varies a little: a worker that only ever sees one prompt length cannot tell the two apart
and keeps the prior's split of its per-request time). Under continuous batching, requests that share
steps share their overhead: the fit then learns the amortized overhead, which is what a queue of them
costs. Busy windows count what the engine really delivers (decode interference included) and do not care
in which order it serves prefills.

The decode rate is a plain service rate (`ServiceRate`): output tokens streamed per second while any
stream of the worker is decoding (reported, not used by a decision).

Decode: a linear model fitted by exponentially-forgetting least squares with a light prior,

    tpot_s ≈ tpot_base_s + tpot_per_stream_s * decode_streams

with samples clipped to [prediction / outlier_factor, prediction x outlier_factor] once it has 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RatePriors:
    ttft_base_s: float = 0.02  # prior of the per-request prefill overhead (network, scheduling, first step)
    prefill_rate_tps: float = 8192.0  # prior of the per-token prefill rate; slow start admission covers its error
    decode_rate_tps: float = 512.0  # output tokens per second while streams decode, until the first sample
    rate_window_s: float = 0.25  # busy seconds per rate sample
    rate_alpha: float = 0.3  # decode rate EWMA
    prefill_prior_weight: float = 0.5  # the prefill fit's prior, in busy windows
    prefill_decay: float = 0.95  # per busy window; memory ~20 windows (~5 busy seconds)
    prefill_token_scale: float = 1024.0  # tokens in the prior's pseudo-window
    tpot_base_s: float = 0.01
    tpot_per_stream_s: float = 0.0005
    prior_weight: float = 0.5
    decay: float = 0.9  # per TPOT sample; memory ~10 samples
    outlier_factor: float = 4.0

    def __post_init__(self):
        for name in ("ttft_base_s", "tpot_base_s", "tpot_per_stream_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"rate prior {name} must be finite and >= 0")
        if not self.prefill_rate_tps > 0 or not self.decode_rate_tps > 0 or not self.rate_window_s > 0 or not 0 < self.rate_alpha <= 1:
            raise ValueError("rate priors need prefill_rate_tps > 0, rate_window_s > 0, rate_alpha in (0, 1]")
        if self.prior_weight <= 0 or not 0 < self.decay < 1 or self.outlier_factor <= 1:
            raise ValueError("rate priors need prior_weight > 0, decay in (0, 1) and outlier_factor > 1")
        if self.prefill_prior_weight <= 0 or not 0 < self.prefill_decay < 1 or not self.prefill_token_scale > 0:
            raise ValueError("rate priors need prefill_prior_weight > 0, prefill_decay in (0, 1), "
                             "prefill_token_scale > 0")


class ServiceRate:
    """Units of work per busy second, an EWMA over windows of `window_s` busy seconds (the decode rate:
    output tokens per second while any stream decodes). All methods take `now`."""

    def __init__(self, prior_tps: float, window_s: float, alpha: float):
        self.tps = prior_tps
        self.window_s, self.alpha = window_s, alpha
        self.samples = 0
        self._busy_s = 0.0
        self._tokens = 0.0
        self._last: float | None = None  # last time the busy clock was advanced while busy

    def advance(self, now: float, busy: bool) -> None:
        """Call before the pending prefill changes; `busy`: was any prefill pending until now."""
        if busy and self._last is not None:
            self._busy_s += max(0.0, now - self._last)
        self._last = now

    def done(self, tokens: int, now: float, busy: bool) -> None:
        self.advance(now, busy)
        self._tokens += tokens
        if self._busy_s >= self.window_s and self._tokens > 0:
            sample = self._tokens / self._busy_s
            self.tps = sample if self.samples == 0 else self.tps + self.alpha * (sample - self.tps)
            self.samples += 1
            self._busy_s = self._tokens = 0.0


class PrefillFit:
    """Busy seconds ≈ overhead_s · requests + tokens / rate_tps over busy windows (module docstring).
    All methods take `now`."""

    def __init__(self, overhead_s: float, rate_tps: float, window_s: float, prior_weight: float = 0.5,
                 decay: float = 0.95, token_scale: float = 1024.0, outlier_factor: float = 4.0,
                 min_exact: float = 0.9, max_window_s: float = 4.0):
        self.overhead_s, self.rate_tps = overhead_s, rate_tps
        self._a0, self._b0 = overhead_s, 1.0 / rate_tps
        w = prior_weight / 2  # pseudo-windows (n=1, N=0, T=a0) and (n=0, N=token_scale, T=token_scale·b0)
        self._prior = (w, 0.0, w * token_scale**2, w * overhead_s, w * token_scale**2 / rate_tps)
        self._stats = [0.0] * 5  # sum n², n·N, N², n·T, N·T over decayed windows
        self.window_s, self.decay, self.outlier_factor = window_s, decay, outlier_factor
        self.min_exact, self.max_window_s = min_exact, max(window_s, max_window_s)
        self.samples = 0
        self._busy_s = self._tokens = 0.0
        self._requests = 0
        self._open = (0, 0.0)  # prefills pending when the window opened (requests, tokens)
        self._last: float | None = None  # last time the busy clock was advanced

    def advance(self, now: float, busy: bool) -> None:
        """Call before the pending prefill changes; `busy`: was any prefill pending until now."""
        if busy and self._last is not None:
            self._busy_s += max(0.0, now - self._last)
        self._last = now

    def done(self, tokens: int, now: float, busy: bool, requests: int = 1, pending_requests: int = 0,
             pending_tokens: float = 0) -> None:
        """`requests` prefills (`tokens` uncached prompt tokens in all) finished; requests=0, tokens=0: an
        attempt failed before its first token (its busy time still counts). `pending_requests` /
        `pending_tokens`: the prefills still pending after this one (their progress is unobserved).

        A window closes once it has `window_s` busy seconds and a request, and either nothing is pending
        (end of a busy period: everything the window's busy time worked on is counted, exactly), or the
        work pending at its two ends is small against the work it counts (exactness ≥ `min_exact`; the
        window then weighs `exactness` windows in the fit). Exactness = counted / (counted + pending at
        open + pending now), all in the current fit's seconds. A window with `max_window_s` busy seconds
        and neither is dropped (not learned from), and the next one opens."""
        self.advance(now, busy)
        self._tokens += tokens
        self._requests += requests
        if self._busy_s < self.window_s or self._requests <= 0:
            return
        counted = self.predict(self._requests, self._tokens)
        boundary = self.predict(self._open[0] + pending_requests, self._open[1] + pending_tokens)
        exact = counted / (counted + boundary) if counted > 0 else 0.0
        if pending_requests > 0 and exact < self.min_exact and self._busy_s < self.max_window_s:
            return
        if exact >= self.min_exact or (pending_requests == 0 and self._open[0] == 0):
            self.update(self._requests, self._tokens, self._busy_s, weight=1.0 if pending_requests == 0 and
                        self._open[0] == 0 else exact)
        self._busy_s = self._tokens = 0.0
        self._requests = 0
        self._open = (pending_requests, float(pending_tokens))

    def predict(self, requests: float, tokens: float) -> float:
        return self.overhead_s * requests + tokens / self.rate_tps

    def update(self, requests: float, tokens: float, busy_s: float, weight: float = 1.0) -> None:
        """One window: `requests` prefills of `tokens` tokens in all took `busy_s` busy seconds; it counts
        as `weight` windows (decay included)."""
        n, x, y = float(requests), float(tokens), float(busy_s)
        if not all(math.isfinite(v) and v >= 0 for v in (n, x, y, weight)) or n + x == 0 or weight == 0:
            return
        guess = self.predict(n, x)
        if guess > 0 and self.samples >= 3:  # until then the prior may be far off: learn from the raw sample
            y = min(max(y, guess / self.outlier_factor), guess * self.outlier_factor)
        s, keep = self._stats, self.decay ** weight
        for i, v in enumerate((n * n, n * x, x * x, n * y, x * y)):
            s[i] = s[i] * keep + weight * v
        self.samples += 1
        self._solve()

    def _solve(self) -> None:
        snn, snx, sxx, sny, sxy = (p + s for p, s in zip(self._prior, self._stats))
        det = snn * sxx - snx * snx
        if det <= 1e-12 * snn * sxx:
            return
        a = (sxx * sny - snx * sxy) / det
        b = (snn * sxy - snx * sny) / det
        if b <= 0:  # more tokens never take less time: the data cannot split the two, keep the prior's rate
            b = self._b0
            a = (sny - b * snx) / snn
        if a < 0:  # no negative overhead: all the time is per token
            a, b = 0.0, sxy / sxx
        self.overhead_s, self.rate_tps = max(0.0, a), 1.0 / b


class LinearFit:
    """y ≈ a + b·x by weighted least squares over decayed samples plus a fixed prior (a0, b0)."""

    def __init__(self, a0: float, b0: float, x_scale: float, prior_weight: float, decay: float,
                 outlier_factor: float = 4.0):
        # the prior: weight/2 at x=0 (y=a0) and weight/2 at x=x_scale (y=a0+b0*x_scale)
        w = prior_weight / 2
        self._prior = (prior_weight, w * x_scale, w * (2 * a0 + b0 * x_scale), w * x_scale**2,
                       w * x_scale * (a0 + b0 * x_scale))
        self._stats = [0.0, 0.0, 0.0, 0.0, 0.0]  # sum w, w·x, w·y, w·x², w·x·y over decayed samples
        self.decay = decay
        self.outlier_factor = outlier_factor
        self.samples = 0
        self.a, self.b = a0, b0

    def update(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return
        guess = self.predict(x)
        if guess > 0 and self.samples >= 3:  # until then the prior may be far off: learn from the raw sample
            y = min(max(y, guess / self.outlier_factor), guess * self.outlier_factor)
        s = self._stats
        for i in range(5):
            s[i] *= self.decay
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] += v
        self.samples += 1
        self._solve()

    def predict(self, x: float) -> float:
        return self.a + self.b * x

    def _solve(self) -> None:
        sw, sx, sy, sxx, sxy = (p + s for p, s in zip(self._prior, self._stats))
        det = sw * sxx - sx * sx
        if det <= 1e-12 * max(1.0, sw * sxx):
            return
        b = (sw * sxy - sx * sy) / det
        a = (sy - b * sx) / sw
        if b <= 0:  # more work never makes it faster: keep the mean, drop the slope to a tiny one
            b, a = 1e-9, sy / sw
        if a < 0:  # no negative overhead: refit the slope through the origin
            a, b = 0.0, max(1e-9, sxy / sxx if sxx > 0 else self.b)
        self.a, self.b = a, b


class WorkerRates:
    """A worker's prefill fit (per-request overhead, per-token rate), decode rate and TPOT model."""

    def __init__(self, priors: RatePriors):
        p = priors
        self.prefill = PrefillFit(p.ttft_base_s, p.prefill_rate_tps, p.rate_window_s, p.prefill_prior_weight,
                                  p.prefill_decay, p.prefill_token_scale, p.outlier_factor)
        self.decode = ServiceRate(p.decode_rate_tps, p.rate_window_s, p.rate_alpha)
        self.tpot = LinearFit(p.tpot_base_s, p.tpot_per_stream_s, 8.0, p.prior_weight, p.decay, p.outlier_factor)

    @property
    def ttft_base_s(self) -> float:
        """Learned per-request prefill overhead (prior: RatePriors.ttft_base_s)."""
        return self.prefill.overhead_s

    @property
    def prefill_rate_tps(self) -> float:
        return self.prefill.rate_tps

    @property
    def decode_rate_tps(self) -> float:
        return self.decode.tps

    @property
    def tpot_base_s(self) -> float:
        return self.tpot.a

    @property
    def tpot_per_stream_s(self) -> float:
        return self.tpot.b


class Ewma:
    """Exponentially weighted moving average; `value` is None until the first sample."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
