"""A streaming load client for the admission tests, run in its own process by default.

A client that shares the server's process also shares its GIL: under an overload its own TTFTs then carry the
server's contention, and the test measures the harness rather than the server. `burst` runs the requests in
a child Python process (this file as a script: JSON arguments in, JSON results out).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import aiohttp

C = "/v1/completions"


async def stream_ttft(http, url, prompt, headers=None, max_tokens=4, body_extra=None):
    """(status, TTFT seconds or None, Retry-After header, error code)."""
    t0 = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, **(body_extra or {})}
    async with http.post(url + C, json=body, headers=headers or {}) as r:
        if r.status != 200:
            err = await r.json()
            return r.status, None, r.headers.get("Retry-After"), err["error"].get("code")
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
        return 200, ttft, None, None


def _burst_here(url, n, interval_s, prompt_len, seed=0, headers=None, **kw):
    rng = random.Random(seed)

    async def main():
        async with aiohttp.ClientSession() as http:
            async def one(i):
                await asyncio.sleep(i * interval_s)
                prompt = [rng.randrange(10, 4000) for _ in range(prompt_len)]
                return await stream_ttft(http, url, prompt, headers, **kw)

            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(main())


def burst(url, n, interval_s, prompt_len, seed=0, headers=None, **kw):
    """n streamed requests of prompt_len random token ids, one every interval_s, from a separate process."""
    args = {"url": url, "n": n, "interval_s": interval_s, "prompt_len": prompt_len, "seed": seed,
            "headers": headers, **kw}
    out = subprocess.run([sys.executable, __file__, json.dumps(args)], capture_output=True, text=True,
                         timeout=120 + n * interval_s)
    if out.returncode != 0:
        raise RuntimeError(f"load client failed ({out.returncode}): {out.stderr[-2000:]}")
    return [tuple(r) for r in json.loads(out.stdout)]


if __name__ == "__main__":
    print(json.dumps(_burst_here(**json.loads(sys.argv[1]))))
