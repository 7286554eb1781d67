"""The OpenAI API through the official `openai` client, over the fake engine."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def test_completion(fake_server):
    r = client(fake_server).completions.create(model="fake", prompt="hello world", max_tokens=5)
    assert r.object == "text_completion" and r.model == "fake"
    assert r.choices[0].text == " alpha beta g"  # 5 tokens of the fake's word cycle
    assert r.choices[0].finish_reason == "length"
    u = r.usage
    n = len(fake_server.engine.tokenizer.encode("hello world"))
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n, 5, n + 5)
    assert u.prompt_tokens_details.cached_tokens == 0


def test_completion_token_ids_prompt_and_stop(fake_server):
    c = client(fake_server)
    r = c.completions.create(model="fake", prompt=[1, 2, 3, 4, 5], max_tokens=20, stop=[" gamma"])
    assert r.choices[0].text == " alpha beta"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 5


def test_completion_stream_with_usage(fake_server):
    chunks = list(client(fake_server).completions.create(
        model="fake", prompt="hello", max_tokens=4, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == " alpha beta"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "stop": ["never"], "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "héllo ✓"}], "max_tokens": 3,
                              "stream_options": {"include_usage": True}, "logprobs": True}),
])
def test_raw_sse_events_are_json_and_end_with_done(fake_server, path, body):
    import urllib.request

    req = urllib.request.Request(fake_server.url + path, method="POST", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    assert with_choices[-1]["choices"][0]["stop_reason"] is None
    assert all(c["choices"][0]["logprobs"] for c in with_choices[1 if "chat" in path else 0:])
    if "stream_options" in body:
        assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat(fake_server):
    r = client(fake_server).chat.completions.create(
        model="fake", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=3, logprobs=True, top_logprobs=2)
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.message.role == "assistant"
    assert ch.message.content == " alpha be"
    assert len(ch.logprobs.content) == 3 and len(ch.logprobs.content[0].top_logprobs) == 2
    # the prompt is the model's chat template (ChatML here) rendered and tokenized
    tok = fake_server.engine.tokenizer
    expected = tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    assert r.usage.prompt_tokens == len(expected)


def test_chat_stream(fake_server):
    chunks = list(client(fake_server).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " alpha be"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs(fake_server):
    r = client(fake_server).completions.create(model="fake", prompt="a", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [0, 3, 6]


def test_models_health(fake_server):
    models = client(fake_server).models.list()
    assert [m.id for m in models.data] == ["fake"]
    assert fake_server.get("/health")[0] == 200
    assert fake_server.get("/v1/models/fake")[0] == 200
    assert fake_server.get("/v1/models/nope")[0] == 404


def test_served_model_names_and_priority_header(make_server):
    s = make_server(served_model_names=["alias", "other"])
    r = client(s).completions.create(model="other", prompt="x", max_tokens=1,
                                     extra_headers={"x-tokenmill-priority": "-5"})
    assert r.model == "alias"


def test_priority_orders_waiting_requests(make_server):
    from .fake_engine import FakeEngine

    eng = FakeEngine(max_running=1, step_s=0.01)
    s = make_server(eng)

    async def main():
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        first = asyncio.create_task(c.completions.create(model="fake", prompt="x", max_tokens=40))
        await asyncio.sleep(0.05)  # the first one runs (~0.4 s); the next two wait
        low = asyncio.create_task(c.completions.create(model="fake", prompt="low", max_tokens=1, extra_body={"priority": 5}))
        await asyncio.sleep(0.02)
        high = asyncio.create_task(c.completions.create(model="fake", prompt="high", max_tokens=1,
                                                        extra_headers={"x-tokenmill-priority": "-5"}))
        results = await asyncio.gather(first, low, high)
        await c.close()
        return [r.id for r in results]

    first, low, high = asyncio.run(main())
    # both late requests waited behind the first; the high-priority one (by header) was admitted first
    assert eng.admitted == [first, high, low]


def test_32_concurrent_streams(make_server):
    from .fake_engine import FakeEngine

    s = make_server(FakeEngine(step_s=0.005))

    async def one(c, i):
        stream = await c.completions.create(model="fake", prompt=f"request {i}", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
        text, usage = "", None
        async for ch in stream:
            text += "".join(x.text for x in ch.choices)
            usage = ch.usage or usage
        return text, usage

    async def main():
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(c, i) for i in range(32)))
        await c.close()
        return results, time.perf_counter() - t0

    results, elapsed = asyncio.run(main())
    assert len(results) == 32
    assert all(u.completion_tokens == 12 for _, u in results)
    assert len({t for t, _ in results}) == 1
    assert elapsed < 12 * 0.005 * 32  # batched, not one after the other


def test_event_loop_not_blocked_by_compute(make_server):
    from .fake_engine import FakeEngine

    s = make_server(FakeEngine(step_s=0.8))

    async def main():
        c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        gen = asyncio.create_task(c.completions.create(model="fake", prompt="x", max_tokens=3))
        await asyncio.sleep(0.1)  # the engine thread is inside a 0.8 s step now
        t0 = time.perf_counter()
        await asyncio.to_thread(s.get, "/health")
        health_s = time.perf_counter() - t0
        await gen
        await c.close()
        return health_s

    assert asyncio.run(main()) < 0.4  # answered long before the step ends


def test_state_endpoint(fake_server):
    fake_server.post("/v1/completions", {"prompt": "x", "max_tokens": 3})
    st = fake_server.state()
    assert st["model"] == "fake" and st["max_model_len"] == 256 and st["kv_capacity_tokens"] == 2048
    assert st["num_pending"] == 0 and st["num_in_flight"] == 0 and st["engine_errors"] == 0
    assert st["engine_step_seconds"] > 0
    s = st["stats"]
    assert s["generation_tokens_total"] == 3 and s["kv_blocks_total"] == 512 and 0 <= s["kv_usage"] <= 1


def test_stream_interval_groups_tokens(make_server):
    s = make_server(stream_interval=4)
    c = client(s)
    chunks = [ch for ch in c.completions.create(model="fake", prompt="x", max_tokens=10, stream=True)]
    texts = [ch.choices[0].text for ch in chunks]
    assert "".join(texts) == c.completions.create(model="fake", prompt="x", max_tokens=10).choices[0].text
    assert len(chunks) == 4  # token 1 at once (TTFT), 2-5, 6-9, 10 with the finish
    assert chunks[-1].choices[0].finish_reason == "length"
