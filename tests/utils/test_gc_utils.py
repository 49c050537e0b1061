"""freeze_gc_heap: garbage alive at the call is freed, not frozen; what is alive is frozen."""

import gc
import weakref

from microvllm.utils.gc_utils import freeze_gc_heap


class Node:
    pass


def test_garbage_is_collected_first_and_the_living_heap_is_frozen():
    cycle = Node()
    cycle.me = cycle                # garbage only the cyclic collector can free
    gone = weakref.ref(cycle)
    del cycle
    kept = Node()
    kept.me = kept                  # alive: it must be frozen
    try:
        frozen = freeze_gc_heap()
        assert gone() is None, "a cycle that was garbage was frozen instead of freed"
        assert frozen == gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects()), "a living object is still tracked"
    finally:
        gc.unfreeze()
    assert any(obj is kept for obj in gc.get_objects())
