"""KV tiers below the engine pool: host DRAM (/dev/shm, shared by the workers of a host) and local disk.
See manager.py (policy), store.py (files, integrity, capacity), keys.py (keys)."""
