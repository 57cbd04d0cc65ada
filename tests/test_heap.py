"""proxy/heap.py: the startup heap out of the collector's scans, and a stretch of work's."""

from __future__ import annotations

import gc

import pytest

from proxy.heap import GC_YOUNG_THRESHOLD, freeze_startup_heap, still_heap


@pytest.fixture
def restored_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_a_stretch_keeps_what_was_there_out_of_full_collections_then_gives_it_back(
    restored_gc: None,
) -> None:
    gc.unfreeze()
    before = [object() for _ in range(3)]  # (containers exist before it)
    with still_heap():
        assert gc.get_freeze_count() > 0
        made = []  # made during the stretch: collected as ever
        made.append(made)
        del made
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0 and before


def test_a_heap_frozen_at_startup_stays_frozen_after_a_stretch(restored_gc: None) -> None:
    freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 0 and gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
    with still_heap():
        pass
    assert gc.get_freeze_count() >= frozen
