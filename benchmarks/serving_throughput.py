"""HTTP serving throughput vs the offline API on the same workload (target: HTTP >= 90% of offline).

    python benchmarks/serving_throughput.py                       # the shipped demo model
    python benchmarks/serving_throughput.py --model /tmp/small --num-prompts 64 --max-tokens 64 --stream

Workload: `--num-prompts` prompts cut from the Python standard library (seeded; input lengths uniform in
[--min-input, --max-input] tokens), greedy, `ignore_eos` so every request generates exactly --max-tokens.
Offline: `tokenmill.LLM.generate(prompts)` in this process. HTTP: `tokenmill serve` in a subprocess with the
same engine options; a client process per run sends every request at once with aiohttp (non-streaming, or
SSE with --stream) and times first send to last byte.
After one unmeasured run of a workload of its own in both modes (warm-up), repeat r runs prompts drawn
with seed+r through both modes (no prefix-cache reuse across repeats), which of
the two goes first alternates (the machine may be shared and its load drift). Prints a markdown table of
totals, the overall throughput ratio, and the ratio of each repeat.

Several server variants in one run (`--variant NAME=PYTHONPATH[,FLAG,...]`, repeatable), e.g. the engine
core process against main's in-thread engine:

    python benchmarks/serving_throughput.py --model /tmp/srv_tiny --stream --num-threads 1 \
        --variant process=/work/wt14 --variant main-thread=/work/main --variant thread=/work/wt14,--engine-process,off

Each variant is its own `tokenmill serve` subprocess (that PYTHONPATH, those extra flags); per repeat the
offline run and every variant run once, the order rotating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
import urllib.request


def make_prompts(tokenizer, n: int, min_input: int, max_input: int, seed: int) -> list[str]:
    from tokenmill.model.tokenizer import stdlib_sources

    rng = random.Random(seed)
    files = stdlib_sources()
    prompts = []
    while len(prompts) < n:
        ids = tokenizer.encode(rng.choice(files).read_text(encoding="utf-8", errors="replace"))
        want = rng.randint(min_input, max_input)
        if len(ids) < want + 1:
            continue
        start = rng.randrange(0, len(ids) - want)
        text = tokenizer.decode(ids[start:start + want])
        if text.strip():
            prompts.append(text)
    return prompts


def engine_kwargs(args) -> dict:
    return dict(model=args.model, kv_cache_bytes=args.kv_cache_bytes, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, device=args.device, num_threads=args.num_threads)


def engine_flags(args) -> list[str]:
    flags = ["--model", args.model, "--kv-cache-bytes", str(args.kv_cache_bytes), "--device", args.device,
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    if args.stream_interval != 1:
        flags += ["--stream-interval", str(args.stream_interval)]
    return flags


class Offline:
    """tokenmill.LLM in this process."""

    def __init__(self, args):
        from tokenmill import LLM, SamplingParams

        self.llm = LLM(**engine_kwargs(args))
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        self.llm.generate(["def warmup():", "import sys"], self.params)
        self.step_s = 0.0  # time inside engine.step(), to compare with the server's
        step = self.llm.engine.step

        def timed_step():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                self.step_s += time.perf_counter() - t0

        self.llm.engine.step = timed_step

    def run(self, prompts: list[str]) -> tuple[float, int, int, float]:
        """(wall_s, prompt_tokens, output_tokens, step_s)"""
        s0, t0 = self.step_s, time.perf_counter()
        results = self.llm.generate(prompts, self.params)
        wall = time.perf_counter() - t0
        return (wall, sum(len(r.prompt_token_ids) for r in results),
                sum(len(r.outputs[0].token_ids) for r in results), self.step_s - s0)


async def _http_workload(url: str, model: str, prompts: list[str], max_tokens: int, stream: bool):
    import aiohttp

    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})

    async def one(http, prompt):
        async with http.post(url + "/v1/completions", json={**body, "prompt": prompt}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            if not stream:
                return (await r.json())["usage"]
            usage = None
            async for line in r.content:  # parse only the usage chunk: a light client leaves the CPU to the server
                if b'"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
            return usage

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        t0 = time.perf_counter()
        usages = await asyncio.gather(*(one(http, p) for p in prompts))
        return time.perf_counter() - t0, usages


class Http:
    """`tokenmill serve` in a subprocess (idle between runs: its engine sleeps)."""

    def __init__(self, args, pythonpath: str | None = None, extra: list[str] = ()):
        import os

        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", "0", "--admission", "off", *engine_flags(args),
               *extra]
        self.args = args
        env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
        self.server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        line = self.server.stdout.readline()
        m = re.search(r"model '([^']*)'.* at (http://[\d.]+:\d+)", line)
        if not m:
            self.close()
            raise RuntimeError(f"tokenmill serve did not start: {line}")
        self.model, self.url = m.group(1), m.group(2)
        self.run(["def warmup():", "import sys"])

    def step_seconds(self) -> float:
        with urllib.request.urlopen(self.url + "/tokenmill/state", timeout=30) as r:
            return json.loads(r.read())["engine_step_seconds"]

    def run(self, prompts: list[str]) -> tuple[float, int, int, float]:
        """The client is a fresh process too (it times itself from first send to last byte), so that it
        shares nothing with this process (which holds the offline engine)."""
        s0 = self.step_seconds()
        job = {"url": self.url, "model": self.model, "prompts": prompts, "max_tokens": self.args.max_tokens,
               "stream": self.args.stream}
        out = subprocess.run([sys.executable, __file__, "--client"], input=json.dumps(job), capture_output=True,
                             text=True, check=True)
        res = json.loads(out.stdout)
        usages = res["usages"]
        return (res["wall"], sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages),
                self.step_seconds() - s0)

    def close(self):
        self.server.terminate()
        self.server.wait(30)


def client_main() -> int:
    """`--client`: one HTTP run described by JSON on stdin; prints {"wall", "usages"}."""
    job = json.loads(sys.stdin.read())
    wall, usages = asyncio.run(_http_workload(job["url"], job["model"], job["prompts"], job["max_tokens"],
                                              job["stream"]))
    print(json.dumps({"wall": wall, "usages": usages}))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        return client_main()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream", action="store_true", help="HTTP requests use SSE streaming")
    p.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval (SSE)")
    p.add_argument("--kv-cache-bytes", default="1GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads, both modes")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PYTHONPATH[,FLAG,...]",
                   help="a server variant (repeatable; default: one, this checkout's defaults)")
    args = p.parse_args(argv)
    variants = []
    for v in args.variant:
        name, _, rest = v.partition("=")
        path, *extra = rest.split(",")
        if not name or not path:
            p.error(f"--variant {v!r}: want NAME=PYTHONPATH[,FLAG,...]")
        variants.append((name, path, extra))
    variants = variants or [("HTTP", None, [])]
    from tokenmill.hardware import capabilities

    print(f"# CPU: {capabilities().summary()}", flush=True)  # the ISA beside every table

    from tokenmill.model.loader import resolve_model_path
    from tokenmill.model.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_path(args.model))
    workloads = [make_prompts(tok, args.num_prompts, args.min_input, args.max_input, args.seed + r)
                 for r in range(args.repeats)]
    off_runner = Offline(args)
    runners = []
    try:
        for name, path, extra in variants:
            runners.append(Http(args, path, extra))
        offline, http = [], [[] for _ in runners]
        warmup = make_prompts(tok, args.num_prompts, args.min_input, args.max_input, args.seed - 1)
        off_runner.run(warmup)  # the full workload once, unmeasured: allocator and caches reach steady state
        for h in runners:
            h.run(warmup)
        for r, prompts in enumerate(workloads):  # rotate who goes first: drifting load hits all alike
            order = list(range(len(runners) + 1))
            order = order[r % len(order):] + order[:r % len(order)]
            for i in order:
                if i == 0:
                    offline.append(off_runner.run(prompts))
                else:
                    http[i - 1].append(runners[i - 1].run(prompts))
    finally:
        for h in runners:
            h.close()
    for runs in http:
        for o, h in zip(offline, runs):
            assert o[1:3] == h[1:3], f"token counts differ on the same prompts: offline {o[1:3]}, HTTP {h[1:3]}"

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    rows = []
    sse = (f"SSE, stream interval {args.stream_interval}" if args.stream_interval > 1 else "SSE") \
        if args.stream else "non-streaming"
    for name, runs in (("offline (LLM.generate)", offline),
                       *((f"{v[0]} ({sse})", runs) for v, runs in zip(variants, http))):
        wall, ptok, otok, step_s = (sum(x[i] for x in runs) for i in range(4))
        rows.append({"mode": name, "step_s": step_s, "requests": args.num_prompts * len(runs), "prompt_tokens": ptok,
                     "output_tokens": otok, "wall_s": wall, "req_s": args.num_prompts * len(runs) / wall,
                     "output_tok_s": otok / wall, "total_tok_s": (ptok + otok) / wall,
                     "vs_offline": None if runs is offline else sum(o[0] for o in offline) / wall,
                     "median_repeat_ratio": None if runs is offline else median([o[0] / h[0] for o, h in zip(offline, runs)])})
    ratio = rows[1]["output_tok_s"] / rows[0]["output_tok_s"]
    median_ratio = rows[1]["median_repeat_ratio"]
    print(f"model {args.model}, {args.num_prompts} prompts x {args.max_tokens} output tokens, "
          f"input {args.min_input}-{args.max_input} tokens, {args.repeats} repeats (totals)")
    print("| mode | requests | prompt tok | output tok | wall s | in engine.step() s | req/s | output tok/s "
          "| total tok/s | vs offline (overall; median repeat) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        vs = "" if r["vs_offline"] is None else f"{r['vs_offline']:.1%}; {r['median_repeat_ratio']:.1%}"
        print(f"| {r['mode']} | {r['requests']} | {r['prompt_tokens']} | {r['output_tokens']} | {r['wall_s']:.2f} | "
              f"{r['step_s']:.2f} | {r['req_s']:.2f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | {vs} |")
    for (name, _, _), runs in zip(variants, http):
        print(f"{name} / offline per repeat (same prompts): " + ", ".join(f"{o[0] / h[0]:.1%}" for o, h in zip(offline, runs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "ratio": ratio, "median_repeat_ratio": median_ratio,
                       "offline_runs": offline,
                       "http_runs": http}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
