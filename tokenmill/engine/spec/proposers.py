"""Proposers: where draft tokens come from. A small registry: `ngram` (prompt lookup over the request's own
tokens) and a draft model (`demo-draft` or an HF directory) whose KV lives in the target's blocks.

A proposer gets, after the scheduler reserved KV slots for k drafts of each speculating sequence, the
requests, their k and their block tables, and returns one `Draft` per request: the tokens (possibly fewer
than k: none when the lookup finds no match) and, for a sampled proposal, the distribution q each token was
drawn from (rejection sampling needs it; None means the proposal was deterministic: a point mass).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from tokenmill.engine.request import Request
from tokenmill.engine.sampler import _top_k_top_p
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.errors import ModelLoadError, TokenmillError


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] q for sampled proposals; None: point masses


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from max_n down
    to min_n) and propose the k tokens that followed it; when fewer than k follow it (the match is within
    the last k tokens: a short cycle), the copy continues over its own output, predicting that the cycle
    repeats. No model, no KV; per request only a byte image of its tokens (for the search)."""

    name = "ngram"
    has_kv = False
    last_catchup = 0
    shadow = True  # a lookup is free enough to run on k = 0 steps (auto's counterfactual acceptance)

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise TokenmillError(f"ngram proposer needs 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._bufs: dict[str, list] = {}  # request id -> [the tokens' bytes, how many tokens, the last one]

    def lookup(self, tokens: list[int], k: int, end: int | None = None, key: str | None = None) -> list[int]:
        """The proposal for tokens[:end] (default: all). `key` (a request id): the tokens' byte image is kept
        and extended by the new tokens only (a request's tokens only grow), not rebuilt per call: a sequence's
        lookups each step (its proposal, auto's shadow proposals) were ~7-25 us, mostly that copy."""
        n_tok = len(tokens) if end is None else end
        if n_tok < self.min_n + 1 or k <= 0:
            return []
        if key is None:
            buf = array("i", tokens[:n_tok]).tobytes()
        else:
            buf = self._buf(key, tokens)
        hay_end = (n_tok - 1) * 4  # an occurrence must be followed by at least one known token
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            needle = buf[(n_tok - n) * 4:n_tok * 4]
            end_b = hay_end
            while True:
                i = buf.rfind(needle, 0, end_b)
                if i < 0:
                    break
                if i % 4 == 0:
                    start = i // 4 + n
                    out = list(tokens[start:min(start + k, n_tok)])
                    # a match close to the end (a short cycle) runs out of known tokens: continue the copy
                    # over its own output (LZ77-style overlap), i.e. predict the cycle repeats
                    period = n_tok - start
                    while len(out) < k:
                        out.append(out[len(out) - period])
                    return out
                end_b = i + len(needle) - 1
        return []

    def _buf(self, key: str, tokens: list[int]) -> bytearray:
        c = self._bufs.get(key)
        if c is None or c[1] > len(tokens) or (c[1] and tokens[c[1] - 1] != c[2]):  # new, or not a prefix
            c = [bytearray(), 0, None]
            self._bufs[key] = c
        if c[1] < len(tokens):
            c[0] += array("i", tokens[c[1]:]).tobytes()
            c[1] = len(tokens)
            c[2] = tokens[-1]
        return c[0]

    def propose(self, reqs: list[Request], ks: list[int], seqs: list[ScheduledSeq], gens) -> list[Draft]:
        return [Draft(self.lookup(r.all_token_ids, k, key=r.request_id)) for r, k in zip(reqs, ks)]

    def rollback(self, req: Request, num_computed: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self._bufs.pop(request_id, None)


class DraftModelProposer:
    """A small model of the same vocabulary proposes k tokens autoregressively. Its KV cache has the same
    block ids as the target's (one tensor set per model, indexed by the target's block tables), so the
    target's block manager owns both: a block freed, preempted or rolled back is gone for both.

    Draft KV validity is tracked per request (`computed[rid]`: positions [0, n) hold draft KV for the
    request's tokens). A proposal first catches the draft up from there to the sequence's last token (its
    whole context the first time: a prefix-cache hit or a KV-tier load gave the target's KV only; after a
    preemption the count restarts at 0), then runs k-1 more single-token steps. After verification the
    count is cut to the target's (rejected positions are invalid for both)."""

    name = "draft"
    has_kv = True
    shadow = False  # a proposal is k draft forwards: not run when it is not verified
    last_catchup = 0  # the last proposal's longest catch-up (tokens the draft had not seen)

    def __init__(self, runner, vocab_size: int, fast_loop: bool = True):
        from tokenmill.engine.spec.draft_loop import GreedyDraftLoop

        self.runner = runner
        self.vocab_size = vocab_size
        self.computed: dict[str, tuple[int, int]] = {}  # rid -> (num_preemptions when computed, draft KV tokens)
        self.default_gen = torch.Generator().manual_seed(0)
        # greedy proposals of few rows: the k steps without the runner's per-step rebuild (spec/draft_loop.py)
        self.loop = GreedyDraftLoop.build(runner) if fast_loop else None
        self.num_fast = 0  # proposals (batches) the loop ran

    def _sample(self, logits: torch.Tensor, reqs: list[Request], gens) -> tuple[list[int], list[torch.Tensor | None]]:
        toks, probs = logits.argmax(dim=-1).tolist(), [None] * len(reqs)
        for i, r in enumerate(reqs):
            p = r.params
            if p.greedy:
                continue
            x = _top_k_top_p(logits[i:i + 1].float() / p.temperature, [p.top_k], [p.top_p])
            q = torch.softmax(x, dim=-1)[0]
            toks[i] = int(torch.multinomial(q, 1, generator=gens[i] or self.default_gen))
            probs[i] = q
        return toks, probs

    def _starts(self, reqs: list[Request]) -> list[int]:
        """Per request: draft KV is valid for positions [0, start) (at most up to the newest token)."""
        out = []
        for r in reqs:
            pre, n = self.computed.get(r.request_id, (r.num_preemptions, 0))
            if pre != r.num_preemptions:
                n = 0
            out.append(min(n, r.num_tokens - 1))
        return out

    def propose(self, reqs: list[Request], ks: list[int], seqs: list[ScheduledSeq], gens) -> list[Draft]:
        starts = self._starts(reqs)
        self.last_catchup = max(r.num_tokens - n for r, n in zip(reqs, starts))
        loop = self.loop
        if loop is not None and loop.covers(reqs, [r.num_tokens - n for r, n in zip(reqs, starts)]):
            tokens = loop.propose(reqs, ks, seqs, starts)
            self.num_fast += 1
            for r, k in zip(reqs, ks):
                self.computed[r.request_id] = (r.num_preemptions, r.num_tokens + k - 1)
            return [Draft(t) for t in tokens]
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        first = []
        for r, s, n in zip(reqs, seqs, starts):
            toks = r.all_token_ids[n:]
            # a short catch-up (1-2 tokens after a verification) takes the runner's decode-kernel path: logits
            # for each of its tokens (the last one is used); a long one (the first proposal) is a prefill
            short = len(toks) <= 16
            first.append(ScheduledSeq(r.request_id, toks, n, s.block_ids, len(toks) if short else 1,
                                      num_spec_slots=len(toks) - 1 if short else 0))
        active = list(range(len(reqs)))
        batch = first
        step = 0
        while active:
            out = self.runner.execute(SchedulerOutput(batch, sum(len(b.token_ids) for b in batch)))
            logits = out.logits
            if any(b.num_logits > 1 for b in batch):
                rows = [off + b.num_logits - 1 for off, b in zip(out.logit_offsets, batch)]
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            toks, qs = self._sample(logits, [reqs[i] for i in active], [gens[i] for i in active])
            for j, i in enumerate(active):
                tokens[i].append(toks[j])
                if qs[j] is not None:
                    probs[i].append(qs[j])
            step += 1
            active = [i for i in active if ks[i] > step]
            batch = [ScheduledSeq(reqs[i].request_id, [tokens[i][-1]], reqs[i].num_tokens + step - 1,
                                  seqs[i].block_ids, 1) for i in active]
        for r, k in zip(reqs, ks):  # draft KV now covers the known tokens and the first k-1 drafts
            self.computed[r.request_id] = (r.num_preemptions, r.num_tokens + k - 1)
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def rollback(self, req: Request, num_computed: int) -> None:
        """The target kept KV for num_computed tokens: draft KV past it is for rejected tokens."""
        pre, n = self.computed.get(req.request_id, (req.num_preemptions, 0))
        self.computed[req.request_id] = (pre, min(n, num_computed))

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)


PROPOSERS = ("ngram", "demo-draft", "<model directory>")


def make_proposer(config, target_model_config, device, dtype, num_blocks: int, block_size: int, max_model_len: int,
                  kv_dtype=None):
    """The proposer config.speculative_model names: 'ngram', or a draft model (shipped name or directory)."""
    if config.speculative_model == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    runner = load_draft_runner(config.speculative_model, target_model_config, device, dtype, num_blocks,
                               block_size, max_model_len, kv_dtype)
    return DraftModelProposer(runner, target_model_config.vocab_size)


def draft_model_config(name: str, target_model_config):
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.loader import resolve_model_path

    try:
        path = resolve_model_path(name)
        cfg = ModelConfig.from_dir(path)
    except TokenmillError as e:
        raise ModelLoadError(f"speculative_model={name!r}: not ngram, a shipped draft model or a model "
                             f"directory ({e})") from None
    if cfg.vocab_size != target_model_config.vocab_size:
        raise ModelLoadError(f"speculative_model={name!r}: vocabulary of {cfg.vocab_size} tokens, the target has "
                             f"{target_model_config.vocab_size} (a draft must share the target's tokenizer)")
    return path, cfg


def load_draft_runner(name, target_model_config, device, dtype, num_blocks, block_size, max_model_len, kv_dtype=None):
    from tokenmill.engine.runner import ModelRunner
    from tokenmill.model.loader import load_model

    path, cfg = draft_model_config(name, target_model_config)
    if cfg.max_position_embeddings < max_model_len:
        raise ModelLoadError(f"speculative_model={name!r}: max_position_embeddings {cfg.max_position_embeddings} "
                             f"< max_model_len {max_model_len}; lower --max-model-len")
    model = load_model(path, cfg, device, dtype, max_positions=max_model_len)
    window = cfg.sliding_window if cfg.sliding_window and cfg.sliding_window < max_model_len else None
    return ModelRunner(model, cfg, device, dtype, num_blocks, block_size, window, kv_dtype=kv_dtype)
