"""What the router takes from one OpenAI request before deciding: the fields its policies use. One reader for
both faces that decide — the HTTP proxy (app.py) and the Endpoint Picker (epp.py) — so a body routes (and is
refused) the same way whichever way it arrives.

    fields = read_request(raw_body, headers, chat, cfg)     # InvalidRequestError -> 400 on either face

`chat`: True for /v1/chat/completions, False for /v1/completions, None for another path (the EPP sees
every path the gateway sends; e.g. /v1/models: no prompt to route by, load alone decides).
`headers`: any mapping with lower-case lookups (aiohttp's case-insensitive headers, or the EPP's dict of
lower-cased names).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError
from tokenmill.router.classes import CLASS_HEADER
from tokenmill.router.config import RouterConfig
from tokenmill.router.prompt import PromptKey, prompt_key

DEFAULT_MAX_TOKENS = 16  # what the workers assume when a request gives none (OpenAI's completions default)


@dataclass(frozen=True)
class RequestFields:
    body: dict  # the parsed JSON object (the proxy forwards it)
    class_name: str  # a known workload class
    key: PromptKey  # the prompt's chunk hashes and size
    max_tokens: int
    stream: bool


def json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def class_name(headers: Mapping[str, str], cfg: RouterConfig) -> str:
    """The class header, else the class of the bearer API key, else the default class; unknown: 400."""
    name = headers.get(CLASS_HEADER)
    if name is None:
        auth = headers.get("authorization", "")
        name = cfg.class_of_key(auth[7:].strip()) if auth.startswith("Bearer ") else None
    name = name or cfg.default_class
    known = [c.name for c in cfg.classes]
    if name not in known:
        raise InvalidRequestError(f"unknown workload class {name!r}; choose from {', '.join(known)}",
                                  param=CLASS_HEADER)
    return name


def max_tokens(body: dict) -> int:
    value = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequestError("'max_tokens' must be a non-negative integer", param="max_tokens")
    return value


def read_request(raw: bytes, headers: Mapping[str, str], chat: bool | None, cfg: RouterConfig) -> RequestFields:
    body = json_object(raw) if raw or chat is not None else {}  # no body on another path (a GET): nothing to read
    name = class_name(headers, cfg)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("'stream' must be a boolean", param="stream")
    key = prompt_key({"prompt": ""} if chat is None else body, bool(chat), cfg.prefix_index)
    return RequestFields(body, name, key, max_tokens(body), stream)
