"""Verification: which drafted tokens the target keeps, losslessly.

Greedy (temperature 0): keep drafts while they equal the target's argmax; the first mismatch is replaced by
the target's argmax, and when all k are kept the target's argmax after the last one is a bonus token. The
output is the target's greedy output, token for token.

Sampled: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft token d
drawn from q is kept with probability min(1, p(d) / q(d)); the first rejected one is replaced by a sample of
norm(max(0, p - q)); when all are kept a bonus token is drawn from the target's next distribution. p and q
are the target's and draft's distributions after the request's temperature, top-k and top-p. A
deterministic proposer (n-gram) is a point mass q = 1 at d: keep with probability p(d), else sample p with
d removed. Every draw comes from the request's own generator (per-request seeds reproduce).
"""

from __future__ import annotations

import torch

from tokenmill.engine.sampler import _top_k_top_p
from tokenmill.engine.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] the distribution the request samples from."""
    x = logits.float() / params.temperature
    x = _top_k_top_p(x, [params.top_k] * x.shape[0], [params.top_p] * x.shape[0])
    return torch.softmax(x, dim=-1)


def verify_greedy(argmax_rows: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """argmax_rows: the target's argmax at the k+1 verified positions. Returns (tokens to emit, drafts kept)."""
    a = 0
    while a < len(drafts) and drafts[a] == argmax_rows[a]:
        a += 1
    return drafts[:a] + [argmax_rows[a]], a


def verify_sampled(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
                   gen: torch.Generator) -> tuple[list[int], int]:
    """logits [k+1, V] (the target's, at the k+1 verified positions); q [k, V] or None (point masses)."""
    p = target_probs(logits, params)
    k = len(drafts)
    u = torch.rand(k, generator=gen).tolist() if k else []
    for j, d in enumerate(drafts):
        pd = float(p[j, d])
        qd = float(q[j, d]) if q is not None else 1.0
        if u[j] * qd < pd:  # u < p/q
            continue
        if q is not None:
            residual = (p[j] - q[j]).clamp_(min=0)
        else:
            residual = p[j].clone()
            residual[d] = 0
        if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is empty, p itself is exact
            residual = p[j]
        tok = int(torch.multinomial(residual, 1, generator=gen))
        return drafts[:j] + [tok], j
    return drafts + [int(torch.multinomial(p[k], 1, generator=gen))], k
