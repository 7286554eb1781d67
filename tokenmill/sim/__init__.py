"""`tokenmill sim`: the real scheduler, KV manager, router policies and admission on a virtual clock.

Only the model runner is replaced, by a cost model (roofline from a model shape and a GPU, or coefficients
calibrated on this machine's real engine). See docs/architecture.md ("Simulator").
"""
