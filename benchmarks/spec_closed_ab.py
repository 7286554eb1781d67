"""Closed-loop A/B of n-gram speculation configs, offline: C requests kept alive, configs interleaved per round.

    python benchmarks/spec_closed_ab.py C SECS ROUNDS NAME=SPEC ...
    python benchmarks/spec_closed_ab.py 1 4 8 k8=8 auto=auto "nonb=auto:neighbor_probe_min=1"
    WL=batch:prompt=128,output=96,spread=0 python benchmarks/spec_closed_ab.py 8 4 6 k4=4 k8=8 auto=auto

SPEC: a fixed k, `auto`, or `auto:FIELD=VALUE,...` (GuardConfig overrides, as TOKENMILL_SPEC_GUARD), `0` = off.
Each engine keeps its guard state across rounds (like a server). Prints, per config, the median over rounds of its
tokens/s over the first config's in the same round (wall and per CPU second of this process: a stall of the
shared machine shows as a difference between the two), then each auto guard's chosen-k counts, switches, probes.
The workload's prompts are the bench's (WL, default the code workload), greedy, 96 tokens each, 1 torch thread.
"""
import os, sys, time, statistics
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.bench.workloads.registry import make_workload
from tokenmill.bench.tokenizer import load_vocab, find_tokenizer
from tokenmill.model.loader import resolve_model_path
c, secs, rounds = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
wl = os.environ.get("WL", "code:prompt=128,output=96,spread=0")
vocab = load_vocab(find_tokenizer(str(resolve_model_path("demo")), None))
work = make_workload(wl, vocab, 0)
prompts = [list(map(int, work.session(i).turns[0].messages[-1].tokens)) for i in range(400)]
engines = {}
for arg in sys.argv[4:]:
    name, spec = arg.split("=", 1)
    k, _, env = spec.partition(":")
    os.environ["TOKENMILL_SPEC_GUARD"] = env
    engines[name] = LLMEngine(model="demo", speculative_model="ngram" if k != "0" else None,
                              num_speculative_tokens=(k if k == "auto" else int(k)) if k != "0" else None, num_threads=1)
os.environ["TOKENMILL_SPEC_GUARD"] = ""
def run(e, secs, start):
    i = start; live = set(); n_out = 0
    p = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    def add():
        nonlocal i
        rid = f"r{i}"; e.add_request(rid, prompts[i % len(prompts)], p); live.add(rid); i += 1
    for _ in range(c): add()
    t0 = time.perf_counter(); c0 = time.process_time()
    while time.perf_counter() - t0 < secs:
        for o in e.step():
            n_out += len(o.new_token_ids)
            if o.finished:
                live.discard(o.request_id); add()
    dt = time.perf_counter() - t0; dc = time.process_time() - c0
    for rid in list(live): e.abort_request(rid)
    while e.has_unfinished_requests(): e.step()
    return n_out / dt, n_out / dc
for e in engines.values(): run(e, 2, 0)
res = {k: [] for k in engines}
names = list(engines)
cpu = {k: [] for k in engines}
for r in range(rounds):
    order = names if r % 2 == 0 else names[::-1]
    for k in order:
        w, cc = run(engines[k], secs, 1000 * (r + 1))
        res[k].append(w); cpu[k].append(cc)
ref = names[0]
for k in names:
    ratios = [a / b for a, b in zip(res[k], res[ref])]
    cr = [a / b for a, b in zip(cpu[k], cpu[ref])]
    print(f"{k:>12}: wall median {statistics.median(res[k]):.0f} tok/s; vs {ref} median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] sum {sum(res[k])/sum(res[ref]):.3f} | per CPU s: median {statistics.median(cr):.3f} "
          f"[{min(cr):.3f}-{max(cr):.3f}] sum {sum(cpu[k])/sum(cpu[ref]):.3f}", flush=True)
for k, e in engines.items():
    sp = e.spec
    if sp is not None and sp.guard is not None:
        print(k, "chosen", dict(sorted(sp.stats.chosen_k.items())), "switches", sp.guard.num_switches,
              {bk: b.num_probes for bk, b in sp.guard.buckets.items()})
