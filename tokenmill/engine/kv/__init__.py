"""Paged KV cache bookkeeping: block pool, chained block hashes, prefix cache, per-request block tables."""
