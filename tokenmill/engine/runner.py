"""ModelRunner: owns the model and the KV cache tensors; runs one SchedulerOutput through the model.

One code path for every kind of step: each scheduled sequence brings any number of new tokens (a prefill
chunk, one decode token, or k speculative tokens to verify) and asks for the logits of its last
`num_logits` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.model.attention import SCALED_KV_CACHES, AttentionMetadata, KVBlockGroups, ScaledKVCache, SeqSpan
from tokenmill.model.config import ModelConfig
from tokenmill.model.invariant import fixed_tiles
from tokenmill.model.linear import small_row_bits, small_row_limit
from tokenmill.model.llama import LlamaModel


def _keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS and page-faults them back on the next step; keep them.
    (Each decode step allocates the same activation sizes again: this removes a page-fault storm.)"""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 4 << 30)
        libc.mallopt(m_arena_max, 1)  # the settings hold for the main arena only: keep every thread on it
    except (OSError, AttributeError):
        pass


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU backed by transparent huge pages where the kernel offers them on request
    (`madvise` mode): decode attention reads a sequence's blocks scattered over the whole cache, one TLB miss
    per block with 4 KiB pages (measured: decode attention ~1.1x faster on the 40M model with huge pages)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu":
        _advise_huge_pages(t)
    return t.zero_()  # touched after the advice, so the pages come in huge


def _index_copy(t: torch.Tensor, dim: int, idx: torch.Tensor, src: torch.Tensor) -> None:
    """t.index_copy_(dim, idx, src), also for fp8 tensors (no index_copy kernel on the CPU: their bytes are copied)."""
    if t.dtype == torch.float8_e4m3fn:
        t, src = t.view(torch.uint8), src.view(torch.uint8)
    t.index_copy_(dim, idx, src)


def _advise_huge_pages(t: torch.Tensor) -> None:
    huge = 2 << 20
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = (start + huge - 1) & ~(huge - 1), (start + nbytes) & ~(huge - 1)
    if hi <= lo:
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE; a kernel without THP refuses it: nothing changes
    except (OSError, AttributeError):
        pass


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [sum(num_logits), vocab] fp32 (the model's dtype with execute(float_logits=False))
    logit_offsets: list[int]  # seq i's logits are rows logit_offsets[i] : logit_offsets[i] + seqs[i].num_logits
    # execute(greedy=True) where the model's packed head applies: each logit row's argmax (int64, same row order),
    # and `logits` is empty (never written)
    tokens: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: LlamaModel, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, sliding_window: int | None = None,
                 kv_dtype: torch.dtype | None = None, scratch_block: bool = False):
        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.kv_dtype = kv_dtype or dtype  # the KV cache's storage type (--kv-cache-dtype; default: the model's)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        # steps with prefill chunks: the last layer computes only the sampled rows past its attention
        # (AttentionMetadata.logits_rows); False: every row (the tests compare the two)
        self.prune_rows = True
        # steps of at most this many rows compute every linear with the small-row kernel (8; AMX bf16: 256), so a
        # verify step whose rows without drafts are that few takes those bits for all its rows (small_row_bits)
        self.small_rows = small_row_limit(model)
        # every step under small_row_bits (EngineConfig.batch_invariant): a row's bits do not depend on its step's
        # row count at all, so greedy output does not depend on batching (set by the engine)
        self.batch_invariant = False
        # and under it, how rows attend: "on": a prompt's rows with the prefill kernel (its bits do not depend on the
        # chunking), the generated tokens' rows as decode rows (also when recomputed after a preemption); "strict":
        # every row as a decode row (also a prompt that holds an earlier answer whose KV was evicted: prefill ~0.7x)
        self.invariant_attention = "on"
        self.tiles = False  # batch-invariant on CUDA: every step by fixed tiles (model/invariant.py), rows as decode rows
        # decode-only steps (one token per sequence, no drafts): inputs built in one pass, one tensor for the four
        # per-token rows (see _execute_decode); False (or TOKENMILL_DECODE_FAST_PATH=0): the general path below
        from tokenmill.model.fused_decode import fast_path_by_env

        self.decode_fast_path = fast_path_by_env()
        self._aranges: dict[int, torch.Tensor] = {}
        # captured decode graphs (--cuda-graphs: engine/graphs.py) pad their batches with rows that write into one
        # block the KV manager never hands out: allocated past the last block it manages
        self.scratch_block = num_blocks if scratch_block else None
        self.graphs = None
        num_blocks += 1 if scratch_block else 0
        shape = (2, num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim)
        scaled = SCALED_KV_CACHES.get(self.kv_dtype)
        if scaled is not None:  # int8 / fp8 data + one fp32 scale per (block, kv head) for K and V
            self.kv_caches = [scaled.empty(num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim, device,
                                           zeros=_zeros) for _ in range(cfg.num_hidden_layers)]
            if self.kv_dtype != torch.int8:  # the fused C++ stacks read fp32 / bf16 / int8 caches: the modules run
                model.fused = model.fused_mixed = None
        else:
            self.kv_caches = [_zeros(shape, self.kv_dtype, device) for _ in range(cfg.num_hidden_layers)]
        # a 1-byte cache off the CPU is written by attention.write_kv_scaled: its blocks grouped here, on the host
        self._host_kv_groups = scaled is not None and device.type != "cpu"
        if device.type == "cpu":
            _keep_freed_memory()
            from tokenmill.model.cpu_kernels import get_kernels

            get_kernels()  # compile (once per machine) before serving, not in the first request

    def enable_graphs(self, max_batch: int, max_model_len: int, capture: str = "cuda") -> None:
        """Decode steps of up to `max_batch` sequences through captured graphs (engine/graphs.py)."""
        from tokenmill.engine.graphs import DecodeGraphs

        if self.scratch_block is None:
            raise ValueError("enable_graphs needs a runner built with scratch_block=True")
        if self.kv_dtype in SCALED_KV_CACHES:
            raise ValueError("CUDA graphs cannot capture the int8 / fp8 KV write (its blocks are grouped on the host)")
        self.graphs = DecodeGraphs(self, max_batch, max_model_len, capture)
        self.graphs.capture_all()

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """All layers, K and V; int8 and fp8 add their fp32 scales (one per (block, kv head), K and V)."""
        per_block = cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size
        if dtype in SCALED_KV_CACHES:
            per_block += 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 4
        return per_block

    @staticmethod
    def num_blocks_for_bytes(cfg: ModelConfig, kv_cache_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        return kv_cache_bytes // ModelRunner.kv_bytes_per_block(cfg, block_size, dtype)

    # -- KV blocks by id (for moving blocks between tiers / processes) ----------------------------
    def kv_block_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds KV state, each indexed by block id in dim 1: block b's full contents are
        `[t[:, b] for t in kv_block_tensors()]`. Per layer: the cache [2, NB, kvh, bs, hd] (K, V), and with an
        int8 or fp8 cache also its scales [2, NB, kvh] fp32."""
        out = []
        for c in self.kv_caches:
            out.extend((c.data, c.scales) if isinstance(c, ScaledKVCache) else (c,))
        return out

    def read_kv_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of the blocks' contents, one tensor per `kv_block_tensors()` entry ([2, len(block_ids), ...])."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return [t.index_select(1, idx) for t in self.kv_block_tensors()]

    def write_kv_blocks(self, block_ids: list[int], contents: list[torch.Tensor]) -> None:
        """The inverse of `read_kv_blocks`: put saved contents into (possibly other) block ids."""
        tensors = self.kv_block_tensors()
        if len(contents) != len(tensors):
            raise ValueError(f"expected {len(tensors)} tensors (kv_block_tensors()), got {len(contents)}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for t, c in zip(tensors, contents):
            _index_copy(t, 1, idx, c.to(device=t.device, dtype=t.dtype))

    # -- moving whole blocks (KV tiers, transfer) -------------------------------------------------
    def _block_dims(self) -> list[tuple[torch.Tensor, int]]:
        """kv_block_tensors() with their block dimension (1 for all of them today). A block's bytes are the
        concatenation of its slices of these tensors in this order: an int8 cache's scales come with it."""
        return [(t, 1) for t in self.kv_block_tensors()]

    def kv_block_layout(self) -> list:
        """What decides how a block's bytes are read back (part of the tier fingerprint)."""
        return [[str(t.dtype).replace("torch.", ""), d, list(t.shape[:d]) + list(t.shape[d + 1:])]
                for t, d in self._block_dims()]

    @property
    def block_nbytes(self) -> int:
        return sum(t.element_size() * t.numel() // t.shape[d] for t, d in self._block_dims())

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[len(block_ids), block_nbytes] uint8 on the CPU: each row one block's bytes (all KV tensors)."""
        idx = self._tensor(block_ids)
        parts = []
        for t, d in self._block_dims():
            g = t.index_select(d, idx).movedim(d, 0).contiguous()
            parts.append(g.reshape(len(block_ids), -1).view(torch.uint8))
        return torch.cat(parts, dim=1).cpu() if len(parts) > 1 else parts[0].cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: data [len(block_ids), block_nbytes] uint8 into those blocks."""
        n = len(block_ids)
        if tuple(data.shape) != (n, self.block_nbytes) or data.dtype != torch.uint8:
            raise ValueError(f"write_blocks: expected uint8 [{n}, {self.block_nbytes}], got {data.dtype} {tuple(data.shape)}")
        idx = self._tensor(block_ids)
        data = data.to(self.device)
        off = 0
        for t, d in self._block_dims():
            per = t.element_size() * t.numel() // t.shape[d]
            shape = (n,) + tuple(t.shape[:d]) + tuple(t.shape[d + 1:])
            src = data[:, off:off + per].contiguous().view(t.dtype).reshape(shape).movedim(0, d)
            _index_copy(t, d, idx, src)
            off += per

    def _bits(self, on: bool):
        """The context a step's model call runs in: a batch-invariant engine on CUDA computes by fixed tiles
        (model/invariant.py; `tiles`), the CPU with the small-row kernels' bits where `on` (linear.small_row_bits)."""
        return fixed_tiles(True) if self.tiles else small_row_bits(on)

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def execute(self, sched: SchedulerOutput, float_logits: bool = True, greedy: bool = False) -> ModelOutput:
        """Run the step; `float_logits=False` leaves the logits in the model's dtype (the engine's sampler converts
        what it needs: greedy sampling reads bf16 logits as they are). `greedy=True` (every row will be sampled
        greedily, without logprobs): where the model's packed head applies, return each row's argmax in `tokens`
        instead of logits (the same tokens; no [rows, vocab] logits written)."""
        # batch-invariant ("on"): a one-token prompt chunk takes the prefill kernel (the general path), as its
        # prompt's other chunkings would
        prompt_rows = self.batch_invariant and self.invariant_attention == "on"
        if self.decode_fast_path and sched.seqs and all(
                len(s.token_ids) == 1 and s.num_logits == 1 and not s.num_spec_slots
                and not (prompt_rows and s.start_pos < s.decode_from) for s in sched.seqs):
            return self._execute_decode(sched, float_logits, greedy)
        if self.decode_fast_path and sched.seqs and all(
                len(s.token_ids) == s.num_logits and (s.num_spec_slots or len(s.token_ids) == 1)
                and not (prompt_rows and not s.num_spec_slots and s.start_pos < s.decode_from) for s in sched.seqs):
            return self._execute_verify(sched, float_logits, greedy)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        dec_idx: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        logits_idx: list[int] = []
        offsets: list[int] = []
        base_rows = base_logits = 0  # rows and logit rows the step would have without speculative drafts
        prefill = False  # a prefill chunk attended as decode rows (batch_invariant)
        for s in sched.seqs:
            q_start, n = len(input_ids), len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            bt = s.block_ids
            slots.extend(bt[p // bs] * bs + p % bs for p in pos)
            ctx = s.start_pos + n
            # batch-invariant: the prompt's rows (before decode_from) with the prefill kernel, even one alone ("on"),
            # the generated tokens' rows as decode rows, as they were first computed; "strict": all as decode rows
            if s.num_spec_slots or (self.batch_invariant and self.invariant_attention == "strict"):
                n_span = 0
            elif self.batch_invariant:
                n_span = min(n, max(0, s.decode_from - s.start_pos))
            else:
                n_span = n if n > 1 else 0
            if n_span:
                c = s.start_pos + n_span
                spans.append(SeqSpan(q_start, n_span, c, self._tensor(bt[: -(-c // bs)])))
            if n == 1 and not n_span:
                dec_idx.append(q_start)
                dec_tables.append(bt[: -(-ctx // bs)])
                dec_lens.append(ctx)
            elif n > n_span:
                # speculative verification: each token attends like a decode (KV is written first); so do the rows of
                # a batch-invariant prefill chunk past the prompt (a recompute after a preemption) or ("strict") all
                if s.num_spec_slots:
                    base_rows, base_logits = base_rows + 1, base_logits + 1
                else:
                    prefill = True
                for j in range(n_span, n):
                    c = s.start_pos + j + 1
                    dec_idx.append(q_start + j)
                    dec_tables.append(bt[: -(-c // bs)])
                    dec_lens.append(c)
            if n == 1 or not s.num_spec_slots:
                base_rows, base_logits = base_rows + n, base_logits + s.num_logits
            offsets.append(len(logits_idx))
            logits_idx.extend(range(q_start + n - s.num_logits, q_start + n))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), spans=spans, decode_token_idx=None, decode_block_tables=None,
            decode_ctx_lens=None, decode_mask=None, sliding_window=self.sliding_window)
        if self._host_kv_groups:
            meta.kv_groups = KVBlockGroups.of(slots, bs, self._tensor)
        if dec_idx:
            width = max(len(t) for t in dec_tables)
            meta.decode_token_idx = self._tensor(dec_idx)
            meta.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in dec_tables])
            meta.decode_ctx_lens = self._tensor(dec_lens)
        if self.prune_rows and (spans or prefill) and len(logits_idx) < len(input_ids):  # a prefill step: its last layer computes only sampled rows
            meta.logits_rows = self._tensor(logits_idx)
        # verify rows get the linear kernels' bits of the step without drafts (lossless greedy in bf16: see
        # linear.small_row_bits); a step without drafts is unchanged
        small = self.small_rows
        with self._bits(self.batch_invariant or base_rows <= small < len(input_ids)):
            hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_caches, meta)
        if not logits_idx:
            return ModelOutput(torch.empty(0, self.cfg.vocab_size), offsets)
        # logits_idx is strictly increasing in [0, rows): as many entries as rows means every row, in order (a pure
        # decode step): no gather copy
        if len(logits_idx) != hidden.shape[0]:
            hidden = hidden[self._tensor(logits_idx)]
        if greedy:
            tokens = self.model.greedy_tokens(hidden)  # the packed head is batch-invariant: no small_row_bits
            if tokens is not None:
                return ModelOutput(hidden.new_empty(0, self.cfg.vocab_size), offsets, tokens)
        with self._bits(self.batch_invariant or base_logits <= small < len(logits_idx)):
            logits = self.model.compute_logits(hidden, float32=float_logits)
        return ModelOutput(logits, offsets)

    def _execute_decode(self, sched: SchedulerOutput, float_logits: bool, greedy: bool) -> ModelOutput:
        """`execute` for a decode-only step (every sequence one token, its logits, no drafts): the same metadata
        the general path builds for it (tests/engine/test_decode_fast_path.py compares the two), from one loop
        and two tensors: [4, n] (token ids, positions, slots, context lengths; rows are contiguous views) and the
        block tables. No logits gather (rows are in order), no small_row_bits (no drafts)."""
        bs = self.block_size
        ids, pos, slots, ctx, tables = [], [], [], [], []
        for s in sched.seqs:
            p, bt = s.start_pos, s.block_ids
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(bt[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables.append(bt[: p // bs + 1])
        n = len(ids)
        if self.graphs is not None and n <= self.graphs.max_batch:
            hidden = self.graphs.run(ids, pos, slots, ctx, tables)
            return self._decode_output(hidden, n, float_logits, greedy)
        rows, meta = self._decode_rows(ids, pos, slots, ctx, tables)
        with self._bits(self.batch_invariant):
            hidden = self.model(rows[0], rows[1], self.kv_caches, meta)
            return self._decode_output(hidden, n, float_logits, greedy)

    def _decode_rows(self, ids: list[int], pos: list[int], slots: list[int], ctx: list[int],
                     tables: list[list[int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The decode-style rows' tensors (one `[4, n]`: ids, positions, slots, context lengths) and attention
        metadata (block tables padded with block 0 to the longest), shared by `_execute_decode` and
        `_execute_verify`."""
        n = len(ids)
        if n > 1:
            width = max(map(len, tables))
            tables = [t + [0] * (width - len(t)) if len(t) < width else t for t in tables]
        rows = self._tensor([ids, pos, slots, ctx])
        idx = self._aranges.get(n)
        if idx is None:
            idx = self._aranges[n] = self._tensor(list(range(n)))
        meta = AttentionMetadata(slot_mapping=rows[2], spans=[], decode_token_idx=idx,
                                 decode_block_tables=self._tensor(tables), decode_ctx_lens=rows[3], decode_mask=None,
                                 sliding_window=self.sliding_window)
        if self._host_kv_groups:
            meta.kv_groups = KVBlockGroups.of(slots, self.block_size, self._tensor)
        return rows, meta

    def _execute_verify(self, sched: SchedulerOutput, float_logits: bool, greedy: bool) -> ModelOutput:
        """`execute` for a step of decode-style rows only (plain decodes and speculative verifications: every row
        attends like a decode and has its logits): the metadata the general path builds for it
        (tests/engine/test_decode_fast_path.py compares the two), from one loop and two tensors, as
        `_execute_decode` does. No logits gather (every row is a logit row, in order)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        ctx: list[int] = []
        tables: list[list[int]] = []
        offsets: list[int] = []
        for s in sched.seqs:
            offsets.append(len(ids))
            bt, p = s.block_ids, s.start_pos
            for t in s.token_ids:
                ids.append(t)
                pos.append(p)
                slots.append(bt[p // bs] * bs + p % bs)
                ctx.append(p + 1)
                tables.append(bt[: p // bs + 1])
                p += 1
        n = len(ids)
        rows, meta = self._decode_rows(ids, pos, slots, ctx, tables)
        # as the general path: the rows without drafts are one per sequence (lossless greedy in bf16: small_row_bits)
        bits = self.batch_invariant or len(sched.seqs) <= self.small_rows < n
        with self._bits(bits):
            hidden = self.model(rows[0], rows[1], self.kv_caches, meta)
        if greedy:
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return ModelOutput(hidden.new_empty(0, self.cfg.vocab_size), offsets, tokens)
        with self._bits(bits):
            logits = self.model.compute_logits(hidden, float32=float_logits)
        return ModelOutput(logits, offsets)

    def _decode_output(self, hidden: torch.Tensor, n: int, float_logits: bool, greedy: bool) -> ModelOutput:
        offsets = list(range(n))
        if greedy:
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return ModelOutput(hidden.new_empty(0, self.cfg.vocab_size), offsets, tokens)
        return ModelOutput(self.model.compute_logits(hidden, float32=float_logits), offsets)
