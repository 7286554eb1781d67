"""What the router reads from a request body: the prompt's chunk hashes and its size in tokens.

The router has no tokenizer. Token-id prompts are counted exactly; text prompts (and chat messages,
flattened to "<|role|>content\\n" per message) are estimated as chars / chars_per_token, where
chars_per_token is learned from the `usage.prompt_tokens` workers report (an EWMA, starting at 4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError
from tokenmill.router.prefix_index import PrefixIndexConfig, chunk_hashes
from tokenmill.router.rates import Ewma


@dataclass(frozen=True)
class PromptKey:
    hashes: tuple[bytes, ...]  # chained chunk hashes (prefix_index.chunk_hashes)
    is_tokens: bool  # chunks of token ids (else of characters)
    length: int  # token ids, or characters
    chunk: int  # units per chunk


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if _is_ids(prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "\x00".join(prompt)
    if isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        return [i for p in prompt for i in p]
    raise InvalidRequestError(
        "'prompt' must be a string, a list of token ids, or a non-empty list of either", param="prompt")


def _content_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else "" for p in content)
    raise InvalidRequestError("message 'content' must be a string or a list of parts", param="messages")


def _chat_prompt(body: dict) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        extra = json.dumps(m["tool_calls"], sort_keys=True) if m.get("tool_calls") else ""
        parts.append(f"<|{m['role']}|>{_content_text(m.get('content'))}{extra}\n")
    return "".join(parts)


def prompt_key(body: dict, chat: bool, cfg: PrefixIndexConfig) -> PromptKey:
    prompt = _chat_prompt(body) if chat else _completion_prompt(body)
    if isinstance(prompt, list):
        return PromptKey(chunk_hashes(prompt, cfg.chunk_tokens), True, len(prompt), cfg.chunk_tokens)
    return PromptKey(chunk_hashes(prompt, cfg.chunk_chars), False, len(prompt), cfg.chunk_chars)


class TokenEstimator:
    """chars -> tokens for text prompts, learned from workers' reported prompt token counts."""

    def __init__(self, chars_per_token: float = 4.0, alpha: float = 0.1):
        self._cpt = Ewma(alpha)
        self._cpt.value = chars_per_token

    @property
    def chars_per_token(self) -> float:
        return self._cpt.value or 4.0

    def prompt_tokens(self, key: PromptKey) -> int:
        return key.length if key.is_tokens else max(1, round(key.length / self.chars_per_token))

    def hit_tokens(self, key: PromptKey, chunks: int, prompt_tokens: int) -> int:
        """Tokens covered by `chunks` matched chunks; at most prompt_tokens - 1 (the last is always computed)."""
        units = chunks * key.chunk
        tokens = units if key.is_tokens else int(units / self.chars_per_token)
        return max(0, min(tokens, prompt_tokens - 1))

    def chunks_of(self, key: PromptKey, tokens: int) -> int:
        """How many whole chunks `tokens` cached tokens cover (for worker-reported cache hits)."""
        units = tokens if key.is_tokens else tokens * self.chars_per_token
        return min(len(key.hashes), int(units // key.chunk))

    def observe(self, key: PromptKey, reported_prompt_tokens: int) -> None:
        if not key.is_tokens and reported_prompt_tokens > 0 and key.length > 0:
            self._cpt.update(key.length / reported_prompt_tokens)
