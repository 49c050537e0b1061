"""Freeze the startup heap out of Python's garbage collector (vLLM: ``vllm/utils/gc_utils.py``).

A server process holds a large heap that lives as long as it does: torch and transformers'
modules, the model's parameters and buffers, the tokenizer's tables. Python's cyclic
collector walks every tracked object of the oldest generation on each full collection, so
that heap costs a pause now and then while serving and, when the process exits, one last
walk over all of it (about 1 s for ``microvllm serve`` on a 2-core machine, between uvicorn
stopping and the process being gone).

``gc.freeze()`` moves every tracked object into a permanent generation the collector
skips. Objects made afterwards (requests, outputs) are collected as before::

    gen0 ─┐
    gen1 ─┼─ collect() first: garbage now is freed, not frozen forever
    gen2 ─┘
            freeze()  ──►  permanent (never walked again)
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_gc_heap() -> int:
    """Collect, then freeze everything alive: call once, after the model loaded and before
    traffic starts. Returns how many objects were frozen."""
    gc.collect()   # what is garbage now must be freed, not made permanent
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("froze %d objects of the startup heap", frozen)
    return frozen
