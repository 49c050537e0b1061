"""Deliberately wrong implementations for the checker tests.

``mutant(module, [(old, new), ...], name=value, ...)`` loads a copy of a package module
with text replaced (each ``old`` must occur, so a package change that removes it fails
loudly) and attributes overridden: the copy's functions and classes see the overrides.
Below it, buggy classes more than one test file uses.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
import tempfile
from pathlib import Path

from microvllm.core.block_pool import BlockPool

_counter = itertools.count()


def mutant(module, replacements=(), **overrides):
    source = inspect.getsource(module)
    for old, new in replacements:
        assert old in source, f"{module.__name__} no longer contains {old!r}: update the mutant"
        source = source.replace(old, new)
    name = f"mutant_{module.__name__.replace('.', '_')}_{next(_counter)}"
    path = Path(tempfile.mkdtemp(prefix="microvllm-mutant-")) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[name] = copy
    spec.loader.exec_module(copy)
    for key, value in overrides.items():
        setattr(copy, key, value)
    return copy


class PoolFreesTwice(BlockPool):
    """A block pool that frees a block whose ref count is already 0 (a double free)."""

    def free_blocks(self, ordered_blocks):
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt <= 0:
                self.free_block_queue.append(block)
