"""The router in front of scripted fake workers (in-process aiohttp servers): proxying, retries, admission."""

import asyncio
import json
import time

import aiohttp
import pytest

from router_fakes import FakeWorker, ScriptedStream, routed, sse_events
from tokenmill.router.admission import AdmissionConfig
from tokenmill.router.classes import WorkloadClass

pytestmark = pytest.mark.timeout(60)
PREFIX = "You are a terse assistant. Answer in one word. " * 8  # 384 chars: 6 chunks of 64


def run(coro):
    return asyncio.run(coro)


async def post(session, url, body, headers=None):
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        if body.get("stream") and r.status == 200:
            return r.status, await sse_events(r), r.headers
        return r.status, await r.json(), r.headers


def test_streams_through_and_passes_class_priority_to_tokenmill_workers():
    async def main():
        fake = FakeWorker()
        async with routed([fake]) as (url, router), aiohttp.ClientSession() as s:
            status, events, _ = await post(s, url, {"prompt": "hi", "max_tokens": 5, "stream": True},
                                           {"x-tokenmill-class": "agent"})
            assert status == 200
            assert events[-1] == "[DONE]" and sum("choices" in e and bool(e["choices"]) for e in events[:-1]) == 5
            assert not any(e != "[DONE]" and "usage" in e for e in events)  # usage only when the client asks
            sent = fake.requests[-1]
            assert sent["body"]["priority"] == 1 and sent["headers"]["x-tokenmill-priority"] == "1"
            assert sent["body"]["stream_options"] == {"include_usage": True}
            status, events, _ = await post(s, url, {"prompt": "hi", "max_tokens": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}})
            assert events[-2]["usage"]["completion_tokens"] == 3
            async with s.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                  "max_tokens": 4}) as r:
                doc = await r.json()
            assert r.status == 200 and doc["usage"]["completion_tokens"] == 4
            async with s.get(url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            assert f'tokenmill_router_routed_requests_total{{worker="{fake.url}"}} 3.0' in text
            assert 'tokenmill_router_requests_total{class="agent",outcome="ok"} 1.0' in text
    run(main())


def test_openai_client_works_through_the_router():
    import openai

    async def main():
        async with routed([FakeWorker()]) as (url, router):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")
            stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=3, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == " tok" * 3
            await client.close()
    run(main())


def test_bad_requests_get_openai_errors_and_the_router_keeps_serving():
    async def main():
        async with routed([FakeWorker()]) as (url, router), aiohttp.ClientSession() as s:
            cases = [(b"{not json", {}, None), (b"[1]", {}, None), (b'{"max_tokens": 3}', {}, "prompt"),
                     (b'{"prompt": "x"}', {"x-tokenmill-class": "vip"}, "x-tokenmill-class"),
                     (b'{"prompt": "x", "stream": "yes"}', {}, "stream"),
                     (b'{"prompt": "x", "max_tokens": -1}', {}, "max_tokens")]
            for data, headers, param in cases:
                async with s.post(url + "/v1/completions", data=data, headers=headers) as r:
                    doc = await r.json()
                assert r.status == 400, data
                assert set(doc["error"]) == {"message", "type", "param", "code"} and doc["error"]["param"] == param
            async with s.get(url + "/v1/nothing") as r:
                assert r.status == 404 and "error" in await r.json()
            status, _, _ = await post(s, url, {"prompt": "still up", "max_tokens": 1})
            assert status == 200
    run(main())


def test_prefix_load_keeps_a_shared_prefix_on_one_worker_and_learns_from_reported_hits():
    async def main():
        fakes = [FakeWorker(), FakeWorker()]
        async with routed(fakes, policy="prefix-load") as (url, router), aiohttp.ClientSession() as s:
            for i in range(6):  # sequential: no load, so the cache hit decides
                status, _, _ = await post(s, url, {"prompt": PREFIX + f"question {i}", "max_tokens": 2})
                assert status == 200
            counts = sorted(len(f.requests) for f in fakes)
            assert counts == [0, 6]
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            assert "tokenmill_router_estimated_prefix_hit_tokens_total" in text
            hot = max(fakes, key=lambda f: len(f.requests))
            hits = router.metrics.prefix_hit_tokens.labels(hot.url)._value.get()
            reported = router.metrics.reported_cached_tokens.labels(hot.url)._value.get()
            assert hits > 0 and reported == pytest.approx(hits, rel=0.2)
            # the first request found no cache anywhere (a tie: "longest"), the other five followed the hit
            decisions = router.metrics.decisions
            assert decisions.labels("least-cost", "longest")._value.get() == 6
            assert decisions.labels("least-cost", "shorter")._value.get() == 0
    run(main())


def test_round_robin_spreads_and_retries_a_dead_worker_before_the_first_token():
    async def main():
        dead, live = FakeWorker(fail_before_first_token=True), FakeWorker()
        async with routed([dead, live], policy="round-robin") as (url, router), aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(post(s, url, {"prompt": f"p{i}", "max_tokens": 3, "stream": i % 2 == 0})
                                             for i in range(6)))
            assert [r[0] for r in results] == [200] * 6
            assert len(live.requests) == 6 and len(dead.requests) >= 1
            text = router.metrics.render().decode()
            assert f'tokenmill_router_retries_total{{reason="ServerDisconnectedError",worker="{dead.url}"}}' in text
    run(main())


def test_overloaded_workers_are_retried_and_all_failing_is_an_answer_not_a_hang():
    async def main():
        busy, ok = FakeWorker(status=503), FakeWorker()
        async with routed([busy, ok], policy="round-robin") as (url, router), aiohttp.ClientSession() as s:
            assert [(await post(s, url, {"prompt": f"{i}", "max_tokens": 1}))[0] for i in range(4)] == [200] * 4
        bad_request = FakeWorker(status=400)
        async with routed([bad_request, FakeWorker()], policy="round-robin") as (url, router), \
                aiohttp.ClientSession() as s:
            statuses = [(await post(s, url, {"prompt": f"{i}", "max_tokens": 1}))[0] for i in range(2)]
            assert sorted(statuses) == [200, 400]  # a worker's 4xx is the client's answer: not retried
        both = [FakeWorker(status=503), FakeWorker(status=503)]
        async with routed(both) as (url, router), aiohttp.ClientSession() as s:
            status, doc, headers = await post(s, url, {"prompt": "x", "max_tokens": 1})
            assert status == 503 and headers["Retry-After"] == "3" and "error" in doc
            assert sum(len(f.requests) for f in both) == 2
    run(main())


def test_a_stream_cut_after_its_first_token_ends_with_an_error_event():
    async def main():
        async with routed([FakeWorker(cut_after_tokens=2)]) as (url, router), aiohttp.ClientSession() as s:
            status, events, _ = await post(s, url, {"prompt": "x", "max_tokens": 8, "stream": True})
            assert status == 200
            assert events[-1]["error"]["code"] == "worker_failed" and "[DONE]" not in events
            text = router.metrics.render().decode()
            assert 'tokenmill_router_requests_total{class="interactive",outcome="failed"} 1.0' in text
            w = next(iter(router.pool))
            assert (w.outstanding, w.prefill_tokens, w.decode_streams) == (0, 0, 0)
    run(main())


def test_workers_added_and_removed_at_runtime_and_unhealthy_ones_skipped():
    async def main():
        a, b = FakeWorker(), FakeWorker()
        from router_fakes import serving
        async with routed([a], policy="round-robin") as (url, router), serving(b.app()) as b_url, \
                aiohttp.ClientSession() as s:
            async with s.post(url + "/admin/workers", json={"url": b_url}) as r:
                assert r.status == 201 and (await r.json())["healthy"]
            for i in range(4):
                await post(s, url, {"prompt": f"{i}", "max_tokens": 1})
            assert len(a.requests) == 2 and len(b.requests) == 2
            async with s.delete(url + "/admin/workers", json={"url": a.url}) as r:
                assert r.status == 200
            async with s.delete(url + "/admin/workers", json={"url": "http://nope:1"}) as r:
                assert r.status == 404
            async with s.post(url + "/admin/workers", json={"url": "ftp://x"}) as r:
                assert r.status == 400
            b.unhealthy = True
            await asyncio.sleep(0.6)  # > unhealthy_after x health_interval_s
            status, doc, headers = await post(s, url, {"prompt": "x", "max_tokens": 1})
            assert status == 503 and doc["error"]["code"] == "no-worker" and "Retry-After" in headers
            async with s.get(url + "/health") as r:
                assert r.status == 503
            b.unhealthy = False
            await asyncio.sleep(0.4)
            assert (await post(s, url, {"prompt": "x", "max_tokens": 1}))[0] == 200
            assert len(a.requests) == 2
    run(main())


def test_leading_admission_refuses_fast_and_accepted_requests_keep_their_slo():
    interactive = WorkloadClass("interactive", ttft_slo_s=0.5, tpot_slo_s=0.05, priority=0, max_wait_s=0.2)

    async def main():
        # 250 tokens/s prefill: each 1200-char (300-token) prompt costs 1.2 s if it were alone... too slow, so
        # use 100-token prompts (0.4 s each): at most ~one at a time fits a 0.5 s TTFT SLO per worker.
        fakes = [FakeWorker(prefill_tps=250.0), FakeWorker(prefill_tps=250.0)]
        async with routed(fakes, classes=(interactive,),
                          rate_priors=__import__("tokenmill.router.rates", fromlist=["RatePriors"]).RatePriors(
                              ttft_base_s=0.0, prefill_rate_tps=250.0)) as (url, router), \
                aiohttp.ClientSession() as s:
            async def one(i):
                t0 = time.monotonic()
                body = {"prompt": f"{i:03d}" + "x" * 397, "max_tokens": 2, "stream": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        return r.status, time.monotonic() - t0, r.headers.get("Retry-After")
                    async for line in r.content:
                        if line.startswith(b"data:"):
                            return 200, time.monotonic() - t0, None

            results = await asyncio.gather(*(one(i) for i in range(12)))
            ok = [t for st, t, _ in results if st == 200]
            refused = [(t, ra) for st, t, ra in results if st == 429]
            assert len(ok) + len(refused) == 12 and 2 <= len(ok) <= 4, results  # ~one 0.4 s prefill per worker
            assert max(ok) <= 0.5 + 0.4  # accepted requests keep the TTFT SLO (+ slack for a loaded machine)
            # refused after at most max_wait (0.2 s) held, before the SLO would have run out: a refusal that
            # arrives after the deadline saves the client nothing (the event loop's lag on a loaded machine
            # is the slack between the two)
            assert max(t for t, _ in refused) < interactive.ttft_slo_s and all(int(ra) >= 1 for _, ra in refused)
            text = router.metrics.render().decode()
            assert 'tokenmill_router_rejections_total{class="interactive",reason=' in text
    run(main())


def test_off_admission_accepts_everything_and_misses_the_slo():
    interactive = WorkloadClass("interactive", ttft_slo_s=0.5, tpot_slo_s=0.05, priority=0)

    async def main():
        fakes = [FakeWorker(prefill_tps=250.0)]
        async with routed(fakes, classes=(interactive,), admission=AdmissionConfig(mode="off")) as (url, router), \
                aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            results = await asyncio.gather(*(post(s, url, {"prompt": f"{i:03d}" + "x" * 397, "max_tokens": 1})
                                             for i in range(4)))
            assert [r[0] for r in results] == [200] * 4
            assert time.monotonic() - t0 > 1.5  # 4 x 0.4 s of prefill queued on one worker
    run(main())


def test_api_keys_pick_the_class_and_batch_waits_for_idle_capacity():
    from tokenmill.router.rates import RatePriors

    async def main():
        fake = FakeWorker(prefill_tps=500.0)
        async with routed([fake], api_keys=(("sk-batch", "batch"),),
                          rate_priors=RatePriors(ttft_base_s=0.0, prefill_rate_tps=500.0),
                          admission=AdmissionConfig(warmup_samples=0)) as (url, router), \
                aiohttp.ClientSession() as s:
            batch = {"Authorization": "Bearer sk-batch"}
            # an interactive request keeps the worker busy for ~0.6 s of prefill (300 tokens at 500 tok/s)
            busy = asyncio.create_task(post(s, url, {"prompt": "i" * 1200, "max_tokens": 1}))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            status, _, _ = await post(s, url, {"prompt": "b" * 400, "max_tokens": 1}, batch)
            assert status == 200 and (await busy)[0] == 200
            # batch only takes a worker predicted under 0.5 x interactive's 1 s TTFT SLO: the router held it
            held_s = router.metrics.queue_wait.labels("batch")._sum.get()
            assert 0.3 <= held_s <= time.monotonic() - t0, held_s
            sent = {r["headers"].get("x-tokenmill-priority") for r in fake.requests}
            assert sent == {"0", "2"} and fake.requests[-1]["body"]["priority"] == 2
            text = router.metrics.render().decode()
            assert 'tokenmill_router_queue_wait_seconds_count{class="batch"} 1.0' in text
    run(main())


def _ev(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


TOK = {"object": "text_completion", "choices": [{"index": 0, "text": " a", "finish_reason": None}], "usage": None}
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}


def _routed_bytes(script, body, **overrides):
    """What a client receives through the router from a worker that writes `script`; and the router."""
    async def main():
        worker = ScriptedStream(script)
        async with routed([worker], **overrides) as (url, router), aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True, **body}) as r:
                assert r.status == 200
                data = await r.read()
            await asyncio.sleep(0.05)
            w = next(iter(router.pool))
            assert (w.outstanding, w.prefill_tokens, w.decode_streams, w.decode_tokens) == (0, 0, 0, 0)
            return data, router.metrics.render().decode()
    return run(main())


def test_pass_through_after_the_first_token_gives_the_client_the_same_bytes_as_parsing_every_event():
    # tokenmill puts "usage":null in every chunk when usage is asked for (the router always asks);
    # events coalesced in one write, one split over two, SSE comments and \r\n, the last line without "\n"
    first = _ev({**TOK, "choices": [{"index": 0, "text": " a", "finish_reason": None}]})
    toks = [_ev({**TOK, "choices": [{"index": 0, "text": f" t{i} \"usage\"", "finish_reason": None}]})
            for i in range(4)]
    usage_chunk = _ev({"object": "text_completion", "choices": [], "usage": USAGE})
    script = [(0.0, b": keep-alive\n\n" + first), (0.02, toks[0] + toks[1]), (0.02, toks[2][:20]),
              (0.02, toks[2][20:] + toks[3].replace(b"\n\n", b"\r\n\r\n")), (0.02, usage_chunk),
              (0.02, b"event: x\ndata: [DONE]")]
    want = first + b"".join(toks)
    got, metrics = _routed_bytes(script, {"max_tokens": 5})
    assert got == want + b"data: [DONE]\n\n"
    assert 'tokenmill_router_requests_total{class="interactive",outcome="ok"} 1.0' in metrics
    got, _ = _routed_bytes(script, {"max_tokens": 5, "stream_options": {"include_usage": True}})
    assert got == want + usage_chunk + b"data: [DONE]\n\n"


def test_pass_through_strips_usage_from_a_chunk_with_choices_when_the_client_did_not_ask():
    last = {"object": "text_completion", "choices": [{"index": 0, "text": " b", "finish_reason": "length"}],
            "usage": USAGE}
    script = [(0.0, _ev(TOK)), (0.02, _ev(last) + b"data: [DONE]\n\n")]
    got, metrics = _routed_bytes(script, {"max_tokens": 2})
    stripped = {k: v for k, v in last.items() if k != "usage"}
    assert got == _ev(TOK) + b"data: " + json.dumps(stripped).encode() + b"\n\n" + b"data: [DONE]\n\n"
    assert 'tokenmill_router_requests_total{class="interactive",outcome="ok"} 1.0' in metrics


def test_an_error_event_or_a_stall_after_the_first_token_ends_the_stream_failed():
    err = b'data: {"error": {"message": "engine error", "type": "internal_server_error"}}\n\n'
    got, metrics = _routed_bytes([(0.0, _ev(TOK)), (0.02, _ev(TOK) + err + _ev(TOK))], {"max_tokens": 8})
    assert got == _ev(TOK) * 2 + err
    assert 'tokenmill_router_requests_total{class="interactive",outcome="failed"} 1.0' in metrics
    got, metrics = _routed_bytes([(0.0, _ev(TOK)), (0.6, _ev(TOK))], {"max_tokens": 8}, read_timeout_s=0.2)
    assert got.startswith(_ev(TOK)) and b"[DONE]" not in got and b"TimeoutError" in got
    assert 'tokenmill_router_requests_total{class="interactive",outcome="failed"} 1.0' in metrics


def test_must_parse_only_events_with_an_error_or_a_usage():
    from tokenmill.router.proxy import _must_parse

    assert not _must_parse(b'{"choices":[{"text":"x"}]}')
    assert not _must_parse(b'{"choices":[{"text":"say \\"usage\\""}],"usage":null}')
    assert not _must_parse(b'{"choices":[],"usage" : null}')
    assert _must_parse(b'{"choices":[],"usage":{"completion_tokens":3}}')
    assert _must_parse(b'{"error":{"message":"x"}}')
    assert _must_parse(b'{"choices":[{"logprobs":{"top_logprobs":[{"usage":-0.1}]}}],"usage":null}')


def test_prefill_queued_by_other_clients_counts_as_load_from_the_workers_own_gauge():
    async def main():
        busy, free = FakeWorker(queued_prefill=1_000_000), FakeWorker()  # ~2 min of prefill at the prior rate
        async with routed([busy, free], policy="prefix-load") as (url, router), aiohttp.ClientSession() as s:
            await asyncio.sleep(0.5)  # a health check scraped both
            assert router.pool.get(busy.url).view().external_prefill_tokens == 1_000_000
            assert router.pool.get(free.url).view().external_prefill_tokens == 0
            for i in range(3):  # the router sent nothing to `busy`, yet it is not idle: all go to `free`
                status, _, _ = await post(s, url, {"prompt": f"q{i}", "max_tokens": 2})
                assert status == 200
            assert len(busy.requests) == 0 and len(free.requests) == 3
            free.queued_prefill = 1_000_000  # now every worker has a queue no interactive SLO survives
            await asyncio.sleep(0.5)
            status, doc, headers = await post(s, url, {"prompt": "late", "max_tokens": 2})
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert router.metrics.rejections.labels("interactive", "slo")._value.get() == 1
            busy.queued_prefill = free.queued_prefill = 0  # drained: served again
            await asyncio.sleep(0.5)
            status, _, _ = await post(s, url, {"prompt": "again", "max_tokens": 2})
            assert status == 200
            assert "tokenmill_router_worker_external_prefill_tokens" in router.metrics.render().decode()
    run(main())
