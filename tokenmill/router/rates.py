"""Online estimates of a worker's speed, learned from the latencies the router observes.

Two linear models per worker, each fitted by exponentially-forgetting least squares with a prior:

    ttft_s ≈ ttft_base_s + work_tokens / prefill_rate_tps      (work = uncached prefill tokens ahead + own)
    tpot_s ≈ tpot_base_s + tpot_per_stream_s * decode_streams

The prior acts as `prior_weight` pseudo-observations that never decay, so the fit is defined from the
first request on and stays sane when every sample has nearly the same x. `decay` per sample gives an
effective memory of ~1 / (1 - decay) samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RatePriors:
    ttft_base_s: float = 0.02
    prefill_rate_tps: float = 8192.0  # optimistic on purpose: early traffic is admitted, then learned
    tpot_base_s: float = 0.01
    tpot_per_stream_s: float = 0.0005
    prior_weight: float = 2.0
    decay: float = 0.9  # per sample; memory ~10 samples

    def __post_init__(self):
        for name in ("ttft_base_s", "tpot_base_s", "tpot_per_stream_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"rate prior {name} must be finite and >= 0")
        if not self.prefill_rate_tps > 0:
            raise ValueError(f"rate prior prefill_rate_tps must be > 0, got {self.prefill_rate_tps}")
        if self.prior_weight <= 0 or not 0 < self.decay < 1:
            raise ValueError("rate priors need prior_weight > 0 and decay in (0, 1)")


class LinearFit:
    """y ≈ a + b·x by weighted least squares over decayed samples plus a fixed prior (a0, b0)."""

    def __init__(self, a0: float, b0: float, x_scale: float, prior_weight: float, decay: float):
        # the prior: weight/2 at x=0 (y=a0) and weight/2 at x=x_scale (y=a0+b0*x_scale)
        w = prior_weight / 2
        self._prior = (prior_weight, w * x_scale, w * (2 * a0 + b0 * x_scale), w * x_scale**2,
                       w * x_scale * (a0 + b0 * x_scale))
        self._stats = [0.0, 0.0, 0.0, 0.0, 0.0]  # sum w, w·x, w·y, w·x², w·x·y over decayed samples
        self.decay = decay
        self.samples = 0
        self.a, self.b = a0, b0

    def update(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return
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
    """The two fits of one worker, named in the units the router uses."""

    def __init__(self, priors: RatePriors):
        self.ttft = LinearFit(priors.ttft_base_s, 1.0 / priors.prefill_rate_tps, 1024.0,
                              priors.prior_weight, priors.decay)
        self.tpot = LinearFit(priors.tpot_base_s, priors.tpot_per_stream_s, 8.0, priors.prior_weight, priors.decay)

    @property
    def ttft_base_s(self) -> float:
        return self.ttft.a

    @property
    def prefill_rate_tps(self) -> float:
        return 1.0 / self.ttft.b

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
