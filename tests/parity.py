"""The independent reference for logits: HF transformers; tokenmill's side is engine/scoring.py's Scorer
(the real KVCacheManager + ModelRunner, step by step)."""

import torch

from tokenmill.engine.scoring import Scorer, make_request


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


Harness = Scorer  # fp32 unless told otherwise: the 1e-4 tolerances of the parity tests are fp32's
make_req = make_request
