"""Teacher-forced scoring through the serving path: the real KVCacheManager + ModelRunner, step by step.

The tokenmill side of the HF-parity tests and of the precision quality gate (held-out loss, greedy
agreement with fp32), so both measure exactly the code that serves requests, in any dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import load_model, resolve_model_path


class Scorer:
    """Drives one model's KV manager + runner directly: any mix of (request, new tokens) per step, logits
    for every new token."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32, num_blocks: int = 64,
                 block_size: int = 16, max_positions: int = 2048, quantization: str = "none",
                 kv_dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
        path = resolve_model_path(str(path))
        self.cfg = ModelConfig.from_dir(path)
        device = torch.device(device)
        model = load_model(path, self.cfg, device, dtype, max_positions, quantization)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
        self.runner = ModelRunner(model, self.cfg, device, dtype, num_blocks, block_size,
                                  sliding_window=self.cfg.sliding_window, kv_dtype=kv_dtype)

    def run(self, reqs_and_chunks: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """[(req, num_new)] in one step -> list of fp32 logits [num_new, V] per entry."""
        seqs = []
        for req, n in reqs_and_chunks:
            start = req.num_computed_tokens
            if not self.kv.allocate_slots(req, start, n):
                raise RuntimeError("scorer KV pool too small for this step")
            seqs.append(ScheduledSeq(req.request_id, req.all_token_ids[start:start + n], start,
                                     self.kv.block_ids(req), num_logits=n, decode_from=req.num_prompt_tokens))
            req.num_computed_tokens += n
        out = self.runner.execute(SchedulerOutput(seqs))
        return [out.logits[o:o + s.num_logits] for o, s in zip(out.logit_offsets, seqs)]

    def logits(self, ids: list[int], chunk: int = 512) -> torch.Tensor:
        """Logits [len(ids), V] of a fresh sequence (prefilled in chunks); its blocks are freed after."""
        req = make_request("score", ids)
        try:
            return torch.cat([self.run([(req, min(chunk, len(ids) - s))])[0] for s in range(0, len(ids), chunk)])
        finally:
            self.kv.free(req)


def make_request(rid: str, ids: list[int]) -> Request:
    return Request(rid, list(ids), SamplingParams(max_tokens=1))


def heldout_quality(scorer: Scorer, windows: torch.Tensor, reference: "Scorer | None" = None,
                    agreement_tokens: int = 64, chunk: int = 512) -> dict:
    """Teacher-forced on [N, S+1] windows: mean next-token loss; with a reference scorer (fp32), the share
    of the first `agreement_tokens` positions where both pick the same greedy token, and its loss.
    `scorer` feeds each window in chunks of `chunk` tokens: a chunk attends to its own K/V as computed and to
    earlier chunks' K/V as stored in the cache, so chunk=1 (decode) reads every earlier token from the cache
    (the worst case for a quantized KV cache); the reference always prefills whole windows."""
    nll = n = agree = n_agree = ref_nll = 0.0
    for w in windows.tolist():
        x, y = w[:-1], torch.tensor(w[1:])
        logits = scorer.logits(x, chunk)
        nll += F.cross_entropy(logits, y, reduction="sum").item()
        n += len(y)
        if reference is not None:
            ref = reference.logits(x)
            ref_nll += F.cross_entropy(ref, y, reduction="sum").item()
            k = min(agreement_tokens, len(y))
            agree += (logits[:k].argmax(-1) == ref[:k].argmax(-1)).sum().item()
            n_agree += k
    out = {"loss": nll / n, "positions": int(n)}
    if reference is not None:
        out.update(reference_loss=ref_nll / n, agreement=agree / n_agree)
    return out
