"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import TokenLogprob
from tokenmill.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True


class LLM:
    def __init__(self, model: str = "demo", *, config: EngineConfig | None = None, **engine_kwargs):
        self.engine = LLMEngine(config or EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None) -> list[GenerationResult]:
        """prompts: a string, a list of strings, or a list of token-id lists. Results keep the input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, params[i], priority=priority[i] if priority else 0)
            results[rid] = GenerationResult(rid, p if isinstance(p, str) else None, ids,
                                            [CompletionOutput(0, "", [], None)])
            order.append(rid)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                r = results[out.request_id]
                c = r.outputs[0]
                c.token_ids = list(out.output_token_ids)
                c.text = out.text
                r.num_cached_tokens = out.num_cached_tokens
                if out.new_logprobs:
                    c.logprobs = (c.logprobs or []) + out.new_logprobs
                if out.finished:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        if self.engine.tiers is not None:  # offline: return once this batch's KV is stored in the tiers too
            self.engine.tiers.flush()
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> GenerationResult:
        return self.generate(self.tokenizer.apply_chat_template(messages), sampling_params)[0]
