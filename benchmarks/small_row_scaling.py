"""How the batch-invariant small-row kernels' cost grows with the row count (a verify step's k + 1 rows).

    python benchmarks/small_row_scaling.py

Times `PackedWeight` (the small-row bf16 linear the decode and verify steps use, through its Python wrapper: ~5 us
of each figure) on the demo target's projection shapes for 1-8 rows, oneDNN's bf16 linear at 5 rows beside it, and
the packed lm_head (logits and greedy) for 1-5 rows. Prints the ISA line first.
"""
import time, torch
from tokenmill.model.linear import PackedWeight
from tokenmill.model.lm_head import PackedHead
from tokenmill.hardware import capabilities
torch.set_num_threads(2)
print(capabilities().summary())
def t(f, n=3000):
    for _ in range(50): f()
    t0=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t0)/n*1e6
for (o,i) in [(768,256),(256,256),(1408,256),(256,704)]:
    w=torch.randn(o,i,dtype=torch.bfloat16)
    pw=PackedWeight.maybe(w)
    row=[]
    for m in [1,2,3,4,5,8]:
        x=torch.randn(m,i,dtype=torch.bfloat16)
        row.append(f"{m}:{t(lambda: pw(x)):.1f}")
    x5 = torch.randn(5, i, dtype=torch.bfloat16)
    row.append(f"onednn5:{t(lambda: torch.nn.functional.linear(x5, w)):.1f}")
    print(f"linear {o}x{i} us:", " ".join(row))
emb=torch.randn(4096,256,dtype=torch.bfloat16)
ph=PackedHead.build(emb)
for m in [1,2,3,4,5]:
    x=torch.randn(m,256,dtype=torch.bfloat16)
    print(f"head rows {m}: logits {t(lambda: ph.logits(x)):.1f} us, greedy {t(lambda: ph.greedy(x)):.1f} us" if ph else "no packed head")
