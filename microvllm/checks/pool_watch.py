"""Watch a learner's BlockPool inside the engine: check it after every call, name the call.

    watched = watch_block_pool(BlockPool)         a subclass: same code, plus a check
    engine ... -> KVCacheManager -> watched.free_blocks([5, 3])
                                       your free_blocks runs
                                       check_block_pool_invariants(pool)   (no block tables needed)
                                       ✗ -> BlockPoolError("your BlockPool.free_blocks([5, 3]): ...")

Without it, a pool bug surfaces wherever the engine next trips over it (a scheduler
line, an abort); with it, the message names the pool method that broke the rule.
"""

from __future__ import annotations

import re

from microvllm.checks.free_queue import ids
from microvllm.checks.report import CheckFailure
from microvllm.core.kv_cache_invariants import InvariantError, check_block_pool_invariants

# Which part of the pool to look at, for each rule a check can report (shared with check_block_pool).
POOL_HINTS = [
    (r"ref_cnt \d+ but is also in the free queue",
     "a block in use (ref_cnt > 0) must not sit in the free queue: touch() must remove() a free "
     "block it revives, and free_blocks() may only append() a block whose ref_cnt reached 0"),
    (r"ref_cnt 0 but is not in the free queue",
     "a block whose ref_cnt drops to 0 must be appended to the free queue, or it leaks"),
    (r"negative ref_cnt|freed twice|below 0",
     "free_blocks() must refuse (ValueError) a block whose ref_cnt is already 0, before it changes anything"),
    (r"appears in \d+ block table",
     "get_new_blocks() sets ref_cnt to 1, touch() adds 1, free_blocks() takes 1 away"),
    (r"hash .* maps to block|carry a hash but the hash table",
     "when get_new_blocks() reuses a cached free block, evict its hash first (_maybe_evict_cached_block)"),
]


class BlockPoolError(CheckFailure):
    """A call of the learner's pool broke its accounting (or raised)."""


def pool_hint(message: str) -> str | None:
    return next((hint for pattern, hint in POOL_HINTS if re.search(pattern, message)), None)


def watch_block_pool(pool_class: type) -> type:
    """A subclass of ``pool_class`` whose ``get_new_blocks``, ``free_blocks`` and ``touch`` check
    the pool after each call and raise ``BlockPoolError`` naming the call."""
    name = pool_class.__name__

    def watched(pool, call: str, run, blocks=()):
        def freed_twice():
            below = [block for block in blocks if block.ref_cnt < 0]
            if below:
                return BlockPoolError(
                    f"your {name}.{call}: block {below[0].block_id} was freed twice (its ref_cnt went "
                    f"below 0, to {below[0].ref_cnt})", hint=pool_hint("freed twice"))
            return None

        refused = [block.block_id for block in blocks if block.ref_cnt <= 0]
        try:
            result = run()
        except (NotImplementedError, BlockPoolError):
            raise
        except Exception as exc:  # noqa: BLE001 - becomes a message that names the call
            error = freed_twice()
            if error is not None:
                raise error from exc
            what = f"your {name}.{call} raised {type(exc).__name__}: {exc}"
            if refused and isinstance(exc, ValueError):
                # Refusing was right: the engine still holds that block, so a reference was lost before.
                raise BlockPoolError(what, hint=f"block {refused[0]} is still in a block table but its "
                                     "ref_cnt was already 0: a reference was lost before (touch() must add "
                                     "one per prefix-cache hit, get_new_blocks() must set 1)") from exc
            raise BlockPoolError(what, hint=pool_hint(str(exc))) from exc
        error = freed_twice()
        if error is not None:
            raise error
        try:
            check_block_pool_invariants(pool)
        except InvariantError as exc:
            raise BlockPoolError(f"after your {name}.{call}: {exc}", hint=pool_hint(str(exc))) from exc
        return result

    class Watched(pool_class):
        def get_new_blocks(self, num_blocks):
            return watched(self, f"get_new_blocks({num_blocks})",
                           lambda: super(Watched, self).get_new_blocks(num_blocks))

        def free_blocks(self, ordered_blocks):
            blocks = list(ordered_blocks)
            return watched(self, f"free_blocks({ids(blocks)})",
                           lambda: super(Watched, self).free_blocks(blocks), blocks)

        def touch(self, blocks):
            blocks = list(blocks)
            return watched(self, f"touch({ids(blocks)})", lambda: super(Watched, self).touch(blocks))

    Watched.__name__ = Watched.__qualname__ = name
    Watched.__module__ = pool_class.__module__
    return Watched
