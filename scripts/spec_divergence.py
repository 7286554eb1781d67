"""Where does greedy speculation first differ from speculation off? For the first differing outputs, the first
layer output (per row, keyed by request and token prefix) whose bits differ between the two runs.

    python scripts/spec_divergence.py [--n 60] [--max-tokens 24] [--dtype bfloat16] [--kv 32MiB] [--batch-invariant off]

Run with TOKENMILL_FUSED_DECODE=0 TOKENMILL_FUSED_MIXED=0 so every step goes through the modules (the hooks see
them). Session 22 found with it the two causes of bf16 differences at 240 sequences (docs/benchmarks/spec_decode.md
"Session 22"): a down_proj output with an identical input row (linear_small vs oneDNN bits), and layer 0's attention
of a generated position recomputed after a preemption (prefill vs decode kernel).
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from tokenmill import LLM, SamplingParams


def run(prompts, params, args, **kw):
    llm = LLM(args.model, kv_cache_bytes=args.kv, dtype=args.dtype, batch_invariant=args.batch_invariant, **kw)
    runner, model = llm.engine.runner, llm.engine.runner.model
    store: dict = {}
    caps: list = []
    ords: dict = {}
    toks: dict = {}

    def hook_of(name, use_input=False):
        def hook(mod, inputs, out=None):
            t = inputs[0] if use_input else out
            t = t[0] if isinstance(t, tuple) else t
            caps.append((name, t.detach().reshape(t.shape[0], -1).clone()))
        return hook

    for i, layer in enumerate(model.layers):
        for nm, m in [("ln1", layer.input_layernorm), ("qkv", layer.self_attn.qkv_proj),
                      ("ln2", layer.post_attention_layernorm), ("gate_up", layer.mlp.gate_up_proj),
                      ("down", layer.mlp.down_proj), ("o_proj", layer.self_attn.o_proj)]:
            m.register_forward_hook(hook_of(f"L{i}.{nm}"))
        layer.self_attn.o_proj.register_forward_pre_hook(hook_of(f"L{i}.attention", True))
        layer.mlp.down_proj.register_forward_pre_hook(hook_of(f"L{i}.act", True))
    model.norm.register_forward_hook(hook_of("norm"))
    execute = runner.execute

    def traced(sched, *a, **k):
        keys = []
        for s in sched.seqs:
            o = ords.setdefault(s.request_id, len(ords))
            tk = toks.setdefault(o, [])
            for j, t in enumerate(s.token_ids):
                p = s.start_pos + j
                del tk[p:]
                tk.append(t)
                keys.append((o, p, hash(tuple(tk))))
        caps.clear()
        out = execute(sched, *a, **k)
        for name, t in caps:
            if t.shape[0] != len(keys):  # a last layer that computed only the sampled rows
                continue
            for key, row in zip(keys, t):
                h = hashlib.md5(row.contiguous().view(torch.int16 if row.dtype == torch.bfloat16 else torch.int32)
                                .numpy().tobytes()).hexdigest()[:12]
                store.setdefault(key, {}).setdefault(name, []).append(h)
        return out

    runner.execute = traced
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)], store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv", default="32MiB")
    ap.add_argument("--batch-invariant", default="off")
    args = ap.parse_args()
    base = [[3, 4, 5, 6] * 4, [9, 10, 11] * 5, [20, 21] * 7, [7, 8, 9, 10, 11] * 3]
    prompts = [[(t + i) % 200 + 3 for t in p] for i in range(args.n) for p in base]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ref, s_off = run(prompts, params, args)
    got, s_spec = run(prompts, params, args, speculative_model="ngram", num_speculative_tokens=4)
    bad = [i for i, (a, b) in enumerate(zip(ref, got)) if a != b]
    print(f"{len(prompts)} sequences, {args.dtype}, KV {args.kv}, batch_invariant {args.batch_invariant}: "
          f"{len(bad)} outputs differ {bad[:10]}")
    for i in bad[:5]:
        first = next(j for j, (x, y) in enumerate(zip(ref[i], got[i])) if x != y)
        print(f"request {i}: first differing output token {first} (prompt {len(prompts[i])} tokens)")
        for key in sorted(k for k in s_off if k[0] == i and k in s_spec):
            a, b = s_off[key], s_spec[key]
            diffs = [nm for nm in a if nm in b and a[nm][-1] != b[nm][-1]]
            if diffs:
                print(f"  position {key[1]}: first differing output {diffs[0]} ({len(diffs)} differ); "
                      f"computed {len(a[diffs[0]])}x off, {len(b[diffs[0]])}x with speculation")
                break
        else:
            print("  no layer output differs at the positions both runs computed")


if __name__ == "__main__":
    main()
