"""OpenAI request bodies -> typed requests, and errors -> OpenAI-style error bodies.

Parsing checks types and the parameters the engine cannot serve (n > 1, batched prompts, ...); the
ranges of sampling parameters are checked once, by `SamplingParams`. Every failure is an `APIError`
whose body is `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequestError


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_invalid(e: InvalidRequestError) -> APIError:
    return bad_request(str(e), param=e.param)


# -- field readers ------------------------------------------------------------------------------
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def _is(v: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return isinstance(v, kind)


def _get(body: dict, name: str, kind: type, default: Any = None) -> Any:
    """body[name] if present and not null, checked to be of `kind`; else default."""
    v = body.get(name)
    if v is None:
        return default
    if not _is(v, kind):
        raise bad_request(f"{name} must be {_KIND_NAMES[kind]}, got {_json_type(v)} {v!r:.40}", param=name)
    return v


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is(x, int) for x in v)


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad_request("stop must be a string or an array of strings", param="stop")


def _unsupported(body: dict) -> None:
    """Reject parameters whose non-default values the engine cannot honour (silently ignoring them lies)."""
    if (n := _get(body, "n", int, 1)) != 1:
        raise bad_request(f"n must be 1 (got {n}): one choice per request is supported", param="n")
    if (best_of := _get(body, "best_of", int, 1)) != 1:
        raise bad_request(f"best_of must be 1 (got {best_of})", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, float, 0.0) != 0:
            raise bad_request(f"{name} is not supported (only 0)", param=name)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if body.get("tools"):
        raise bad_request("tools are not supported", param="tools")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("response_format: only {\"type\": \"text\"} is supported", param="response_format")


# -- requests -----------------------------------------------------------------------------------
@dataclass
class GenerateRequest:
    """What both endpoints share after parsing. `prompt` is text or token ids (completions) and None for
    chat (its `messages` are rendered with the model's template by the handler)."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None  # None: the default of the endpoint (completions 16, chat: fill the context)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: sampled token + top-k alternatives
    stream: bool = False
    include_usage: bool = False
    priority: int | None = None  # lower is served first; None: the x-tokenmill-priority header, else the class's
    workload_class: str | None = None  # the admission class (the x-tokenmill-class header wins)
    user: str | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                seed=self.seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                ignore_eos=self.ignore_eos, logprobs=self.logprobs, min_tokens=self.min_tokens,
            )
        except InvalidRequestError as e:
            raise from_invalid(e) from None


def _common(body: Any, kind: str) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    _unsupported(body)
    stream = _get(body, "stream", bool, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    if opts and not stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    include_usage = _get(opts or {}, "include_usage", bool, False)
    stop_token_ids = body.get("stop_token_ids") or []
    if not _int_list(stop_token_ids):
        raise bad_request("stop_token_ids must be an array of integers", param="stop_token_ids")
    top_k = _get(body, "top_k", int, 0)
    return dict(
        kind=kind,
        model=_get(body, "model", str),
        temperature=_get(body, "temperature", float, 1.0),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=0 if top_k == -1 else top_k,
        min_tokens=_get(body, "min_tokens", int, 0),
        seed=_get(body, "seed", int),
        stop=_stop(body),
        stop_token_ids=stop_token_ids,
        ignore_eos=_get(body, "ignore_eos", bool, False),
        stream=stream,
        include_usage=include_usage,
        priority=_get(body, "priority", int),
        workload_class=_get(body, "workload_class", str),
        user=_get(body, "user", str),
    )


def parse_completion(body: Any) -> GenerateRequest:
    """POST /v1/completions: `prompt` is a string, token ids, or a one-element array of either."""
    fields_ = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str) or isinstance(prompt[0], list)):
        if len(prompt) != 1:
            raise bad_request(f"batched prompts are not supported (got {len(prompt)}); send one request per prompt",
                              param="prompt")
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("prompt is required", param="prompt")
    if not (isinstance(prompt, str) or _int_list(prompt)):
        raise bad_request("prompt must be a string or an array of token ids", param="prompt")
    if len(prompt) == 0:
        raise bad_request("prompt must not be empty", param="prompt")
    if _get(body, "echo", bool, False):
        raise bad_request("echo is not supported", param="echo")
    if _get(body, "suffix", str):
        raise bad_request("suffix is not supported", param="suffix")
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):  # a chat-style flag sent to completions: mean "the sampled token only"
        logprobs = 0 if logprobs else None
    elif logprobs is not None and not _is(logprobs, int):
        raise bad_request(f"logprobs must be an integer, got {_json_type(logprobs)}", param="logprobs")
    return GenerateRequest(prompt=prompt, max_tokens=_get(body, "max_tokens", int), logprobs=logprobs, **fields_)


def parse_chat(body: Any) -> GenerateRequest:
    """POST /v1/chat/completions: roles and contents are checked by the tokenizer's chat template."""
    fields_ = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", param="messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("every message must be an object with role and content", param="messages")
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    logprobs = None
    if _get(body, "logprobs", bool, False):
        logprobs = _get(body, "top_logprobs", int, 0)
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    return GenerateRequest(messages=[dict(m) for m in messages], max_tokens=max_tokens, logprobs=logprobs, **fields_)


def parse_priority_header(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"x-tokenmill-priority must be an integer, got {value!r:.40}", param="priority") from None
