"""GreedyDraftLoop: a draft model's k greedy proposal steps without the runner's per-step rebuild.

DraftModelProposer's general path runs each of its k steps as a full `ModelRunner.execute` (a SchedulerOutput
per step, the runner's Python loops over sequences and positions, an AttentionMetadata, a logits gather): at
batch 1 on the demo draft that is ~0.25 ms per draft token, most of it bookkeeping around ~0.1 ms of model
work (measured, docs/benchmarks/spec_decode.md). When every speculating sequence is greedy and the draft model
has the fused decoder stack (model/fused_decode.py), this loop runs the same computation directly:

    step 0   the catch-up: each sequence's not-yet-drafted tokens (1-2 after a verification) as decode-style
             rows (each attends its own context, like the runner's verification rows), logits of the last row
    step j   one row per sequence still drafting: the previous step's argmax, its embedding, position+1

each step one `FusedDecodeStack` call (embedding rows in, final hidden out) and the head's argmax (the packed
head fused with the argmax where it applies: no logits written). The block tables are built once per proposal (wide enough for the last draft position: padded columns
are never read, the context length bounds the kernel), slots and positions from the request's block ids. The
kernels, their inputs and their order are the ones `runner.execute` -> `LlamaModel.forward` picks for these
rows, so the draft tokens and the draft KV are the same bits as the general path's
(tests/engine/test_spec_draft_loop.py compares both, token for token and KV slot for slot).

Not covered (the caller falls back to the general path): sampled requests (rejection sampling needs q), more
rows than the fused stack takes (fused_decode.MAX_TOKENS), a long catch-up (a prefill), a draft model without
the fused stack (fp16, int8 KV, no compiler, TOKENMILL_FUSED_DECODE=0).
"""

from __future__ import annotations

import torch

from tokenmill.engine.request import Request
from tokenmill.engine.sampler import greedy_token_tensor
from tokenmill.engine.scheduler import ScheduledSeq
from tokenmill.model.attention import AttentionMetadata, Int8KVCache
from tokenmill.model.fused_decode import MAX_TOKENS


class GreedyDraftLoop:
    def __init__(self, runner):
        self.runner = runner
        self.model = runner.model
        self.bs = runner.block_size
        self.window = runner.sliding_window
        self._aranges: dict[int, torch.Tensor] = {}  # decode_token_idx per row count (never written)

    def _arange(self, n: int) -> torch.Tensor:
        t = self._aranges.get(n)
        if t is None:
            t = self._aranges[n] = torch.arange(n)
        return t

    @classmethod
    def build(cls, runner) -> "GreedyDraftLoop | None":
        """None when the draft model's steps do not run through the fused stack (then the general path runs)."""
        m = runner.model
        if getattr(m, "fused", None) is None or runner.device.type != "cpu":
            return None
        if any(isinstance(c, Int8KVCache) for c in runner.kv_caches):
            return None
        return cls(runner)

    def covers(self, reqs: list[Request], catchups: list[int]) -> bool:
        """This proposal can run here: all greedy, and every step's rows fit the fused stack."""
        return (all(r.params.greedy for r in reqs) and len(reqs) <= MAX_TOKENS
                and sum(catchups) <= MAX_TOKENS and min(catchups) >= 1)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int], seqs: list[ScheduledSeq], starts: list[int]) -> list[list[int]]:
        """Draft KV of request i is valid for positions [0, starts[i]); returns the k_i greedy draft tokens of
        each request. Writes draft KV for the known tokens from starts[i] on and the first k_i - 1 drafts."""
        bs = self.bs
        n = len(reqs)
        # block tables wide enough for each sequence's last draft position (written at num_tokens + k - 2)
        width = max(-(-(r.num_tokens + k - 1) // bs) for r, k in zip(reqs, ks))
        tables = [list(s.block_ids[:width]) + [0] * (width - min(width, len(s.block_ids))) for s in seqs]
        bt_all = torch.tensor(tables, dtype=torch.long)  # [n, width]
        # step 0: the catch-up rows, decode-style; the logits of each sequence's last row
        tok0: list[int] = []
        pos0: list[int] = []
        rows_of: list[int] = []  # table row of each query row
        last_row: list[int] = []
        for i, (r, st) in enumerate(zip(reqs, starts)):
            ids = r.all_token_ids
            for p in range(st, r.num_tokens):
                tok0.append(ids[p])
                pos0.append(p)
                rows_of.append(i)
            last_row.append(len(tok0) - 1)
        same = len(tok0) == n
        bt = bt_all if same else bt_all.index_select(0, torch.tensor(rows_of, dtype=torch.long))
        first = self._step(tok0, pos0, [tables[i] for i in rows_of], bt, None if same else last_row)  # [n]
        k_max = max(ks)
        if k_max == 1:
            return [[t] for t in first.tolist()]
        if all(k == k_max for k in ks):
            return self._uniform(reqs, k_max, tables, bt_all, first)
        out = [[t] for t in first.tolist()]
        active = [i for i in range(n) if ks[i] > 1]
        if len(active) != n:
            bt_all = bt_all.index_select(0, torch.tensor(active, dtype=torch.long))
        step = 1
        while active:
            toks = self._step([out[i][-1] for i in active], [reqs[i].num_tokens + step - 1 for i in active],
                              [tables[i] for i in active], bt_all, None).tolist()
            for i, t in zip(active, toks):
                out[i].append(t)
            step += 1
            keep = [j for j, i in enumerate(active) if ks[i] > step]
            if len(keep) != len(active):
                active = [active[j] for j in keep]
                if keep:
                    bt_all = bt_all.index_select(0, torch.tensor(keep, dtype=torch.long))
        return out

    def _uniform(self, reqs: list[Request], k: int, tables: list[list[int]], bt: torch.Tensor,
                 first: torch.Tensor) -> list[list[int]]:
        """Steps 1..k-1 when every sequence drafts k tokens (fixed k; `auto` at batch 1): positions, slots and
        context lengths of all steps built at once, the tokens stay tensors between steps (argmax -> embedding
        rows), one list conversion at the end."""
        bs, model = self.bs, self.model
        fused, rope, caches, emb = model.fused, model.rope, self.runner.kv_caches, model.embed_tokens.weight
        pos = [[r.num_tokens + j - 1 for r in reqs] for j in range(1, k)]  # [k-1, n]
        slots = [[tb[p // bs] * bs + p % bs for tb, p in zip(tables, row)] for row in pos]
        pos_t = torch.tensor(pos, dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long)
        ctx_t = pos_t + 1
        idx = self._arange(len(reqs))
        toks = [first]
        for j in range(k - 1):
            meta = AttentionMetadata(slot_mapping=slot_t[j], spans=[], decode_token_idx=idx, decode_block_tables=bt,
                                     decode_ctx_lens=ctx_t[j], decode_mask=None, sliding_window=self.window)
            hidden = fused(emb.index_select(0, toks[-1]), pos_t[j], rope, caches, meta)
            toks.append(self._argmax(hidden))
        return torch.stack(toks, dim=1).tolist()

    def _step(self, tokens: list[int], positions: list[int], tables: list[list[int]], bt: torch.Tensor,
              logit_rows: list[int] | None) -> torch.Tensor:
        """One fused forward of decode-style rows (row j: tokens[j] at positions[j], attending through tables[j]
        = bt[j]); the argmax of the rows in logit_rows (None: every row). Logits are computed for every row and
        then selected, as the runner does for the rows of one sequence."""
        bs = self.bs
        slots = [tb[p // bs] * bs + p % bs for tb, p in zip(tables, positions)]
        # one tensor for the three per-row lists (rows are contiguous views), as the runner's decode fast path
        rows = torch.tensor([tokens, positions, slots], dtype=torch.long)  # [3, T]
        pos_t = rows[1]
        meta = AttentionMetadata(slot_mapping=rows[2], spans=[], decode_token_idx=self._arange(len(tokens)),
                                 decode_block_tables=bt, decode_ctx_lens=pos_t + 1, decode_mask=None,
                                 sliding_window=self.window)
        # the embedding rows (what embed_tokens returns, as _uniform takes them: the same values)
        x = self.model.embed_tokens.weight.index_select(0, rows[0])
        hidden = self.model.fused(x, pos_t, self.model.rope, self.runner.kv_caches, meta)
        if logit_rows is not None:
            hidden = hidden.index_select(0, torch.tensor(logit_rows, dtype=torch.long))
        return self._argmax(hidden)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of the draft's logits: the packed head fused with the argmax where it applies (the
        same tokens, exactly, without writing [rows, vocab] logits; its rows are batch-invariant), else the
        logits then argmax."""
        toks = self.model.greedy_tokens_plain(hidden)  # propose() runs in inference mode: no per-call re-entry
        return toks if toks is not None else greedy_token_tensor(self.model.compute_logits_plain(hidden))
