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

# the README's three prompts, then two more
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "def add(a, b):", "class Stack:", "    def __init__(self"]


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
    p.add_argument("--init", default=None,
                   help="continue from a trained pair: DIR/demo and DIR/demo-draft (HF dirs, e.g. the shipped pair)")
    p.add_argument("--skip-batches", type=int, default=0,
                   help="start the data stream this many batches in (the batches an --init pair already saw)")
    p.add_argument("--unlikelihood", type=float, default=0.0,
                   help="target loss += w * token-level unlikelihood of the previous --ul-window tokens (anti-repetition)")
    p.add_argument("--ul-window", type=int, default=16)
    p.add_argument("--seq-ul-steps", type=int, default=0,
                   help="after the joint phase: target steps of sequence-level unlikelihood on its own greedy "
                        "continuations (repeated 4-grams penalized), each followed by an MLE step")
    p.add_argument("--seq-ul-prefix", type=int, default=32, help="prefix tokens of a sequence-level UL step")
    p.add_argument("--seq-ul-len", type=int, default=64, help="greedy tokens generated per sequence-level UL step")
    p.add_argument("--seq-ul-exempt-prompt", action="store_true",
                   help="sequence-level UL: never penalize an n-gram that also occurs in the prompt (copying code "
                        "with internal repeats is not a loop)")
    p.add_argument("--copy-frac", type=float, default=0.0,
                   help="joint phase: this share of each batch's windows repeat their own start (a block of code "
                        "that occurs twice), so the target learns to copy from its context")
    p.add_argument("--induction-steps", type=int, default=0,
                   help="before the joint phase: target-only steps on random token sequences shown twice, loss on "
                        "the repeat only (the classic induction-head task): a model without induction heads cannot "
                        "copy from its prompt at all, and natural-text edit data alone did not grow them")
    p.add_argument("--induction-len", type=int, default=64, help="random tokens per --induction-steps row (x2)")
    p.add_argument("--induction-rows", type=int, default=16, help="rows per --induction-steps step")
    p.add_argument("--induction-mix", type=int, default=0, metavar="ROWS",
                   help="joint and sequence-UL phases: each target update also takes ROWS random token rows shown "
                        "twice ([r, r], --induction-len tokens each, cross entropy on the repeat, weight "
                        "--induction-weight) beside its text batch: the induction circuit grows beside the language "
                        "model instead of in a phase of its own that the text steps then erase")
    p.add_argument("--induction-weight", type=float, default=1.0, help="weight of the --induction-mix loss")
    p.add_argument("--induction-vary", action="store_true",
                   help="each --induction-mix step draws its span length from [--induction-len / 4, --induction-len]")
    p.add_argument("--induction-code-frac", type=float, default=0.0,
                   help="share of the --induction-mix rows that are a span of training code shown twice ([c, c]) "
                        "instead of random tokens")
    p.add_argument("--edit-frac", type=float, default=0.0,
                   help="joint phase: this share of each batch's windows become an edit example: code from the "
                        "window, a marker line (one of EDIT_MARKERS: 'the same code again', 'with X renamed to Y', "
                        "..) and the same code again (renamed where the marker says so), then the file goes on; "
                        "copying is learned conditioned on an explicit instruction, not from any repeat")
    p.add_argument("--gen-distill", action="store_true",
                   help="distillation on the target's own greedy continuations (what speculative acceptance measures): "
                        "each distillation row is --gen-prefix tokens of a training window + the frozen target's "
                        "greedy continuation of --gen-len tokens, generated once by tokenmill (bf16, as served); "
                        "needs --steps 0 --seq-ul-steps 0 (the target must be the --init one)")
    p.add_argument("--gen-prefix", type=int, default=128, help="prompt tokens of a --gen-distill row")
    p.add_argument("--gen-len", type=int, default=128, help="greedy tokens of a --gen-distill row")
    p.add_argument("--gen-cache", default=None, help="file for the generated rows (reused when it exists)")
    p.add_argument("--argmax-weight", type=float, default=0.0,
                   help="distillation loss = KL + w * CE(draft, argmax of the target): greedy acceptance is argmax agreement")
    p.add_argument("--checkpoint", default=None,
                   help="state file: training saves it and exits with status 3 after --segment-s; re-run to resume")
    p.add_argument("--segment-s", type=float, default=540.0, help="seconds of training per segment (with --checkpoint)")
    p.add_argument("--draft-induction-mix", type=int, default=0, metavar="ROWS",
                   help="joint and distillation phases: the draft also takes ROWS induction rows per update (as "
                        "--induction-mix: --induction-len, --induction-vary, --induction-code-frac, --induction-weight), "
                        "so it can follow a target that copies from its context (a draft without the circuit cannot)")
    p.add_argument("--seq-ul-edits", action="store_true",
                   help="sequence-UL phase: its MLE updates take --edit-frac edit windows too (without them the "
                        "phase trains on plain text only and the target's greedy copying fades)")
    p.add_argument("--seq-ul-line-starts", action="store_true",
                   help="sequence-UL phase: the mid-file half of its prefixes start at a `def`/`class` line of a "
                        "training window, tokenized as a prompt on its own (what a user's short prompt looks like: "
                        "`def name(args):`, `    def __init__(self`), instead of at a window's first token")
    p.add_argument("--seq-ul-line-kinds", default="def,class",
                   help="with --seq-ul-line-starts: the keywords a prefix's line opens with, comma-separated "
                        "(def, class, import, from, ...)")
    p.add_argument("--quick", action="store_true", help="smoke run: a few steps, tiny eval")
    args = p.parse_args(argv)
    if not 0 <= args.copy_frac <= 1 or not 0 <= args.edit_frac <= 1 or args.copy_frac + args.edit_frac > 1:
        p.error("--copy-frac and --edit-frac must be in [0, 1], their sum <= 1")
    if args.induction_steps < 0 or args.induction_len < 2 or args.induction_rows < 1:
        p.error("--induction-steps must be >= 0, --induction-len >= 2, --induction-rows >= 1")
    if args.unlikelihood < 0 or args.ul_window < 1:
        p.error("--unlikelihood must be >= 0 and --ul-window >= 1")
    if args.seq_ul_steps < 0 or args.seq_ul_prefix < 1 or args.seq_ul_len < 4:
        p.error("--seq-ul-steps must be >= 0, --seq-ul-prefix >= 1, --seq-ul-len >= 4")
    if args.gen_distill and (args.steps or args.seq_ul_steps or args.induction_steps or not args.init):
        p.error("--gen-distill needs --init and --steps 0 --seq-ul-steps 0 (the continuations are the --init target's)")
    if args.gen_prefix < 1 or args.gen_len < 1 or args.argmax_weight < 0:
        p.error("--gen-prefix and --gen-len must be >= 1, --argmax-weight >= 0")
    if args.draft_induction_mix < 0:
        p.error("--draft-induction-mix must be >= 0")
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


class Batches:
    """Shuffled batches, a fresh permutation each epoch (from one generator seeded with the seed), addressable
    by batch index so a resumed run continues the same stream. batch(j) -> [B, S+1]"""

    def __init__(self, train: torch.Tensor, batch_size: int, seed: int):
        self.train, self.b = train, batch_size
        self.per_epoch = len(train) // batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.perms: list[torch.Tensor] = []

    def file_starts(self, length: int) -> torch.Tensor:
        """The first `length` tokens of every training file whose start lies inside a window. -> [F, length]"""
        w = self.train
        eos = (w[:, :-1] == EOS_ID).nonzero().tolist()
        rows = [w[i, j + 1 : j + 1 + length] for i, j in eos if j + 1 + length <= w.shape[1]]
        return torch.stack(rows)

    def batch(self, j: int) -> torch.Tensor:
        epoch, i = divmod(j, self.per_epoch)
        while len(self.perms) <= epoch:
            self.perms.append(torch.randperm(len(self.train), generator=self.gen))
        return self.train[self.perms[epoch][i * self.b : (i + 1) * self.b]]


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


def build(shape: dict, init: Path | None = None):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(shape)).float()
    if init is not None:  # continue from a saved pair: same shape required (strict load)
        from safetensors.torch import load_file

        state = {k: v.float() for k, v in load_file(str(init / "model.safetensors")).items()}
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True)
        model.tie_weights()
    return model


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


def unlikelihood(logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor, window: int) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al. 2019, "Neural text generation with unlikelihood training"):
    -log(1 - p(c)) summed over the candidates c = the last `window` input tokens up to and including position t,
    except the true next token; mean over positions. Pushes probability off tokens that would repeat recent
    context when they are not what comes next: the greedy loops (`path.path.path`) of a small model.
    logits [B, S, V], x [B, S] inputs, y [B, S] next tokens."""
    b, s, v = logits.shape
    idx = torch.arange(s)[:, None] - torch.arange(window)[None, :]  # [S, W] positions t, t-1, ..
    ctx = x[:, idx.clamp(min=0)]  # [B, S, W]
    ctx = torch.where((idx >= 0)[None], ctx, y[:, :, None])  # before the window's start: the true token (removed)
    cand = torch.zeros(b, s, v, dtype=torch.bool).scatter_(2, ctx, True)
    cand.scatter_(2, y[:, :, None], False)
    p = torch.softmax(logits.float(), dim=-1)
    return -(torch.log((1 - p).clamp(min=1e-5)) * cand).sum() / (b * s)


def repeated_ngram_mask(seq: torch.Tensor, start: int, n: int = 4, exempt_prompt: bool = False) -> torch.Tensor:
    """[B, L] tokens -> [B, L] bool: position t ends an n-gram of the continuation (positions >= start) that
    already occurred earlier in the continuation (Welleck et al.'s sequence-level candidates: the tokens that
    make a continuation loop). Only n-grams wholly inside the continuation count: copying from the prompt
    (code that is repeated, edited, refactored) is legitimate and must not be penalized — an earlier version
    that counted the prefix's n-grams too taught the target not to copy (edit workload n-gram 2.19x -> 1.23x).
    exempt_prompt: n-grams that also occur in the prompt (positions < start) are never penalized, even when the
    continuation repeats them: a copy of prompt code whose own lines share n-grams (`self.`, indentation runs) is
    copying, not a loop (session 16: without it, long-prefix UL taught the target to stop copying)."""
    b, length = seq.shape
    mask = torch.zeros(b, length, dtype=torch.bool)
    rows = seq.tolist()
    for i, row in enumerate(rows):
        seen = set()
        prompt = {tuple(row[t - n + 1 : t + 1]) for t in range(n - 1, start)} if exempt_prompt else set()
        for t in range(start + n - 1, length):
            g = tuple(row[t - n + 1 : t + 1])
            if g in seen and g not in prompt:
                mask[i, t] = True
            seen.add(g)
    return mask


def sequence_unlikelihood(model, prefix: torch.Tensor, new_tokens: int,
                          exempt_prompt: bool = False) -> tuple[torch.Tensor, float]:
    """Sequence-level unlikelihood: greedy-decode new_tokens after each prefix [B, P] with the model itself,
    then -log(1 - p(x_t)) at the positions that repeat a 4-gram, mean over the continuation's positions.
    Returns (loss, share of repeating positions)."""
    model.eval()
    with torch.no_grad():
        seq = model.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=EOS_ID)
    model.train()
    p_len = prefix.shape[1]
    mask = repeated_ngram_mask(seq, p_len, exempt_prompt=exempt_prompt)[:, 1:]  # aligned with the logits that predict seq[:, 1:]
    logits = model(input_ids=seq[:, :-1], use_cache=False).logits
    prob = torch.softmax(logits.float(), dim=-1).gather(-1, seq[:, 1:, None])[..., 0]
    ul = -(torch.log((1 - prob).clamp(min=1e-5)) * mask).sum() / (seq.shape[0] * new_tokens)
    return ul, mask[:, p_len - 1 :].float().mean().item()


def seq_ul_prefixes(data: "Batches", batch: torch.Tensor, step: int, max_len: int,
                    line_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Prefixes for a sequence-level UL step: length 2..max_len (cycling with the step: short prompts loop
    most), half of them from the batch's windows (mid-file contexts; with line_starts [N, >= max_len], rows of
    it chosen by the step instead), half the first tokens of training files (what a prompt like `import os`
    looks like: a file's start), chosen by the step. -> [B, L]"""
    length = 2 + step % max(1, max_len - 1)
    starts = data.file_starts(length)
    b = batch.shape[0]
    half = b // 2
    pick = [(step * 7919 + 104729 * j) % len(starts) for j in range(b - half)]
    if line_starts is None:
        first = batch[:half, :length]
    else:
        first = line_starts[[(step * 6007 + 7727 * j) % len(line_starts) for j in range(half)], :length]
    return torch.cat([first, starts[pick]], dim=0)


def line_start_prompts(train: torch.Tensor, min_len: int, limit: int = 4096,
                       kinds: tuple[str, ...] = ("def", "class")) -> torch.Tensor:
    """Prompts cut from the training windows at a line that opens a `def` or `class` (indented or not), each
    tokenized on its own as a user's prompt would be (a mid-file `\\n    def` is other tokens than a prompt's
    `    def`), first min_len tokens; at most `limit`, in window order (deterministic). -> [N, min_len]"""
    import re

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SHIPPED_TOKENIZER_DIR / "tokenizer.json"))
    line = re.compile(r"^ *(?:" + "|".join(map(re.escape, kinds)) + r") \w", re.M)
    rows: list[list[int]] = []
    for w in train.tolist():
        text = tok.decode(w, skip_special_tokens=False)
        for m in line.finditer(text):
            ids = tok.encode(text[m.start() : m.start() + 400], add_special_tokens=False).ids
            if len(ids) >= min_len and EOS_ID not in ids[:min_len]:
                rows.append(ids[:min_len])
        if len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"no {'/'.join(kinds)} line with enough tokens in the training windows")
    return torch.tensor(rows[:limit], dtype=torch.long)


def with_copies(batch: torch.Tensor, step: int, frac: float) -> torch.Tensor:
    """The first round(frac * B) windows become a block and its repeat: tokens [0, L) then [0, S+1-L) again,
    L in 128..383 (varying with the step). Code repeats blocks (a refactor, an edit, a test of the same call);
    a model that never sees a long verbatim repeat does not learn to copy one (the n-gram proposer's edit
    workload lives on it). Deterministic in the step. [B, S+1] -> [B, S+1]"""
    m = round(frac * batch.shape[0])
    if m == 0:
        return batch
    out = batch.clone()
    length = 128 + (step * 37) % 256
    width = batch.shape[1]
    out[:m, length:] = batch[:m, : width - length]
    return out


# Edit-format training data (--edit-frac). The markers resemble benchmarks/spec_decode.py edit's default format
# ("# Original:" ... "# The same code, reformatted:"); its --format before-after ("# Before:" / "# After:") is
# deliberately NOT among them, so that number shows whether copying generalizes to an unseen instruction.
EDIT_HEADS = ["", "# Original:\n", "# Code:\n", "# Original code:\n", "# Source:\n"]
EDIT_MARKERS = ["# The same code, reformatted:", "# The same code again:", "# The same code, rewritten:",
                "# Copy of the code above:", "# Repeated verbatim:", "# The code above, once more:",
                "# Same as above:", "# Reformatted:"]
RENAME_MARKER = "# The same code, with {old} renamed to {new}:"
_KEYWORDS = set(__import__("keyword").kwlist) | {"self", "cls", "None", "True", "False"}


class EditWindows:
    """--edit-frac: turns a training window into "HEAD code SEP MARKER\n code' rest" (code: whole lines of the
    window's first ~L tokens, L in 96..223; code' = code, or code with one identifier renamed when the marker
    says so; rest: what followed the code in the file), re-tokenized and cut to the window's length. Windows
    holding a file boundary (<|endoftext|>) in the code are left as they are. Deterministic in (step, row)."""

    def __init__(self):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(SHIPPED_TOKENIZER_DIR / "tokenizer.json"))

    def make(self, window: torch.Tensor, seed: int) -> torch.Tensor:
        import random
        import re

        rng = random.Random(seed)
        width = window.shape[0]
        n = rng.randrange(96, 224)
        ids = window.tolist()
        if EOS_ID in ids[:n]:
            return window
        full = self.tok.decode(ids, skip_special_tokens=False)
        head_text = self.tok.decode(ids[:n], skip_special_tokens=False)
        s, e = head_text.find("\n") + 1, head_text.rfind("\n") + 1
        if not full.startswith(head_text[:e]) or e - s < 40:
            return window
        code, rest = full[s:e], full[e:]
        code2, marker = code, rng.choice(EDIT_MARKERS)
        if rng.random() < 0.3:  # an edit, not a copy: one identifier renamed
            names = [w for w in re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b", code) if w not in _KEYWORDS]
            if names:
                old = rng.choice(names)
                new = rng.choice(["new_", "my_", "the_", ""]) + old + rng.choice(["", "2", "_x", "_new"])
                if new == old:
                    new = old + "_1"
                code2 = re.sub(rf"\b{re.escape(old)}\b", new, code)
                marker = RENAME_MARKER.format(old=old, new=new)
        text = rng.choice(EDIT_HEADS) + code + rng.choice(["", "\n"]) + marker + "\n" + code2 + rest
        out = self.tok.encode(text, add_special_tokens=False).ids[:width]
        if len(out) < width:
            return window
        return torch.tensor(out, dtype=window.dtype)


def with_edits(batch: torch.Tensor, step: int, frac: float, edits: "EditWindows | None") -> torch.Tensor:
    """The last round(frac * B) windows become edit examples (EditWindows). [B, S+1] -> [B, S+1]"""
    m = round(frac * batch.shape[0])
    if m == 0 or edits is None:
        return batch
    out = batch.clone()
    for i in range(batch.shape[0] - m, batch.shape[0]):
        out[i] = edits.make(batch[i], step * 1009 + i)
    return out


def induction_loss(model, rows: int, length: int, seed: int, code: torch.Tensor | None = None,
                   code_frac: float = 0.0, vary: bool = False) -> torch.Tensor:
    """Olsson et al. 2022's induction task: `rows` sequences [r, r] of `length` random tokens (ids >= 100: no
    special or very frequent byte tokens), cross entropy on the second r only. With `code` ([N, S+1] training
    windows) the last round(code_frac * rows) rows are [c, c] for c a random `length`-token span of training code
    instead: in code a token recurs many times, so copying it needs the span's preceding tokens matched, not one
    token (a model that copies random tokens perfectly did not copy code). Deterministic in the seed."""
    g = torch.Generator().manual_seed(seed)
    if vary:  # the step's span length drawn from [length / 4, length]: a fixed distance between the two showings
        # is learned as "attend a fixed offset back" (RoPE makes that easy), which copies nothing else
        length = int(torch.randint(max(2, length // 4), length + 1, (1,), generator=g))
    r = torch.randint(100, VOCAB, (rows, length), generator=g)
    m = round(code_frac * rows) if code is not None else 0
    if m:
        idx = torch.randint(0, code.shape[0], (m,), generator=g)
        off = torch.randint(0, code.shape[1] - length + 1, (m,), generator=g)
        r[rows - m :] = torch.stack([code[i, o : o + length] for i, o in zip(idx.tolist(), off.tolist())])
    seq = torch.cat([r, r], dim=1)
    logits = model(input_ids=seq[:, :-1], use_cache=False).logits[:, length - 1 :]
    return F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, length:].reshape(-1))


def generated_rows(args, data: "Batches") -> torch.Tensor:
    """--gen-distill data: for distillation step j, the rows of batch(skip + j) cut to their first --gen-prefix
    tokens, each followed by the --init target's greedy continuation of --gen-len tokens as tokenmill serves it
    (bf16, EOS not stopping). Generated once, all steps in one batched offline run; cached in --gen-cache.
    -> [distill_steps * B, gen_prefix + gen_len]"""
    cache = Path(args.gen_cache) if args.gen_cache else None
    if cache is not None and cache.exists():
        rows = torch.load(cache)
        if rows.shape[1] == args.gen_prefix + args.gen_len and len(rows) >= args.distill_steps * args.batch_size:
            return rows
        raise SystemExit(f"{cache} holds rows of another shape {tuple(rows.shape)}; delete it")
    from tokenmill import LLM, SamplingParams

    prefixes = torch.cat([data.batch(args.skip_batches + j)[:, : args.gen_prefix] for j in range(args.distill_steps)])
    t0 = time.time()
    llm = LLM(str(Path(args.init) / "demo"), kv_cache_bytes="512MiB")
    sp = SamplingParams(max_tokens=args.gen_len, temperature=0, ignore_eos=True)
    cont = []
    for i in range(0, len(prefixes), 1024):  # the engine's waiting queue is bounded
        outs = llm.generate([r.tolist() for r in prefixes[i : i + 1024]], sp)
        cont.extend(o.outputs[0].token_ids for o in outs)
    cont = torch.tensor(cont, dtype=torch.long)
    rows = torch.cat([prefixes, cont], dim=1)
    print(f"generated {len(rows)} continuations of {args.gen_len} tokens in {time.time() - t0:.0f}s", flush=True)
    if cache is not None:
        save_checkpoint(cache, rows)
    return rows


# -- training -----------------------------------------------------------------------------------
def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a run killed while saving leaves the previous checkpoint


class SegmentDone(Exception):
    """The segment's time is up; the checkpoint is saved. Re-run the same command to resume."""


def train(args, target, draft, data: Batches) -> dict:
    """Joint phase (both train on the same batch), then draft-only distillation from the frozen target.
    With --checkpoint: state saved (models, optimizers, step, log) once a segment has run --segment-s, then
    SegmentDone; a re-run resumes at the saved step with the same batches."""
    opt_t, opt_d = Optimizer(target, args.lr), Optimizer(draft, args.lr * 1.5)
    warmup = max(1, min(30, args.steps // 10))
    log = {"joint": [], "distill": [], "train_s": 0.0}
    start = 0  # global step: joint steps 0..steps-1, then distillation steps
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        # options added after a checkpoint was written are absent from it: they match when left off (falsy)
        now = checkpoint_args(args)
        if st["args"] != {k: v for k, v in now.items() if k in st["args"] or v}:
            raise SystemExit(f"{ckpt} was written with other arguments {st['args']}; delete it or use those")
        target.load_state_dict(st["target"])
        draft.load_state_dict(st["draft"])
        for o, sd in zip(opt_t.opts + opt_d.opts, st["opts"]):
            o.load_state_dict(sd)
        start, log = st["step"], st["log"]
        print(f"resumed from {ckpt} at step {start} ({log['train_s']:.0f}s trained)", flush=True)
    t0 = time.time()
    trained0 = log["train_s"]

    edits = EditWindows() if args.edit_frac else None

    def draft_induction(step: int) -> torch.Tensor:
        """--draft-induction-mix: the draft's own induction rows for a global step (other seeds than the target's)."""
        return induction_loss(draft, args.draft_induction_mix, args.induction_len, args.seed * 1_000_003 + 2_000_000 + step,
                              data.train, args.induction_code_frac, args.induction_vary)
    ind = args.induction_steps
    # global steps: induction, joint, then sequence-level UL, then distillation
    seq_end = ind + args.steps + args.seq_ul_steps
    last = seq_end + args.distill_steps

    def maybe_checkpoint(next_step: int) -> None:
        log["train_s"] = round(trained0 + time.time() - t0, 1)
        if ckpt is None or time.time() - t0 < args.segment_s or next_step >= last:
            return
        save_checkpoint(ckpt, {"args": checkpoint_args(args), "step": next_step, "log": log,
                               "target": target.state_dict(), "draft": draft.state_dict(),
                               "opts": [o.state_dict() for o in opt_t.opts + opt_d.opts]})
        raise SegmentDone(f"checkpoint {ckpt} at step {next_step}")

    log.setdefault("induction", [])
    for step in range(start, ind):
        # Olsson et al. 2022's induction task: [r, r] for random r, cross entropy on the second r only
        # (--induction-vary: varied span lengths here too, so no fixed offset solves the warm-up either)
        loss = induction_loss(target, args.induction_rows, args.induction_len, args.seed * 1_000_003 + step,
                              vary=args.induction_vary)
        opt_t.step(loss, opt_t.peak)
        if step % 20 == 0 or step == ind - 1:
            print(f"induction {step:4d}/{ind} repeat ce {loss.item():.3f} elapsed {time.time() - t0:.0f}s", flush=True)
            log["induction"].append({"step": step, "repeat_ce": round(loss.item(), 4)})
        maybe_checkpoint(step + 1)
    for step in range(max(0, start - ind), args.steps):
        batch = with_copies(data.batch(args.skip_batches + step), step, args.copy_frac)  # [B, S+1]
        batch = with_edits(batch, step, args.edit_frac, edits)
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        t_logits = target(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)  # [B*S, V]
        t_loss = F.cross_entropy(t_logits, y)
        t_obj = t_loss
        if args.unlikelihood:
            ul = unlikelihood(t_logits.view(*x.shape, VOCAB), x, batch[:, 1:], args.ul_window)
            t_obj = t_loss + args.unlikelihood * ul
        if args.induction_mix:
            ind_ce = induction_loss(target, args.induction_mix, args.induction_len, args.seed * 1_000_003 + 500_000 + step,
                                    data.train, args.induction_code_frac, args.induction_vary)
            t_obj = t_obj + args.induction_weight * ind_ce
        opt_t.step(t_obj, lr_at(step, args.steps, opt_t.peak, warmup))
        d_logits = draft(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)
        d_ce = F.cross_entropy(d_logits, y)
        d_loss = (1 - args.kl_weight) * d_ce + args.kl_weight * kl_to(t_logits.detach(), d_logits)
        if args.draft_induction_mix:
            d_loss = d_loss + args.induction_weight * draft_induction(step)
        opt_d.step(d_loss, lr_at(step, args.steps, opt_d.peak, warmup))
        if step % 20 == 0 or step == args.steps - 1:
            el = time.time() - t0
            eta = el / (step + 1 - max(0, start - ind)) * (args.steps - step - 1)
            ul_s = f" ul {ul.item():.3f}" if args.unlikelihood else ""
            if args.induction_mix:
                ul_s += f" repeat ce {ind_ce.item():.3f}"
            print(f"joint {step:4d}/{args.steps} target ce {t_loss.item():.3f}{ul_s} draft ce {d_ce.item():.3f} "
                  f"elapsed {el:.0f}s eta {eta:.0f}s", flush=True)
            entry = {"step": step, "target_ce": round(t_loss.item(), 4), "draft_ce": round(d_ce.item(), 4)}
            if args.unlikelihood:
                entry["target_ul"] = round(ul.item(), 4)
            if args.induction_mix:
                entry["repeat_ce"] = round(ind_ce.item(), 4)
            log["joint"].append(entry)
        maybe_checkpoint(ind + step + 1)
    log.setdefault("seq_ul", [])
    line_pool = (line_start_prompts(data.train, args.seq_ul_prefix, kinds=tuple(args.seq_ul_line_kinds.split(",")))
                 if args.seq_ul_line_starts and args.seq_ul_steps else None)
    for step in range(max(0, start - ind - args.steps), args.seq_ul_steps):
        # Welleck et al. 2019 sec. 5.2: alternate a sequence-level UL update on the model's own greedy
        # continuations with an MLE (+ token-level UL) update; constant LR, a quarter of the peak
        batch = data.batch(args.skip_batches + args.steps + step)  # [B, S+1]
        lr = opt_t.peak * 0.25
        s_ul, rep = sequence_unlikelihood(target, seq_ul_prefixes(data, batch, step, args.seq_ul_prefix, line_pool),
                                          args.seq_ul_len, args.seq_ul_exempt_prompt)
        opt_t.step(s_ul, lr)
        if args.seq_ul_edits:
            batch = with_edits(batch, 1_000_000 + step, args.edit_frac, edits)
        x, y = batch[:, :-1], batch[:, 1:]
        t_logits = target(input_ids=x, use_cache=False).logits
        t_loss = F.cross_entropy(t_logits.reshape(-1, VOCAB), y.reshape(-1))
        obj = t_loss + args.unlikelihood * unlikelihood(t_logits, x, y, args.ul_window) if args.unlikelihood else t_loss
        if args.induction_mix:
            ind_ce = induction_loss(target, args.induction_mix, args.induction_len, args.seed * 1_000_003 + 900_000 + step,
                                    data.train, args.induction_code_frac, args.induction_vary)
            obj = obj + args.induction_weight * ind_ce
        opt_t.step(obj, lr)
        if step % 10 == 0 or step == args.seq_ul_steps - 1:
            print(f"seq-ul {step:4d}/{args.seq_ul_steps} repeating share {rep:.3f} seq ul {s_ul.item():.3f} "
                  f"target ce {t_loss.item():.3f}" + (f" repeat ce {ind_ce.item():.3f}" if args.induction_mix else "")
                  + f" elapsed {time.time() - t0:.0f}s", flush=True)
            log["seq_ul"].append({"step": step, "repeat_share": round(rep, 4), "seq_ul": round(s_ul.item(), 4),
                                  "target_ce": round(t_loss.item(), 4)}
                                 | ({"repeat_ce": round(ind_ce.item(), 4)} if args.induction_mix else {}))
        maybe_checkpoint(ind + args.steps + step + 1)
    target.eval()
    peak = opt_d.peak * 0.5
    gen = generated_rows(args, data) if args.gen_distill else None
    for step in range(max(0, start - seq_end), args.distill_steps):
        if gen is not None:
            x = gen[step * args.batch_size : (step + 1) * args.batch_size, :-1]
        else:
            x = data.batch(args.skip_batches + seq_end - ind + step)[:, :-1]
        with torch.no_grad():
            t_logits = target(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)
        d_logits = draft(input_ids=x, use_cache=False).logits.reshape(-1, VOCAB)
        d_loss = kl_to(t_logits, d_logits)
        if args.argmax_weight:
            d_loss = d_loss + args.argmax_weight * F.cross_entropy(d_logits, t_logits.argmax(-1))
        if args.draft_induction_mix:
            d_loss = d_loss + args.induction_weight * draft_induction(seq_end + step)
        opt_d.step(d_loss, lr_at(step, args.distill_steps, peak, max(1, args.distill_steps // 10)))
        if step % 20 == 0 or step == args.distill_steps - 1:
            print(f"distill {step:4d}/{args.distill_steps} kl {d_loss.item():.3f} "
                  f"elapsed {time.time() - t0:.0f}s", flush=True)
            log["distill"].append({"step": step, "kl": round(d_loss.item(), 4)})
        maybe_checkpoint(seq_end + step + 1)
    log["train_s"] = round(trained0 + time.time() - t0, 1)
    return log


def checkpoint_args(args) -> dict:
    """The arguments a checkpoint must agree with to be resumed (not --segment-s, --out, --threads)."""
    keep = ("seed", "steps", "distill_steps", "batch_size", "seq_len", "lr", "kl_weight", "init", "skip_batches",
            "unlikelihood", "ul_window", "seq_ul_steps", "seq_ul_prefix", "seq_ul_len", "seq_ul_exempt_prompt", "copy_frac",
            "edit_frac", "induction_steps", "induction_len", "induction_rows", "induction_mix", "induction_weight",
            "induction_code_frac", "induction_vary",
            "gen_distill", "gen_prefix", "gen_len", "argmax_weight", "draft_induction_mix", "seq_ul_edits",
            "seq_ul_line_starts", "seq_ul_line_kinds")
    return {k: getattr(args, k) for k in keep}


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


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / n-grams of a token sequence: 1.0 = no n-gram repeats; a greedy loop of period p
    drives it toward p / len."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def samples(model_dir: Path, max_new_tokens: int = 64) -> list[dict]:
    """Greedy continuations from the saved directory (HF generate, fp32 compute), each with its distinct-4gram
    ratio (the repetition check of docs/demo_model.md: over exactly max_new_tokens tokens, EOS not stopping)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=EOS_ID)
        new = gen[0, ids.shape[1] :].tolist()
        out.append({"prompt": prompt, "completion": tok.decode(new, skip_special_tokens=False),
                    "distinct_4gram": round(distinct_ngram_ratio(new), 4)})
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

    init = Path(args.init) if args.init else None
    target = build(TARGET, init / "demo" if init else None)
    draft = build(DRAFT, init / "demo-draft" if init else None)
    print(f"params: target {num_params(target):,} draft {num_params(draft):,}", flush=True)
    try:
        log = train(args, target, draft, Batches(train_w, args.batch_size, args.seed))
    except SegmentDone as e:
        print(f"segment done: {e}; run the same command again to resume", flush=True)
        return 3
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
        "train_tokens_seen": (args.steps + args.seq_ul_steps + args.distill_steps) * args.batch_size * args.seq_len
        + args.induction_steps * args.induction_rows * args.induction_len * 2,
        "init": args.init,
        "train_windows": len(train_w),
        "hyperparameters": {k: getattr(args, k) for k in ("steps", "distill_steps", "batch_size", "seq_len", "lr", "kl_weight",
                                                           "unlikelihood", "ul_window", "seq_ul_steps",
                                                           "copy_frac", "edit_frac", "induction_steps", "induction_len",
                                                           "induction_rows", "induction_mix", "induction_weight",
                                                           "induction_code_frac", "induction_vary",
                                                           "gen_distill", "gen_prefix",
                                                           "gen_len", "argmax_weight", "draft_induction_mix",
                                                           "seq_ul_edits", "seq_ul_line_starts", "seq_ul_line_kinds")},
        "heldout_eval": metrics,
        "train_log": log,
        "torch": torch.__version__,
    }
    for role, model in (("target", target), ("draft", draft)):
        summary = {"role": role, "params": num_params(model), **common}
        if role == "target":
            summary["samples"] = samples(dirs["target"])
            summary["greedy_distinct_4gram_mean"] = round(
                sum(x["distinct_4gram"] for x in summary["samples"]) / len(summary["samples"]), 4)
        summary["wall_s"] = round(time.time() - t_start, 1)
        (dirs[role] / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {dirs['target']} and {dirs['draft']} in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
