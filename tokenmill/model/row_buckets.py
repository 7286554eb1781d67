"""The row counts oneDNN linears run at (no torch here: the simulator imports it).

oneDNN sets up each (weight shape, row count) once, ~1.5-3.5 ms per linear shape on first use (measured on the AMX
VM, docs/benchmarks.md session 18), and a server meets a new prefill size on most large steps. So calls of more
than ONEDNN_BUCKET_FROM rows run at the row count rounded up to a multiple of ONEDNN_BUCKET (zero rows appended,
dropped after): ~28 row counts up to 2,048 instead of one per size. `linear.PackedWeight` and csrc's
`onednn_linear` (the fused stacks) apply it; the simulator charges the setup once per bucket (sim/worker.py,
sim/calibrate.mark_new_shapes).
"""

ONEDNN_BUCKET_FROM, ONEDNN_BUCKET = 256, 64


def onednn_rows(m: int) -> int:
    """The row count a oneDNN linear call of `m` rows runs at."""
    return m if m <= ONEDNN_BUCKET_FROM else -(-m // ONEDNN_BUCKET) * ONEDNN_BUCKET
