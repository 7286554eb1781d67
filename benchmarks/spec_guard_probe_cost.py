"""The goodput guard's exploration cost at a large batch, without a clock: the guard (engine/spec/guard.py)
driven with step times from a rate table (speculation `--on` of off's rate on its own steps, ±5% noise), a
probe from off paying T off-steps of draft catch-up (every sequence's draft catching up on what it skipped).
Prints tokens/s over always-off and the number of probes, per T. Run it on two commits to compare guards:

    python benchmarks/spec_guard_probe_cost.py --n 16 --steps 6000 --on 0.9 --catchup 0 5 20 50
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.engine.spec.guard import GoodputGuard, GuardConfig  # noqa: E402


def drive(n: int, steps: int, on: float, catchup: float, seed: int) -> tuple[float, int]:
    g = GoodputGuard(GuardConfig(k_max=6))
    rnd = random.Random(seed)
    off = 1000.0
    prev, t, tok = 0, 0.0, 0
    for _ in range(steps):
        c = g.cap(n)
        tokens = n * (1 + min(c, 3)) if c else n
        s = tokens / ((off if c == 0 else on * off) * (1 + rnd.uniform(-0.05, 0.05)))
        if c and not prev:
            s += catchup * n / off
        prev = c
        g.observe(n, c, tokens, s)
        t, tok = t + s, tok + tokens
    return tok / t / off, sum(b.num_probes for b in g.buckets.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--on", type=float, default=0.9)
    ap.add_argument("--catchup", type=float, nargs="+", default=[0, 5, 20, 50])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"| catch-up per probe (off-steps) | tokens/s vs always-off | probes |\n|---:|---:|---:|")
    for c in a.catchup:
        r, p = drive(a.n, a.steps, a.on, c, a.seed)
        print(f"| {c:g} | {r:.3f} | {p} |")


if __name__ == "__main__":
    main()
