"""GET /openapi.json: an OpenAPI 3.0 description of what `tokenmill serve` serves.

Written by hand from server/protocol.py (the parser is the authority: what it refuses is a 400, and the
schemas below say what it accepts, so that a fuzzer generating from them exercises both sides). The test
suite fuzzes a live server from this document with schemathesis (tests/server/test_openapi_fuzz.py).
"""

from __future__ import annotations

from tokenmill.router.classes import CLASS_HEADER

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}},
}

_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}], "nullable": True}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

_COMMON = {
    "model": {"type": "string", "nullable": True, "description": "a served model name (GET /v1/models)"},
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "nullable": True},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
    "top_k": {"type": "integer", "minimum": -1, "nullable": True, "description": "0 or -1: off"},
    "min_tokens": {"type": "integer", "minimum": 0, "nullable": True},
    "seed": {"type": "integer", "nullable": True},
    "stop": _STOP,
    "stop_token_ids": {**_TOKEN_IDS, "nullable": True},
    "ignore_eos": {"type": "boolean", "nullable": True},
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {"type": "object", "nullable": True,
                       "properties": {"include_usage": {"type": "boolean", "nullable": True}},
                       "description": "only with stream: true"},
    "n": {"type": "integer", "enum": [1], "nullable": True},
    "presence_penalty": {"type": "number", "enum": [0], "nullable": True},
    "frequency_penalty": {"type": "number", "enum": [0], "nullable": True},
    "priority": {"type": "integer", "nullable": True, "description": "lower is served first"},
    "workload_class": {"type": "string", "nullable": True, "description": "admission class (the header wins)"},
    "user": {"type": "string", "nullable": True},
}

_COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"],
    "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {**_TOKEN_IDS, "minItems": 1},
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": {**_TOKEN_IDS, "minItems": 1}}]},
        "logprobs": {"type": "integer", "minimum": 0, "nullable": True},
        "best_of": {"type": "integer", "enum": [1], "nullable": True},
        "echo": {"type": "boolean", "enum": [False], "nullable": True},
        **_COMMON,
    },
}

_CHAT_REQUEST = {
    "type": "object", "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
                           "content": {"type": "string"}}}},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": {"type": "integer", "minimum": 0, "nullable": True, "description": "with logprobs: true"},
        **_COMMON,
    },
}

_CHOICE_COMPLETION = {"type": "object", "properties": {
    "index": {"type": "integer"}, "text": {"type": "string"},
    "finish_reason": {"type": "string", "nullable": True}}}
_CHOICE_CHAT = {"type": "object", "properties": {
    "index": {"type": "integer"},
    "message": {"type": "object", "properties": {"role": {"type": "string"}, "content": {"type": "string"}}},
    "finish_reason": {"type": "string", "nullable": True}}}
_USAGE = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                            "completion_tokens": {"type": "integer"},
                                            "total_tokens": {"type": "integer"}}}


def _generation(summary: str, request: dict, choice: dict, obj: str) -> dict:
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"post": {
        "summary": summary,
        "parameters": [
            {"name": CLASS_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
             "description": "the admission (workload) class"},
            {"name": "x-tokenmill-priority", "in": "header", "required": False, "schema": {"type": "integer"}},
        ],
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {"description": f"a {obj} (JSON), or server-sent events when stream is true",
                    "content": {"application/json": {"schema": {"type": "object", "properties": {
                        "id": {"type": "string"}, "object": {"type": "string", "enum": [obj]},
                        "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                        "usage": _USAGE}}},
                        "text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "invalid request", **err},
            "401": {"description": "a valid API key is required", **err},
            "404": {"description": "unknown model", **err},
            "413": {"description": "request body too large", **err},
            "429": {"description": "refused by admission control or overloaded (Retry-After)", **err},
            "503": {"description": "draining, overloaded, or the engine core is gone (Retry-After)", **err},
        },
    }}


def openapi_spec(model_names: list[str], api_key: bool = False) -> dict:
    model_card = {"type": "object", "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                                    "owned_by": {"type": "string"},
                                                    "max_model_len": {"type": "integer"}}}
    json_ok = lambda desc, schema: {"description": desc, "content": {"application/json": {"schema": schema}}}  # noqa: E731
    spec = {
        "openapi": "3.0.3",
        "info": {"title": "tokenmill serve", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat over one model: " + ", ".join(model_names)},
        "paths": {
            "/v1/completions": _generation("Create a completion", _COMPLETION_REQUEST, _CHOICE_COMPLETION,
                                           "text_completion"),
            "/v1/chat/completions": _generation("Create a chat completion", _CHAT_REQUEST, _CHOICE_CHAT,
                                                "chat.completion"),
            "/v1/models": {"get": {"summary": "List the served model names", "responses": {
                "200": json_ok("the models", {"type": "object", "properties": {
                    "object": {"type": "string"}, "data": {"type": "array", "items": model_card}}}),
                "401": {"description": "a valid API key is required"}}}},
            "/v1/models/{model}": {"get": {
                "summary": "One served model",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": json_ok("the model", model_card),
                              "401": {"description": "a valid API key is required"},
                              "404": {"description": "unknown model"}}}},
            "/health": {"get": {"summary": "Readiness: 200 while taking work", "responses": {
                "200": json_ok("ready", {"type": "object", "properties": {"status": {"type": "string"}}}),
                "503": json_ok("draining, or the engine core is gone",
                               {"type": "object", "properties": {"status": {"type": "string"}}})}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/tokenmill/state": {"get": {"summary": "Engine stats and what the server holds", "responses": {
                "200": json_ok("the state", {"type": "object"})}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {
                "200": json_ok("OpenAPI 3.0", {"type": "object"})}}},
        },
        "components": {"schemas": {"Error": _ERROR}},
    }
    if api_key:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in spec["paths"].items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return spec
