"""Online estimates of a worker's speed, learned from what the router observes.

Prefill: a service rate, not a latency regression. While the worker has prefill pending (router-sent,
first token not seen) its busy time accumulates; each first token adds that request's uncached prompt
tokens to the work done. Every `window_s` of busy time gives a sample

    prefill_rate_tps = tokens done / busy seconds          (EWMA, alpha `rate_alpha`; the first sample
                                                            replaces the prior outright)

This counts what continuous batching really delivers (decode interference and per-step overhead
included) and does not care in which order the engine serves prefills. It underestimates a lightly
loaded worker (latency overhead counts as busy time), which only makes admission conservative there.
The decode rate is the same kind of estimate: output tokens streamed per second while any stream of the
worker is decoding.

Decode: a linear model fitted by exponentially-forgetting least squares with a light prior,

    tpot_s ≈ tpot_base_s + tpot_per_stream_s * decode_streams

with samples clipped to [prediction / outlier_factor, prediction x outlier_factor] once it has 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RatePriors:
    ttft_base_s: float = 0.02  # fixed overhead added to every TTFT prediction (network, scheduling)
    prefill_rate_tps: float = 8192.0  # until the first sample; slow start admission covers its error
    decode_rate_tps: float = 512.0  # output tokens per second while streams decode, until the first sample
    rate_window_s: float = 0.25  # busy seconds per rate sample
    rate_alpha: float = 0.3
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


class ServiceRate:
    """Prefill tokens per busy second (see the module docstring). All methods take `now`."""

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
    """A worker's prefill service rate and TPOT model, named in the units the router uses."""

    def __init__(self, priors: RatePriors):
        p = priors
        self.ttft_base_s = p.ttft_base_s
        self.prefill = ServiceRate(p.prefill_rate_tps, p.rate_window_s, p.rate_alpha)
        self.decode = ServiceRate(p.decode_rate_tps, p.rate_window_s, p.rate_alpha)
        self.tpot = LinearFit(p.tpot_base_s, p.tpot_per_stream_s, 8.0, p.prior_weight, p.decay, p.outlier_factor)

    @property
    def prefill_rate_tps(self) -> float:
        return self.prefill.tps

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
