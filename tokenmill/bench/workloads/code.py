"""`code`: single requests whose prompts are windows of real Python source, continued for `output` tokens (code
completion). The source is the standard library's held-out split (every 10th file, tests excluded: the files the
shipped demo models never trained on), present on every machine that runs Python. What a speculative-decoding
benchmark needs: acceptance depends on the text, and the synthetic workloads' sampled-id prompts are no text at all
(a target that copies from its context repeats them, so draft and n-gram proposals are accepted ~90% of the time).
Needs the target's tokenizer (`--tokenizer DIR`, or `--model` a local directory): the prompts are token ids of
real text, not ids drawn from a vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.bench.session import Message, Session, Turn
from tokenmill.bench.workloads.batch import BatchParams
from tokenmill.bench.workloads.registry import Workload, length, register_workload
from tokenmill.cli import CLIError


@dataclass(frozen=True)
class CodeParams(BatchParams):  # batch's fields and checks; code completion's defaults
    prompt: int = 512
    output: int = 256
    spread: float = 0.0


@register_workload("code")
class Code(Workload):
    Params = CodeParams

    def __init__(self, params, vocab, seed: int):
        if not vocab.exact:
            raise CLIError("--workload code: needs the target's tokenizer (--tokenizer DIR, or --model a local "
                           "directory): its prompts are real source text, not ids drawn from a vocabulary")
        super().__init__(params, vocab, seed)
        self._files: list[np.ndarray] | None = None

    def files(self) -> list[np.ndarray]:
        """Token ids of each held-out stdlib file (tokenized once, on first use)."""
        if self._files is None:
            from tokenmill.model.tokenizer import stdlib_sources

            self._files = [ids for f in stdlib_sources(held_out_every=10, split="heldout")
                           if len(ids := self.vocab.encode(f.read_text(errors="replace")))]
        return self._files

    def session(self, index: int) -> Session:
        p: CodeParams = self.params
        rng = self.rng("session", index)
        n_prompt, n_out = length(rng, p.prompt, p.spread), length(rng, p.output, p.spread)
        files = self.files()
        fit = [f for f in files if len(f) >= n_prompt]
        if not fit:
            longest = max(len(f) for f in files)
            raise CLIError(f"--workload code: a {n_prompt}-token prompt is longer than every held-out source file "
                           f"(the longest is {longest} tokens)")
        f = fit[int(rng.integers(len(fit)))]
        start = int(rng.integers(0, len(f) - n_prompt + 1))
        return Session(index, p.class_name, (Turn((Message("user", f[start:start + n_prompt]),), n_out),))
