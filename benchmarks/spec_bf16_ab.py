"""A/B of the bf16 small-row-bits fix in one process, interleaved: same engines config, the fix toggled per batch."""
import sys, time, contextlib
sys.path.insert(0, __import__("os").path.dirname(__file__))
from spec_decode import heldout_prompts, run_batch
import tokenmill.engine.runner as R
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.hardware import capabilities
real = R.small_row_bits
ON = [True]
R.small_row_bits = lambda on: real(on and ON[0])
print(capabilities().summary())
for c in (4, 8):
    cfgs = {"off": {}, "ngram k=4": dict(speculative_model="ngram", num_speculative_tokens=4),
            "draft k=4": dict(speculative_model="demo-draft", num_speculative_tokens=4)}
    es = {n: LLMEngine(model="demo", kv_cache_bytes="128MiB", **kw) for n, kw in cfgs.items()}
    prompts = heldout_prompts(es["off"].tokenizer, 16, 128)
    for e in es.values():
        run_batch(e, prompts[:c], 16, "w")
    res = {}
    outs = {}
    for rep in range(2):
        for i in range(0, 16, c):
            for n, e in es.items():
                for fix in ((True, False) if n != "off" else (True,)):
                    ON[0] = fix
                    w, k, o, _ = run_batch(e, prompts[i:i + c], 96, f"{n}{fix}{i}{rep}")
                    a = res.setdefault((n, fix), [0.0, 0])
                    a[0] += w; a[1] += k
                    outs.setdefault((n, fix), []).extend(o)
    base = res[("off", True)][1] / res[("off", True)][0]
    print(f"\nconcurrency {c}: off {base:.0f} tok/s")
    for (n, fix), (w, k) in res.items():
        same = sum(a != b for a, b in zip(outs[(n, fix)], outs[("off", True)]))
        print(f"| {n} | fix {'on' if fix else 'off'} | {k / w:.0f} tok/s | {k / w / base:.2f}x of off | outputs differing from off: {same}/{len(outs[(n, fix)])} |")
