"""Compare two engine traces step by step: yours against the reference's.

    first_difference(reference, yours, who="your scheduler", blocks=False)
        -> None, or (lines, hint): the first step where they differ, in words

Checked at every step, in this order (the first problem found is the one reported):

    1. limits        at most max_num_seqs requests, at most max_num_batched_tokens tokens
    2. preemptions   the same requests preempted
    3. the plan      the same requests, each with the same number of tokens and prefix hit
    4. blocks        (blocks=True) the same block tables, free blocks and cached blocks
                     at the end of the step

The engine is deterministic and its scheduler has one rule, so with the same settings
and prompts a correct component makes exactly the reference's decisions.
"""

from __future__ import annotations

from microvllm.checks.report import CheckFailure
from microvllm.trace import StepTrace, Trace

HINT_SEATS = "admit a waiting request only while len(self.running) < self.max_num_seqs"
HINT_BUDGET = ("subtract every scheduled request's tokens from token_budget and cap each request's new "
               "tokens at what is left (self._cap_new_tokens does the capping)")
HINT_VICTIM = ("when allocate_slots returns None, preempt the most recently admitted running request: "
               "victim = self.running.pop(); self._preempt(victim)")
HINT_NO_ADMIT = "a step that preempted admits no waiting request (it would just take the blocks back)"
HINT_HITS = ("a new request starts after its prefix-cache hit: hit_blocks, num_hit_tokens = "
             "kv_cache_manager.get_computed_blocks(request), then allocate_slots(request, n, num_hit_tokens, "
             "hit_blocks)")
HINT_HITS_POOL = ("which cached blocks are still there to hit depends on the pool: get_new_blocks() evicts "
                  "the least recently freed block first, free_blocks() keeps the hash, touch() revives a hit")
HINT_HITS_MANAGER = ("get_computed_blocks() returns the longest run of cached full blocks from the start, "
                     "never covering the last token (search num_tokens - 1 tokens)")
HINT_PLAN = ("running requests first (oldest first, each as many tokens as the budget allows), then waiting "
             "requests first come first served while budget, seats and blocks last")
HINT_BLOCKS = ("get_new_blocks() pops the least recently freed blocks (the head of the free queue); "
               "free_blocks() appends blocks reaching 0 to the tail, in the order given, and keeps their hash")


def _key(request_id: str):
    return (0, int(request_id), "") if request_id.isdigit() else (1, 0, request_id)


def _requests(ids) -> str:
    ids = sorted(ids, key=_key)
    if not ids:
        return "nothing"
    return ("request " if len(ids) == 1 else "requests ") + ", ".join(ids)


def describe_plan(step: StepTrace) -> str:
    """One step's plan in words: 'request 0: 1 decode token; request 2: 14 prefill tokens (16 hit)'."""
    parts = []
    for r in sorted(step.scheduled, key=lambda r: _key(r.request_id)):
        n = r.num_scheduled_tokens
        what = "1 decode token" if r.kind == "decode" else f"{n} prefill token{'s' if n != 1 else ''}"
        if r.is_new and r.prefix_hit_tokens:
            what += f" after a {r.prefix_hit_tokens}-token prefix hit"
        parts.append(f"request {r.request_id}: {what}")
    return "; ".join(parts) or "nothing scheduled"


def _plan(step: StepTrace) -> dict[str, tuple[int, int]]:
    return {r.request_id: (r.num_scheduled_tokens, (r.prefix_hit_tokens or 0) if r.is_new else 0)
            for r in step.scheduled}


def _broken_limit(index: int, who: str, num_requests: int, num_tokens: int, max_num_seqs: int,
                  max_num_batched_tokens: int):
    """(message, hint) for the first limit a step's plan breaks, else None."""
    if num_requests > max_num_seqs:
        return f"step {index}: {who} ran {num_requests} requests, max_num_seqs={max_num_seqs}", HINT_SEATS
    if num_tokens > max_num_batched_tokens:
        return (f"step {index}: {who} scheduled {num_tokens} tokens, "
                f"max_num_batched_tokens={max_num_batched_tokens}", HINT_BUDGET)
    return None


def check_limits(step: StepTrace, index: int, who: str, max_num_seqs: int, max_num_batched_tokens: int):
    """(lines, hint) if the step broke max_num_seqs or the token budget, else None."""
    broken = _broken_limit(index, who, len(step.scheduled), step.num_scheduled_tokens, max_num_seqs,
                           max_num_batched_tokens)
    if broken is None:
        return None
    message, hint = broken
    return [message, f"  yours: {describe_plan(step)}"], hint


def _compare_step(ref: StepTrace, yours: StepTrace, index: int, who: str, blocks: bool, hits_hint: str):
    if set(ref.preempted) != set(yours.preempted):
        lines = [f"step {index}: {who} preempted {_requests(yours.preempted)}; the reference preempts "
                 f"{_requests(ref.preempted)}"]
        hint = HINT_VICTIM if ref.preempted and yours.preempted else HINT_PLAN
        return lines + [f"  reference: {describe_plan(ref)}", f"  yours:     {describe_plan(yours)}"], hint
    ref_plan, your_plan = _plan(ref), _plan(yours)
    if ref_plan != your_plan:
        lines = [f"step {index}: {who} planned a different batch than the reference",
                 f"  reference: {describe_plan(ref)}", f"  yours:     {describe_plan(yours)}"]
        new = {r.request_id for r in yours.scheduled if r.is_new}
        if yours.preempted and new:
            return lines, HINT_NO_ADMIT
        hits = {rid for rid in set(ref_plan) & set(your_plan) if ref_plan[rid][1] != your_plan[rid][1]}
        return lines, hits_hint if hits else HINT_PLAN
    if blocks:
        return _compare_blocks(ref, yours, index, who)
    return None


def _compare_blocks(ref: StepTrace, yours: StepTrace, index: int, who: str):
    for rid in sorted(set(ref.block_tables) | set(yours.block_tables), key=_key):
        ref_table, your_table = ref.block_tables.get(rid), yours.block_tables.get(rid)
        if ref_table != your_table:
            def show(t):
                return t[0] if t is not None and len(t) == 1 else t

            return ([f"after step {index}: request {rid} holds blocks {show(your_table)} with {who}; "
                     f"with the reference it holds {show(ref_table)}"], HINT_BLOCKS)
    ref_free = [b for b, free in enumerate(ref.free) if free]
    your_free = [b for b, free in enumerate(yours.free) if free]
    if ref_free != your_free:
        return ([f"after step {index}: the free blocks are {your_free} with {who}; with the reference "
                 f"they are {ref_free}"], HINT_BLOCKS)
    ref_cached = [b for b, h in enumerate(ref.block_hashes) if h is not None]
    your_cached = [b for b, h in enumerate(yours.block_hashes) if h is not None]
    if ref_cached != your_cached:
        def are(ids):
            return "no block is" if not ids else f"block {ids[0]} is" if len(ids) == 1 else f"blocks {ids} are"
        return ([f"after step {index}: {are(your_cached)} cached with {who}; with the reference "
                 f"{are(ref_cached)} (a cached block carries its hash until it is reused)"], HINT_BLOCKS)
    return None


def first_difference(reference: Trace, yours: Trace, *, who: str, blocks: bool = False,
                     check_limits_too: bool = True, partial: bool = False, hits_hint: str = HINT_HITS):
    """The first step where ``yours`` breaks a limit or differs from ``reference``:
    (lines, hint), or None when every step matches. ``partial``: ``yours`` stopped early
    (it crashed), so only the steps it has are compared. ``hits_hint``: what to look at when
    a request's prefix hit differs (it depends on the component under test)."""
    for index, your_step in enumerate(yours.steps):
        if check_limits_too:
            broken = check_limits(your_step, index, who, reference.max_num_seqs, reference.max_num_batched_tokens)
            if broken:
                return broken
        if index >= len(reference.steps):
            return ([f"{who} needed more than the reference's {len(reference.steps)} steps"], HINT_PLAN)
        found = _compare_step(reference.steps[index], your_step, index, who, blocks, hits_hint)
        if found:
            return found
    if len(yours.steps) < len(reference.steps) and not partial:
        return ([f"{who} finished in {len(yours.steps)} steps; the reference needs {len(reference.steps)}"],
                HINT_PLAN)
    return None


def watch_scheduler(scheduler_class: type) -> type:
    """A subclass of ``scheduler_class`` whose ``schedule()`` checks its plan's limits before
    the model runs it, so a plan that breaks them is reported as such (the runner would
    otherwise fail on it with an error about tensor shapes)."""
    class Watched(scheduler_class):
        def schedule(self):
            plan = super().schedule()
            index = getattr(self, "_watched_steps", 0)
            self._watched_steps = index + 1
            tokens = dict(plan.num_scheduled_tokens)
            broken = _broken_limit(index, "your scheduler", len(tokens), sum(tokens.values()),
                                   self.max_num_seqs, self.max_num_batched_tokens)
            if broken is not None:
                yours = "; ".join(f"request {rid}: {n} token{'s' if n != 1 else ''}"
                                  for rid, n in sorted(tokens.items(), key=lambda item: _key(item[0])))
                raise CheckFailure(broken[0], got=yours, hint=broken[1])
            return plan

    Watched.__name__ = Watched.__qualname__ = scheduler_class.__name__
    Watched.__module__ = scheduler_class.__module__
    return Watched
