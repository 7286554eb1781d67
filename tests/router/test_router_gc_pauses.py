"""The router process's GC watch: every collection lands in the pause histogram, and settling the heap
freezes the startup objects so a full collection no longer rescans them."""

import gc

from prometheus_client import CollectorRegistry

from tokenmill.router.gc_pauses import GcPauses, settle_heap


def _count(registry, generation: str) -> float:
    return registry.get_sample_value("tokenmill_router_gc_pause_seconds_count", {"generation": generation}) or 0.0


def test_collections_are_observed_per_generation_until_stopped():
    registry = CollectorRegistry()
    watch = GcPauses(registry)
    watch.start()
    watch.start()  # idempotent: one callback
    try:
        gc.collect(0)
        gc.collect(2)
        assert _count(registry, "0") >= 1 and _count(registry, "2") >= 1
        assert registry.get_sample_value("tokenmill_router_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        watch.stop()
    before = _count(registry, "2")
    gc.collect(2)
    assert _count(registry, "2") == before and watch._callback not in gc.callbacks


def test_settle_heap_freezes_what_is_alive_and_a_full_collection_then_scans_less():
    assert gc.get_freeze_count() == 0
    try:
        tracked = len(gc.get_objects())
        frozen = settle_heap()
        assert frozen == gc.get_freeze_count() and frozen >= tracked // 2
        assert len(gc.get_objects()) < tracked - frozen // 2  # frozen objects are out of the collector's sight
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
