"""A client that goes away aborts its request and frees its KV blocks at once."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from .fake_engine import FakeEngine


def wait_until(cond, timeout=5.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_stream_disconnect_frees_blocks(make_server):
    eng = FakeEngine(step_s=0.01)
    s = make_server(eng)

    async def main():
        async with aiohttp.ClientSession() as http:
            r = await http.post(s.url + "/v1/completions", json={"prompt": "x" * 50, "max_tokens": 200, "stream": True})
            n = 0
            async for line in r.content:
                n += line.startswith(b"data: ")
                if n == 3:
                    break
            used = s.state()["stats"]["kv_blocks_used"]
            r.close()  # drop the connection mid-stream
            return used

    used = asyncio.run(main())
    assert used > 0
    assert wait_until(lambda: s.state()["stats"]["kv_blocks_used"] == 0)
    assert len(eng.aborted) == 1
    st = s.state()
    assert st["stats"]["num_running"] == 0 and st["num_in_flight"] == 0
    assert eng.c["gen"] < 200


def test_non_stream_disconnect_aborts(make_server):
    eng = FakeEngine(step_s=0.01)
    s = make_server(eng)

    async def main():
        async with aiohttp.ClientSession() as http:
            try:
                await http.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200},
                                timeout=aiohttp.ClientTimeout(total=0.2))
            except asyncio.TimeoutError:
                pass

    asyncio.run(main())
    assert wait_until(lambda: len(eng.aborted) == 1)
    assert wait_until(lambda: s.state()["stats"]["kv_blocks_used"] == 0)
    samples = s.get("/metrics")[2]
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="fake"} 1.0' in samples
