"""Bad input -> 4xx with an OpenAI-style body; engine failures -> 500; overload -> 429; API keys -> 401."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from .fake_engine import ERROR_SEED, FakeEngine

MSG = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"

# (name, path, body (dict, or bytes sent raw), expected status, expected error param)
BAD = [
    ("invalid json", C, b"{not json", 400, None),
    ("body not an object", C, b"[1, 2]", 400, None),
    ("missing prompt", C, {"model": "fake"}, 400, "prompt"),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt"),
    ("prompt wrong type", C, {"prompt": 5}, 400, "prompt"),
    ("prompt mixed ids", C, {"prompt": [1, "a"]}, 400, "prompt"),
    ("batched prompts", C, {"prompt": ["a", "b"]}, 400, "prompt"),
    ("token id out of range", C, {"prompt": [10**9]}, 400, "prompt"),
    ("unknown model", C, {"model": "nope", "prompt": "x"}, 404, "model"),
    ("model wrong type", C, {"model": 3, "prompt": "x"}, 400, "model"),
    ("max_tokens 0", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", C, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens string", C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens float", C, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens bool", C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("over max_model_len", C, {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ("prompt over max_model_len", C, {"prompt": [1] * 300, "max_tokens": 1}, 400, "prompt"),
    ("temperature negative", C, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("temperature string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k string", C, {"prompt": "x", "top_k": "3"}, 400, "top_k"),
    ("seed float", C, {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("stop wrong type", C, {"prompt": "x", "stop": 7}, 400, "stop"),
    ("stop empty string", C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("n > 1", C, {"prompt": "x", "n": 2}, 400, "n"),
    ("logprobs too many", C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("stream not bool", C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("stream_options without stream", C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("ignore_eos not bool", C, {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
    ("priority string", C, {"prompt": "x", "priority": "high"}, 400, "priority"),
    ("user not string", C, {"prompt": "x", "user": 5}, 400, "user"),
    ("frequency_penalty", C, {"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("message not an object", CHAT, {"messages": ["hi"]}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("missing role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat n > 1", CHAT, {"messages": MSG, "n": 3}, 400, "n"),
    ("chat max_completion_tokens 0", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens"),
    ("chat temperature negative", CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("chat top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("unknown route", "/v1/nope", {"prompt": "x"}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(fake_server, name, path, body, status, param):
    raw = body if isinstance(body, bytes) else None
    got, _, resp = fake_server.post(path, None if raw else body, raw=raw)
    assert got == status, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert fake_server.get("/health")[0] == 200
    ok, _, r = fake_server.post(C, {"prompt": "still serving", "max_tokens": 2})
    assert ok == 200 and r["usage"]["completion_tokens"] == 2


def test_wrong_method(fake_server):
    status, _, resp = fake_server.get("/v1/completions")
    assert status == 405 and resp["error"]["type"] == "invalid_request_error"


def test_step_failure_fails_requests_in_flight_then_serves(make_server):
    eng = FakeEngine()
    s = make_server(eng)
    eng.fail_next_step = True
    status, _, resp = s.post(C, {"prompt": "x", "max_tokens": 3})
    assert status == 500 and resp["error"]["code"] == "engine_error"
    assert "injected step failure" in resp["error"]["message"]
    assert s.get("/health")[0] == 200
    assert s.post(C, {"prompt": "x", "max_tokens": 3})[0] == 200
    assert s.state()["engine_errors"] == 1


def test_step_failure_in_stream_sends_error_event(make_server):
    eng = FakeEngine(step_s=0.02)
    s = make_server(eng)

    async def main():
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url + C, json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
                assert r.status == 200
                events = []
                async for line in r.content:
                    line = line.decode().strip()
                    if line:
                        events.append(line)
                        if len(events) == 2:
                            eng.fail_next_step = True
                return events

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])
    assert err["error"]["code"] == "engine_error"
    assert s.post(C, {"prompt": "x", "max_tokens": 1})[0] == 200


def test_request_error_is_500(fake_server):
    status, _, resp = fake_server.post(C, {"prompt": "x", "max_tokens": 3, "seed": ERROR_SEED})
    assert status == 500 and "injected request error" in resp["error"]["message"]
    assert fake_server.post(C, {"prompt": "x", "max_tokens": 1})[0] == 200


def test_overload_gives_429_with_retry_after(make_server):
    eng = FakeEngine(max_running=2, max_waiting=3, step_s=0.01)
    s = make_server(eng)

    async def main():
        async with aiohttp.ClientSession() as http:
            async def one():
                async with http.post(s.url + C, json={"prompt": "x", "max_tokens": 20}) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            return await asyncio.gather(*(one() for _ in range(20)))

    results = asyncio.run(main())
    codes = [r[0] for r in results]
    assert codes.count(200) >= 3 and codes.count(429) >= 1 and set(codes) <= {200, 429}
    for status, retry, body in results:
        if status == 429:
            assert retry == "1" and body["error"]["code"] == "engine_overloaded"
    assert s.get("/health")[0] == 200
    assert s.post(C, {"prompt": "x", "max_tokens": 1})[0] == 200


def test_bounded_pending_queue(make_server):
    """Adds waiting for the engine thread are bounded too (a long step must not queue without bound)."""
    eng = FakeEngine(step_s=1.0)
    s = make_server(eng, max_pending=2)

    async def main():
        async with aiohttp.ClientSession() as http:
            async def one(after_first):
                if after_first:  # the first request applied by the engine (its 1-s step running), however slow the
                    for _ in range(1000):  # machine: then 2 of these 6 wait as pending adds, the rest are refused
                        if eng.added:
                            break
                        await asyncio.sleep(0.005)
                async with http.post(s.url + C, json={"prompt": "x", "max_tokens": 1}) as r:
                    return r.status

            return await asyncio.gather(one(False), *(one(True) for _ in range(6)))

    codes = asyncio.run(main())
    assert codes.count(429) >= 1 and codes.count(200) >= 3, codes


def test_api_key(make_server):
    s = make_server(api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        status, hdrs, resp = s.post(C, {"prompt": "x", "max_tokens": 1}, headers=headers)
        assert status == 401 and resp["error"]["code"] == "invalid_api_key"
        assert s.get("/v1/models", headers=headers)[0] == 401
    ok = s.post(C, {"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer sekret"})
    assert ok[0] == 200
    assert s.get("/health")[0] == 200 and s.get("/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
    assert good.completions.create(model="fake", prompt="x", max_tokens=1).usage.completion_tokens == 1
