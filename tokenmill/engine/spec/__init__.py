"""Speculative decoding: proposers (draft model, n-gram prompt lookup), lossless verification through the
runner's ordinary step, KV rollback, and the `auto` policy that picks k per sequence from measured
acceptance and step cost."""
