"""Train the shipped demo models: a ~5M-parameter Llama target and a ~10x smaller draft.

    python scripts/train_demo.py --out tokenmill/model/demo --seed 0 --threads 1   # the shipped run (docs/demo_model.md)
    python scripts/train_demo.py --out /tmp/demo --quick                            # 30-second smoke run

Corpus: the standard library's .py files (tests excluded) with the tokenizer's held-out split (every 10th
file held out), tokenized by the shipped tokenizer, one `<|endoftext|>` after each file. Both models see the
same batches. The target trains on next-token cross entropy; the draft on a mix of cross entropy and
KL(target || draft) against the target's (detached) logits, then a phase of pure distillation from the
frozen, finished target, which raises the greedy agreement rate that speculative decoding lives on.
Optimizer: Muon (fp32 Newton-Schulz) for hidden matrices, AdamW for embeddings and norms; cosine LR.
With --threads 1 the run is bit-reproducible (same weights, same hashes) on a given torch build.

Writes `OUT/demo/` and `OUT/demo-draft/` in HF format (bf16 safetensors, config, generation config, tokenizer)
plus `training_summary.json` in each: held-out loss/perplexity, agreement rate, samples, the command.
Training runs in fp32 (bf16 matmuls are very slow on CPU); metrics are measured on the bf16-rounded weights
that ship. Needs torch and transformers, no network.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenmill.model.tokenizer import SHIPPED_TOKENIZER_DIR, stdlib_sources  # noqa: E402

EOS_ID = 0  # <|endoftext|>
VOCAB = 4096

# HF LlamaConfig fields. Parameter counts (tied embeddings): target ~5.5M, draft ~0.6M.
TARGET = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4)
DRAFT = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="writes OUT/demo and OUT/demo-draft")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=360, help="joint steps (target + draft)")
    p.add_argument("--distill-steps", type=int, default=200, help="draft-only steps against the frozen target")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=8e-3, help="target peak LR (draft: 1.5x)")
    p.add_argument("--kl-weight", type=float, default=0.7, help="draft loss = (1-w)*CE + w*KL(target||draft)")
    p.add_argument("--eval-windows", type=int, default=128, help="held-out windows of seq-len tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads; 1 is faster on an oversubscribed machine")
    p.add_argument("--quick", action="store_true", help="smoke run: a few steps, tiny eval")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.distill_steps, args.eval_windows, args.seq_len = 6, 2, 4, 128
    return args


# -- data ---------------------------------------------------------------------------------------
def load_stream(split: str) -> torch.Tensor:
    """All files of a split, tokenized and joined with <|endoftext|> after each. -> [num_tokens] int64."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SHIPPED_TOKENIZER_DIR / "tokenizer.json"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_sources(held_out_every=10, split=split)]
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len+1 tokens (inputs + shifted labels). -> [num_windows, seq_len+1]"""
    n = (len(stream) - 1) // seq_len
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


def batches(train: torch.Tensor, batch_size: int, gen: torch.Generator):
    """Endless shuffled batches, a fresh permutation each epoch. -> [B, S+1]"""
    while True:
        perm = torch.randperm(len(train), generator=gen)
        for i in range(0, len(perm) - batch_size + 1, batch_size):
            yield train[perm[i : i + batch_size]]


# -- models -------------------------------------------------------------------------------------
def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        attn_implementation="sdpa",
        **shape,
    )


def build(shape: dict):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(shape)).float()


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embedding counted once


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (coefficients of torch.optim.Muon), in fp32. [out, in] -> same"""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update with adjust_lr_fn="match_rms_adamw", but Newton-Schulz runs in fp32: torch's
    runs it in bf16, which this kind of CPU computes hundreds of times slower."""

    def __init__(self, params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - mom)
                update = orthogonalize(p.grad.lerp(buf, mom))  # nesterov
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))


class Optimizer:
    """Muon for the hidden 2-D weights, AdamW for the (tied) embedding and the norm gains, one LR schedule.

    Muon (orthogonalized momentum, RMS matched to AdamW's so one LR serves both) reached a held-out loss
    ~0.7 nats lower than AdamW after 150 steps in a calibration on the draft shape: at this compute budget
    the number of useful steps is what limits quality."""

    def __init__(self, model, lr: float):
        hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]
        other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed_tokens" not in n)]
        self.model, self.peak = model, lr
        self.opts = [
            Muon(hidden, lr=lr),
            torch.optim.AdamW(other, lr=lr, betas=(0.9, 0.95), weight_decay=0.0),
        ]

    def step(self, loss: torch.Tensor, lr: float) -> None:
        for opt in self.opts:
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for opt in self.opts:
            opt.step()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def kl_to(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(target || draft), mean over positions. logits: [N, V]"""
    return F.kl_div(F.log_softmax(draft_logits, -1), F.log_softmax(target_logits, -1), log_target=True, reduction="batchmean")


# -- training -----------------------------------------------------------------------------------
def train(args, target, draft, data) -> dict:
    """Joint phase (both train on the same batch), then draft-only distillation from the frozen target."""
    opt_t, opt_d = Optimizer(target, args.lr), Optimizer(draft, args.lr * 1.5)
    warmup = max(1, min(30, args.steps // 10))
    log = {"joint": [], "distill": []}
    t0 = time.time()
    for step in range(args.steps):
        batch = next(data)  # [B, S+1]
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        t_logits = target(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)  # [B*S, V]
        t_loss = F.cross_entropy(t_logits, y)
        opt_t.step(t_loss, lr_at(step, args.steps, opt_t.peak, warmup))
        d_logits = draft(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)
        d_ce = F.cross_entropy(d_logits, y)
        d_loss = (1 - args.kl_weight) * d_ce + args.kl_weight * kl_to(t_logits.detach(), d_logits)
        opt_d.step(d_loss, lr_at(step, args.steps, opt_d.peak, warmup))
        if step % 20 == 0 or step == args.steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (args.steps - step - 1)
            print(f"joint {step:4d}/{args.steps} target ce {t_loss.item():.3f} draft ce {d_ce.item():.3f} "
                  f"elapsed {el:.0f}s eta {eta:.0f}s", flush=True)
            log["joint"].append({"step": step, "target_ce": round(t_loss.item(), 4), "draft_ce": round(d_ce.item(), 4)})
    target.eval()
    peak = opt_d.peak * 0.5
    for step in range(args.distill_steps):
        x = next(data)[:, :-1]
        with torch.no_grad():
            t_logits = target(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)
        d_loss = kl_to(t_logits, draft(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB))
        opt_d.step(d_loss, lr_at(step, args.distill_steps, peak, max(1, args.distill_steps // 10)))
        if step % 20 == 0 or step == args.distill_steps - 1:
            print(f"distill {step:4d}/{args.distill_steps} kl {d_loss.item():.3f} "
                  f"elapsed {time.time() - t0:.0f}s", flush=True)
            log["distill"].append({"step": step, "kl": round(d_loss.item(), 4)})
    log["train_s"] = round(time.time() - t0, 1)
    return log


# -- evaluation ---------------------------------------------------------------------------------
def round_to_bf16(model) -> None:
    """Round the fp32 weights to bf16 in place, so evaluation sees exactly the weights that ship."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


@torch.no_grad()
def evaluate(target, draft, heldout: torch.Tensor, batch_size: int) -> dict:
    """Teacher-forced on held-out windows: loss/ppl/top-1 accuracy of each model, and the share of positions
    where draft argmax == target argmax."""
    target.eval()
    draft.eval()
    n = 0
    t_nll = d_nll = t_hit = d_hit = agree = 0.0
    for i in range(0, len(heldout), batch_size):
        batch = heldout[i : i + batch_size]
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        tl = target(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)
        dl = draft(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)
        t_nll += F.cross_entropy(tl, y, reduction="sum").item()
        d_nll += F.cross_entropy(dl, y, reduction="sum").item()
        ta, da = tl.argmax(-1), dl.argmax(-1)
        t_hit += (ta == y).sum().item()
        d_hit += (da == y).sum().item()
        agree += (ta == da).sum().item()
        n += y.numel()

    def side(nll, hit):
        return {"loss": round(nll / n, 4), "perplexity": round(math.exp(nll / n), 3), "top1_accuracy": round(hit / n, 4)}

    return {"positions": n, "target": side(t_nll, t_hit), "draft": side(d_nll, d_hit), "agreement": round(agree / n, 4)}


def samples(model_dir: Path, max_new_tokens: int = 48) -> list[dict]:
    """Greedy continuations from the saved directory (HF generate, fp32 compute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append({"prompt": prompt, "completion": tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=False)})
    return out


# -- output -------------------------------------------------------------------------------------
def save(model, out: Path) -> None:
    """HF directory: bf16 safetensors, config (with the classic keys older readers expect), tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(torch_dtype="bfloat16", rope_theta=10000.0, rope_scaling=None, use_cache=True)
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    gen = {"bos_token_id": None, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SHIPPED_TOKENIZER_DIR / name, out / name)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    train_w = windows(load_stream("train"), args.seq_len)
    held = windows(load_stream("heldout"), args.seq_len)
    held = held[torch.linspace(0, len(held) - 1, min(args.eval_windows, len(held))).long()]  # evenly spaced
    print(f"train windows {len(train_w)} x {args.seq_len + 1}, held-out eval windows {len(held)}", flush=True)

    target, draft = build(TARGET), build(DRAFT)
    print(f"params: target {num_params(target):,} draft {num_params(draft):,}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    log = train(args, target, draft, batches(train_w, args.batch_size, gen))
    round_to_bf16(target)
    round_to_bf16(draft)
    t_eval = time.time()
    metrics = evaluate(target, draft, held, batch_size=args.batch_size)
    metrics["eval_s"] = round(time.time() - t_eval, 1)
    print(json.dumps(metrics), flush=True)

    out = Path(args.out)
    dirs = {"target": out / "demo", "draft": out / "demo-draft"}
    save(target, dirs["target"])
    save(draft, dirs["draft"])
    command = "python scripts/train_demo.py " + " ".join(argv if argv is not None else sys.argv[1:])
    common = {
        "command": command,
        "seed": args.seed,
        "corpus": "Python stdlib .py files, tests excluded; every 10th file (sorted) held out",
        "train_tokens_seen": (args.steps + args.distill_steps) * args.batch_size * args.seq_len,
        "train_windows": len(train_w),
        "hyperparameters": {k: getattr(args, k) for k in ("steps", "distill_steps", "batch_size", "seq_len", "lr", "kl_weight")},
        "heldout_eval": metrics,
        "train_log": log,
        "torch": torch.__version__,
    }
    for role, model in (("target", target), ("draft", draft)):
        summary = {"role": role, "params": num_params(model), **common}
        if role == "target":
            summary["samples"] = samples(dirs["target"])
        summary["wall_s"] = round(time.time() - t_start, 1)
        (dirs[role] / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {dirs['target']} and {dirs['draft']} in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
