"""Batch-1 decode with speculation off, torch threads 2 vs 1, alternated in subprocesses: how a 2-thread step
fares when other jobs share the cores (docs/benchmarks/spec_decode.md, session 11).

    python benchmarks/batch1_threads.py
"""
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.hardware import capabilities  # noqa: E402

CODE = r'''
import sys, time, json, torch
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill import SamplingParams
e = LLMEngine(model="demo", kv_cache_bytes="64MiB", num_threads=int(sys.argv[1]))
sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
def run(tag):
    e.add_request(tag, e.tokenizer.encode("def parse(self, text):\n    "), sp)
    n = 0
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished: n = len(o.output_token_ids)
    return n
run("w")
t = time.perf_counter(); n = sum(run(f"r{i}") for i in range(4)); dt = time.perf_counter() - t
print("RESULT " + json.dumps({"threads": torch.get_num_threads(), "tok_s": n / dt}))
'''
res = {1: [], 2: []}
for r in range(3):
    for t in (2, 1):
        p = subprocess.run([sys.executable, "-c", CODE, str(t)], capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(p.stderr[-2000:]); continue
        res[t].append(json.loads(line[0][7:])["tok_s"])
        print(t, round(res[t][-1]), flush=True)
print(capabilities().summary())
print("batch-1 tok/s by torch threads:", {t: [round(x) for x in v] for t, v in res.items()})
