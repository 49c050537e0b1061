"""A toy scheduler + block pool that records a `Trace`, for tests and early notebooks.

It follows the real engine's rules in miniature (pure Python, no model): one token
budget per step, running requests first, then waiting ones; blocks from a pool with
ref counts and an LRU free queue; full blocks hashed into a prefix cache; the
newest running request preempted (freed, re-queued at the front for recompute)
when the pool runs dry; a sliding window swapping blocks that fell out of the
window for the null block 0. "Sampled" tokens are random ids: only the
bookkeeping is real, which is all the plots need.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from microvllm.trace import RequestStep, StepTrace, Trace, short_hash, step_kind

NULL_BLOCK = 0


@dataclass
class DemoRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int = 0
    finish_reason: str = "length"   # reported when max_tokens is reached ("stop" = pretend EOS)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)  # one per cache group

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class DemoBlockPool:
    """Ref counts, an LRU free queue (OrderedDict: O(1) pop-oldest and remove) and hash -> block."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_cnts = [0] * num_blocks
        self.hashes: list[str | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[str, int] = {}

    def allocate(self) -> int:
        block, _ = self.free_queue.popitem(last=False)   # least recently freed
        if self.hashes[block] is not None:                # evict it from the prefix cache
            del self.cached[self.hashes[block]]
            self.hashes[block] = None
        self.ref_cnts[block] = 1
        return block

    def touch(self, block: int) -> None:
        """Take a prefix-cache hit: a free cached block leaves the free queue."""
        if self.ref_cnts[block] == 0:
            del self.free_queue[block]
        self.ref_cnts[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):                    # tail blocks are evicted first
            if block == NULL_BLOCK:
                continue
            self.ref_cnts[block] -= 1
            if self.ref_cnts[block] == 0:
                self.free_queue[block] = None

    def cache(self, block: int, block_hash: str) -> None:
        if self.hashes[block] is None and block_hash not in self.cached:
            self.hashes[block] = block_hash
            self.cached[block_hash] = block


class DemoEngine:
    def __init__(self, requests: list[DemoRequest], *, block_size: int, num_blocks: int,
                 max_num_batched_tokens: int, max_num_seqs: int,
                 kv_cache_groups: tuple[str, ...] = ("full_attention",), sliding_window: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 prompts: dict[str, str] | None = None, seed: int = 0) -> None:
        self.pending = sorted(requests, key=lambda r: r.arrival_step)
        self.waiting: list[DemoRequest] = []
        self.running: list[DemoRequest] = []
        self.pool = DemoBlockPool(num_blocks)
        self.groups = list(kv_cache_groups)
        self.window = sliding_window
        self.bs, self.budget, self.max_seqs = block_size, max_num_batched_tokens, max_num_seqs
        self.prefix_caching, self.chunked = enable_prefix_caching, enable_chunked_prefill
        self.rng = random.Random(seed)
        self.trace = Trace(block_size=block_size, num_blocks=num_blocks,
                           max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                           kv_cache_groups=list(kv_cache_groups), sliding_window=sliding_window,
                           prompts=dict(prompts or {}))

    def run(self, max_steps: int = 10_000) -> Trace:
        step = 0
        while (self.pending or self.waiting or self.running) and step < max_steps:
            self.step(step)
            step += 1
        return self.trace

    # -- one engine step ----------------------------------------------------
    def step(self, step: int) -> None:
        if self.pending and not (self.waiting or self.running):
            self.pending[0].arrival_step = min(self.pending[0].arrival_step, step)   # idle: skip ahead
        while self.pending and self.pending[0].arrival_step <= step:
            self.waiting.append(self.pending.pop(0))
        scheduled, preempted = self._schedule()
        new_tokens, finished, reasons = {}, [], {}
        for rs, req in scheduled:                          # "run the model"
            req.num_computed_tokens += rs.num_scheduled_tokens
            self._cache_full_blocks(req)
            if req.num_computed_tokens == len(req.token_ids):   # all known tokens computed: sample
                token = self.rng.randrange(100, 1000)
                req.output_token_ids.append(token)
                new_tokens[req.request_id] = [token]
                if len(req.output_token_ids) >= req.max_tokens:
                    finished.append(req.request_id)
                    reasons[req.request_id] = req.finish_reason
                    self._free(req)
                    self.running.remove(req)
        pool = self.pool
        self.trace.steps.append(StepTrace(
            step=step, token_budget=self.budget, max_num_seqs=self.max_seqs,
            scheduled=[rs for rs, _ in scheduled], preempted=preempted, finished=finished,
            finish_reasons=reasons, waiting=[r.request_id for r in self.waiting],
            block_tables={r.request_id: [list(t) for t in r.block_tables] for r in self.running},
            ref_cnts=list(pool.ref_cnts), block_hashes=list(pool.hashes),
            free=[b in pool.free_queue for b in range(len(pool.ref_cnts))],
            num_free_blocks=len(pool.free_queue), new_tokens=new_tokens))

    def _schedule(self):
        budget, scheduled, preempted = self.budget, [], []
        i = 0
        while i < len(self.running) and budget > 0:         # 1. running requests, in order
            req = self.running[i]
            num_new = min(len(req.token_ids) - req.num_computed_tokens, budget)
            self._release_outside_window(req)
            while not self._can_allocate(req, num_new, hits=[]):
                victim = self.running.pop()                 # the newest running request
                self._free(victim)
                victim.num_computed_tokens = 0
                self.waiting.insert(0, victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req not in self.running:
                break
            scheduled.append((self._admit(req, num_new, hits=[], is_new=False), req))
            budget -= num_new
            i += 1
        while (not preempted and self.waiting and budget > 0   # 2. waiting requests, in order
               and len(self.running) < self.max_seqs):
            req = self.waiting[0]
            hits = self._find_cache_hits(req)
            remaining = len(req.token_ids) - len(hits) * self.bs
            num_new = min(remaining, budget)
            if (num_new < remaining and not self.chunked) or not self._can_allocate(req, num_new, hits):
                break
            self.waiting.pop(0)
            req.block_tables = [[] for _ in self.groups]
            for b in hits:
                self.pool.touch(b)
            req.block_tables[0] = list(hits)
            req.num_computed_tokens = len(hits) * self.bs
            self.running.append(req)
            scheduled.append((self._admit(req, num_new, hits, is_new=True), req))
            budget -= num_new
        return scheduled, preempted

    def _admit(self, req: DemoRequest, num_new: int, hits: list[int], is_new: bool) -> RequestStep:
        """Allocate the blocks for `num_new` more tokens and describe the request's share."""
        end = req.num_computed_tokens + num_new
        for table in req.block_tables:
            while len(table) * self.bs < end:
                table.append(self.pool.allocate())
        kind = step_kind(req.num_computed_tokens, num_new, len(req.token_ids),
                         len(req.output_token_ids), is_new)
        return RequestStep(request_id=req.request_id, num_scheduled_tokens=num_new, kind=kind,
                           num_computed_tokens_before=req.num_computed_tokens,
                           num_prompt_tokens=len(req.prompt_token_ids),
                           prefix_hit_tokens=len(hits) * self.bs if is_new else None, is_new=is_new)

    # -- the KV cache manager's side ------------------------------------------
    def _can_allocate(self, req: DemoRequest, num_new: int, hits: list[int]) -> bool:
        held = req.block_tables if req in self.running else [list(hits)] + [[] for _ in self.groups[1:]]
        num_computed = len(hits) * self.bs if req not in self.running else req.num_computed_tokens
        blocks_needed = -(-(num_computed + num_new) // self.bs)
        need = sum(max(0, blocks_needed - len(t)) for t in held)
        revived = sum(1 for b in hits if self.pool.ref_cnts[b] == 0)   # free cached hits leave the queue
        return need <= len(self.pool.free_queue) - revived

    def _find_cache_hits(self, req: DemoRequest) -> list[int]:
        """Leading full blocks already cached; never the last token (its logits are needed)."""
        if not self.prefix_caching or self.window is not None:
            return []            # the demo looks up hits for full attention only
        hits = []
        for block_hash in self._block_hashes(req.token_ids, (len(req.token_ids) - 1) // self.bs):
            if block_hash not in self.pool.cached:
                break
            hits.append(self.pool.cached[block_hash])
        return hits

    def _block_hashes(self, token_ids: list[int], num_blocks: int) -> list[str]:
        hashes, parent = [], None
        for j in range(num_blocks):
            parent = short_hash((parent, tuple(token_ids[j * self.bs:(j + 1) * self.bs])))
            hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, req: DemoRequest) -> None:
        if not self.prefix_caching:
            return
        hashes = self._block_hashes(req.token_ids, req.num_computed_tokens // self.bs)
        for g, table in enumerate(req.block_tables):       # each cache group has its own entries
            for block, block_hash in zip(table, hashes):
                if block != NULL_BLOCK:
                    self.pool.cache(block, block_hash if g == 0 else short_hash((self.groups[g], block_hash)))

    def _release_outside_window(self, req: DemoRequest) -> None:
        """Blocks wholly before the window of the next token to compute become the null block."""
        if self.window is None:
            return
        first_useful = max(0, req.num_computed_tokens - self.window + 1) // self.bs
        for group, table in zip(self.groups, req.block_tables):
            if group != "sliding_window":
                continue
            for j in range(min(first_useful, len(table))):
                if table[j] != NULL_BLOCK:
                    self.pool.release([table[j]])
                    table[j] = NULL_BLOCK

    def _free(self, req: DemoRequest) -> None:
        for table in req.block_tables:
            self.pool.release(table)
        req.block_tables = []
