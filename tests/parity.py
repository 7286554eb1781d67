"""The independent reference for logits: HF transformers, and a harness that drives tokenmill's real
KVCacheManager + ModelRunner step by step."""

import torch

from tokenmill import SamplingParams
from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import load_model

BS = 16


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


class Harness:
    """Drives the real KVCacheManager + ModelRunner step by step, asking for logits of every new token."""

    def __init__(self, path):
        cfg = ModelConfig.from_dir(path)
        model = load_model(path, cfg, torch.device("cpu"), torch.float32, 2048)
        self.kv = KVCacheManager(64, BS, enable_caching=True)
        self.runner = ModelRunner(model, cfg, torch.device("cpu"), torch.float32, 64, BS,
                                  sliding_window=cfg.sliding_window)

    def run(self, reqs_and_chunks):
        """[(req, num_new)] in one step -> list of logits [num_new, V] per entry."""
        seqs = []
        for req, n in reqs_and_chunks:
            start = req.num_computed_tokens
            assert self.kv.allocate_slots(req, start, n)
            seqs.append(ScheduledSeq(req.request_id, req.all_token_ids[start:start + n], start,
                                     self.kv.block_ids(req), num_logits=n))
            req.num_computed_tokens += n
        out = self.runner.execute(SchedulerOutput(seqs))
        return [out.logits[o:o + s.num_logits] for o, s in zip(out.logit_offsets, seqs)]


def make_req(rid, ids):
    return Request(rid, list(ids), SamplingParams(max_tokens=1))
