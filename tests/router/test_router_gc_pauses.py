"""The router process's GC watch: every collection lands in the pause histogram, and settling the heap
freezes the startup objects so a full collection no longer rescans them."""

import gc

from prometheus_client import CollectorRegistry

import pytest

from tokenmill.router.gc_pauses import YOUNG_THRESHOLD, GcPauses, settle_heap, young_threshold


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


def _young_collections_while_allocating(n: int) -> float:
    registry = CollectorRegistry()
    watch = GcPauses(registry)
    gc.collect()
    watch.start()
    try:
        kept = [[] for _ in range(n)]  # n tracked containers, alive: each counts towards the young threshold
    finally:
        watch.stop()
    assert len(kept) == n
    return _count(registry, "0") + _count(registry, "1") + _count(registry, "2")


def test_young_threshold_makes_young_collections_rarer_and_restores():
    default = gc.get_threshold()
    n = YOUNG_THRESHOLD // 2
    assert _young_collections_while_allocating(n) >= n // default[0] - 1  # Python's 700: several
    before = young_threshold()
    try:
        assert before == default and gc.get_threshold() == (YOUNG_THRESHOLD, *default[1:])
        assert _young_collections_while_allocating(n) == 0
    finally:
        gc.set_threshold(*before)
    with pytest.raises(ValueError, match="threshold"):
        young_threshold(0)
    assert gc.get_threshold() == default
