"""DecodeGraphs: decode-only steps replayed as captured CUDA graphs (`--cuda-graphs`), one per batch-size bucket.

Why: in eager PyTorch every op of a step costs CPU time before the GPU runs it; a decode step of an 8B-shaped
model dispatches ~1,500 kernels (benchmarks/cuda_step_ops.py), more CPU time at batch 1 than the ~3.3 ms its
weights take to read on an H200. A captured graph launches them all at once.

How (the recipe of vLLM's CUDA graph runner and gpt-fast's "reduce-overhead"):
- Buckets of decoding sequences 1, 2, 4, 8, ... up to `max_batch`; a step of n sequences runs the smallest
  bucket B >= n, its rows n..B-1 padding. Larger steps run eagerly.
- Static inputs, one set sized for the largest bucket (each bucket reads a prefix of it): token ids, positions,
  slots, context lengths, block tables of a fixed width (max_model_len / block_size blocks: the decode
  attention's padded gather and mask then have one shape per bucket). A step copies its rows into them with
  one host-to-device copy; padding rows write their K/V into a scratch block the KV manager never hands out
  (the runner allocates one block more) and attend to that one slot (context length 1), so they never read or
  write a real sequence's blocks.
- The captured function is the model's forward on those buffers (attention metadata built inside it, the
  decode mask from the static context lengths); the logits (or the greedy head) run after it, eagerly.
- Capture needs a step that reads nothing back from the device: the 1-byte KV caches group their blocks on the
  host each step (attention.KVBlockGroups), so `--cuda-graphs` is refused with int8 / fp8 KV.

`capture="eager"` runs the same buffers, padding and bucketing without capturing (the function is called at
replay): what the CPU tests compare against the plain decode path, token for token, and what the fake-CUDA
check runs (tokenmill/testing/fake_cuda.py). The CUDA capture itself (`_capture_cuda`) has not run on a GPU yet.
"""

from __future__ import annotations

import torch

from tokenmill.model.attention import AttentionMetadata


# a captured decode step gathers every sequence's K/V over the full table width (max_model_len tokens) in each
# layer: bucket x max_model_len is bounded by this many tokens (8B shape, bf16: ~1 GB of temporary K/V per layer)
GATHER_TOKENS = 1 << 18


def max_graph_batch(max_num_seqs: int, max_model_len: int) -> int:
    """The largest captured bucket: at most max_num_seqs, 256, and GATHER_TOKENS // max_model_len (0: none fit)."""
    return min(max_num_seqs, 256, GATHER_TOKENS // max_model_len)


def buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return out


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_model_len: int, capture: str = "cuda"):
        if capture not in ("cuda", "eager"):
            raise ValueError(f"capture must be cuda or eager, got {capture!r}")
        if capture == "cuda" and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        self.runner = runner
        self.capture = capture
        self.buckets = buckets(max_batch)
        self.max_batch = self.buckets[-1]
        bs = runner.block_size
        self.width = -(-max_model_len // bs)
        self.scratch = runner.scratch_block  # a block no sequence owns: padding rows write and read there
        dev = runner.device
        self.rows = torch.zeros(4, self.max_batch, dtype=torch.long, device=dev)  # ids, positions, slots, ctx
        self.tables = torch.zeros(self.max_batch, self.width, dtype=torch.long, device=dev)
        self.index = torch.arange(self.max_batch, dtype=torch.long, device=dev)
        self._fill_padding(0)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0

    def _fill_padding(self, n: int) -> None:
        """Rows n.. of the static inputs: token 0 at position 0 in the scratch block's slot 0, context 1."""
        self.rows[:, n:] = 0
        self.rows[2, n:] = self.scratch * self.runner.block_size
        self.rows[3, n:] = 1
        self.tables[n:] = self.scratch

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        rows = self.rows[:, :b]
        meta = AttentionMetadata(slot_mapping=rows[2], spans=[], decode_token_idx=self.index[:b],
                                 decode_block_tables=self.tables[:b], decode_ctx_lens=rows[3], decode_mask=None,
                                 sliding_window=r.sliding_window)
        return r.model(rows[0], rows[1], r.kv_caches, meta)

    def _capture_cuda(self, b: int) -> None:  # pragma: no cover - needs a GPU
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, lazy inits)
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._forward(b)
        self.graphs[b], self.outputs[b] = g, out

    def capture_all(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        if self.capture != "cuda":
            return
        for b in reversed(self.buckets):  # pragma: no cover - needs a GPU
            self._capture_cuda(b)

    def run(self, ids: list[int], pos: list[int], slots: list[int], ctx: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step of n <= max_batch sequences (one token each)."""
        n = len(ids)
        b = self.bucket(n)
        host = torch.tensor([ids, pos, slots, ctx], dtype=torch.long)
        tab = torch.full((n, self.width), self.scratch, dtype=torch.long)
        for i, t in enumerate(tables):
            tab[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        dev = self.runner.device
        self.rows[:, :n].copy_(host.to(dev, non_blocking=True))
        self.tables[:n].copy_(tab.to(dev, non_blocking=True))
        self._fill_padding(n)
        self.replays += 1
        if self.capture == "eager":
            return self._forward(b)[:n]
        self.graphs[b].replay()  # pragma: no cover - needs a GPU
        return self.outputs[b][:n]  # pragma: no cover
