"""Checks for exercise 19: the scheduler side of a KV connector
(``core/scheduler_kv_connector.py``: ``plan_kv_load`` and ``release_finished_sends``)::

    block hashes        h0   h1   h2   h3 | last 2 tokens     (B = 4, 14 tokens)
    local prefix hit    h0                                     num_local_tokens = 4
    the store has       h0   h1   h2        h5
    plan_kv_load     ->      h1   h2                           KVLoadPlan(8, (1, 2), load_async=True)

    kv_sending  {a: blocks_a, b: blocks_b}   finished_sending {a}
    release_finished_sends -> [blocks_a]     kv_sending {b: blocks_b}   (b is still being sent)

Each exact case compares yours with the package's on the same inputs; when they differ,
``_diagnose_*`` names the rule yours breaks. The property drives both functions through a
small simulation of the scheduler under random arrivals (a local prefix cache, a store,
loads that take a step, sends that take a few) and checks, besides equality with the
package's answers, the three things a wrong scheduler side does: load blocks the local
prefix cache already holds, schedule a request before its load finished, free a block
still being sent (or free it twice).
"""

from __future__ import annotations

import logging
import random

from microvllm.checks.report import Case, CheckFailure, CheckResult, not_implemented_message, run_checks
from microvllm.core.kv_cache_utils import hash_new_full_blocks

B = 4

HINT_LOCAL = ("start at the first block past the local hit, block num_local_tokens // block_size: the blocks before "
              "it are in the local prefix cache already (loading them again copies KV the request already has, into "
              "blocks the scheduler must allocate twice)")
HINT_LAST = ("stop before the block that holds the last token, block (num_tokens - 1) // block_size: the last token "
             "is always computed, because its logits give the first new token (a prompt of exactly 4 blocks loads "
             "at most 3)")
HINT_MISS = ("stop at the first block the store lacks: block_hashes[k] covers blocks 0..k, so a block after a miss "
             "cannot be used (its KV was computed after a prefix this request does not have in the cache)")
HINT_ASYNC = ("load_async must be True whenever there are blocks to load: the request waits in "
              "WAITING_FOR_REMOTE_KVS until the worker reports the load finished; with False the scheduler would "
              "admit it now and the forward would read blocks not loaded yet. With nothing to load it is False")
HINT_TOKENS = "num_external_tokens is len(block_indices) * block_size: whole blocks only"
HINT_SENDING = ("free only the requests listed in finished_sending: the others are still being sent, and a freed block "
                "can be handed to another request (and overwritten) while the worker still reads it")
HINT_TWICE = ("take each freed entry out of kv_sending (kv_sending.pop(request_id, None)): a second report of the same "
              "request must free nothing, or its blocks are freed twice (their reference counts go below zero)")
HINT_UNKNOWN = ("a reported request that kv_sending does not hold (never delayed, or freed already) frees nothing: "
                "append only what kv_sending.pop(request_id, None) found, never its None (the scheduler would free "
                "None as if it were a block list)")
HINT_ORDER = "return the block lists in the order of sorted(finished_sending), the package's order"


def make_hashes(num_tokens: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    hashes: list = []
    hash_new_full_blocks(hashes, [rng.randrange(3, 500) for _ in range(num_tokens)], B)
    return hashes


def _reference_plan(*args):
    from microvllm.core.scheduler_kv_connector import plan_kv_load

    return plan_kv_load(*args)


def _reference_release(kv_sending, finished):
    from microvllm.core.scheduler_kv_connector import release_finished_sends

    return release_finished_sends(kv_sending, finished)


def _names(hashes) -> dict:
    return {h: f"h{i}" for i, h in enumerate(hashes)}


def _describe_plan(hashes, num_tokens, num_local, remote_has) -> str:
    names = _names(hashes)
    held = [names.get(h, "another") for h in hashes if h in remote_has]
    return (f"block_hashes = [{' '.join(names.values())}], num_tokens={num_tokens}, num_local_tokens={num_local}, "
            f"block_size={B}, the store has [{' '.join(held)}]")


def _diagnose_plan(got, want, num_tokens, num_local) -> str:
    indices = list(getattr(got, "block_indices", ()))
    if any(i < num_local // B for i in indices):
        return HINT_LOCAL
    if any(i >= (num_tokens - 1) // B for i in indices):
        return HINT_LAST
    if indices != list(want.block_indices) and len(indices) > len(want.block_indices):
        return HINT_MISS
    if indices and not getattr(got, "load_async", True):
        return HINT_ASYNC
    if getattr(got, "num_external_tokens", None) != len(indices) * B:
        return HINT_TOKENS
    if bool(getattr(got, "load_async", False)) != bool(indices):
        return HINT_ASYNC
    return ("take the blocks from num_local_tokens // block_size on, while the store has their hash, up to the "
            "block before the last token's")


def compare_plan(fn, hashes, num_tokens, num_local, remote_has, where: str):
    got = fn(list(hashes), num_tokens, num_local, B, remote_has)
    want = _reference_plan(list(hashes), num_tokens, num_local, B, remote_has)
    fields = ("num_external_tokens", "block_indices", "load_async")
    if not all(hasattr(got, f) for f in fields):
        raise CheckFailure(f"{where}: plan_kv_load must return a KVLoadPlan",
                           input=_describe_plan(hashes, num_tokens, num_local, remote_has), got=repr(got),
                           hint="return KVLoadPlan(num_external_tokens, tuple(block_indices), load_async)")
    mine = (got.num_external_tokens, tuple(got.block_indices), bool(got.load_async))
    if mine != (want.num_external_tokens, want.block_indices, want.load_async):
        raise CheckFailure(f"{where}: plan_kv_load returned {mine}, expected {want}",
                           input=_describe_plan(hashes, num_tokens, num_local, remote_has), expected=repr(want),
                           got=repr(got), hint=_diagnose_plan(got, want, num_tokens, num_local))
    return got


def compare_release(fn, kv_sending: dict, finished, where: str) -> list:
    before = dict(kv_sending)
    mine_dict, want_dict = dict(kv_sending), dict(kv_sending)
    got = fn(mine_dict, set(finished) if finished is not None else None)
    want = _reference_release(want_dict, set(finished) if finished is not None else None)
    description = f"kv_sending = {before}, finished_sending = {finished}"
    got_list = list(got) if got is not None else None
    if got_list == want and mine_dict == want_dict:
        kv_sending.clear()
        kv_sending.update(mine_dict)
        return got_list
    reported = set(finished or ())
    if got_list is not None and any(b is None for b in got_list):
        hint = HINT_UNKNOWN
    elif got_list is not None and any(b not in [before[r] for r in reported if r in before] for b in got_list):
        hint = HINT_SENDING
    elif mine_dict != want_dict:
        hint = HINT_TWICE
    elif got_list is not None and sorted(map(str, got_list)) == sorted(map(str, want)):
        hint = HINT_ORDER
    else:
        hint = "free the block lists of the reported requests that kv_sending holds, each once"
    raise CheckFailure(f"{where}: release_finished_sends returned {got_list} leaving kv_sending {mine_dict}",
                       input=description, expected=f"{want}, leaving kv_sending {want_dict}",
                       got=f"{got_list}, leaving kv_sending {mine_dict}", hint=hint)


# --------------------------------------------------------------------- the simulation


def simulate(plan_kv_load, release_finished_sends, *, seed: int, num_requests: int = 12,
             where: str = "random arrivals") -> dict:
    """A scheduler in miniature, driving both functions: requests arrive (a few shared
    prefixes + their own tail), the local prefix cache and the store hold block hashes,
    a load takes one step, a send a random one to three, the worker reports sends (some
    twice). Checks every answer against the package's and the three rules; returns counts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.choice((8, 12, 16)))] for _ in range(3)]
    local: set = set()      # hashes in the local prefix cache
    store: set = set()      # hashes in the second tier / remote side
    loading: dict[str, tuple[int, tuple]] = {}   # request -> (step its load is reported, hashes)
    sending_until: dict[str, int] = {}           # request -> step its send is reported
    kv_sending: dict[str, tuple] = {}            # request -> its "blocks" (block ids)
    block_owner: dict[int, str] = {}             # block id -> request still sending it
    next_block = 1
    counts = {"loads": 0, "blocks_loaded": 0, "freed": 0, "steps": 0}
    arrivals = sorted(rng.randrange(0, 3 * num_requests) for _ in range(num_requests))
    waiting: list[tuple[str, list[int]]] = []
    for step in range(4 * num_requests + 10):
        counts["steps"] += 1
        for index, when in enumerate(arrivals):
            if when == step:
                tokens = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(0, 7))]
                waiting.append((f"r{index}", tokens))
        # the worker's report for this step: loads done, sends done (some reported again)
        done_loads = [r for r, (until, _) in loading.items() if until <= step]
        for request_id in done_loads:
            _, hashes = loading.pop(request_id)
            local.update(hashes)
        reported = {r for r, until in sending_until.items() if until <= step}
        again = f"r{rng.randrange(num_requests)}"
        if rng.random() < 0.3 and again not in sending_until:
            reported.add(again)   # a second report, or one for a request never delayed
        freed = compare_release(release_finished_sends, kv_sending, sorted(reported), f"{where} (seed {seed}), "
                                f"step {step}")
        for blocks in freed:
            for block in blocks:
                owner = block_owner.pop(block, None)
                if owner is None:
                    raise CheckFailure(f"{where}: block {block} freed twice", hint=HINT_TWICE)
                if sending_until.get(owner, 0) > step:
                    raise CheckFailure(f"{where}: block {block} of {owner} freed while it is still being sent",
                                       hint=HINT_SENDING)
            counts["freed"] += 1
        for request_id in reported:
            sending_until.pop(request_id, None)
        # schedule: each waiting request not loading asks for its plan; no load -> it runs and finishes
        for request_id, tokens in list(waiting):
            if request_id in loading:
                continue
            hashes: list = []
            hash_new_full_blocks(hashes, tokens, B)
            num_local = 0
            while num_local // B < len(hashes) and hashes[num_local // B] in local and num_local + B < len(tokens):
                num_local += B
            plan = compare_plan(plan_kv_load, hashes, len(tokens), num_local, store,
                                f"{where} (seed {seed}), step {step}, {request_id}")
            if any(i < num_local // B for i in plan.block_indices):
                raise CheckFailure(f"{where}: {request_id} loads blocks the local prefix cache holds", hint=HINT_LOCAL)
            if plan.block_indices:
                if not plan.load_async:
                    raise CheckFailure(f"{where}: {request_id} would be scheduled before its load finished",
                                       hint=HINT_ASYNC)
                loading[request_id] = (step + 1, tuple(hashes[i] for i in plan.block_indices))
                counts["loads"] += 1
                counts["blocks_loaded"] += len(plan.block_indices)
                continue
            waiting.remove((request_id, tokens))
            local.update(hashes)
            if rng.random() < 0.3 and len(store) > 4:   # the store evicts too: holes in its chains
                store.difference_update(rng.sample(sorted(store, key=str), 2))
            if rng.random() < 0.6:   # the pool evicts: some blocks go (the store keeps them)
                local.difference_update(rng.sample(sorted(local, key=str), (2 * len(local)) // 3))
            new = [h for h in hashes if h not in store]
            if new:   # finished: its blocks are saved, the free delayed until the send is reported
                store.update(new)
                blocks = tuple(range(next_block, next_block + len(new)))
                next_block += len(new)
                kv_sending[request_id] = blocks
                for block in blocks:
                    block_owner[block] = request_id
                sending_until[request_id] = step + rng.randrange(1, 4)
    return counts


# --------------------------------------------------------------------- the checks


def the_contract_example(plan_kv_load) -> None:
    """The contract's picture as a case (the checker's first, and the engine cell's pre-check:
    the same store, so that the two never disagree)."""
    h, other = make_hashes(16), make_hashes(8, seed=9)   # 16 tokens: 4 full blocks h0..h3
    compare_plan(plan_kv_load, h, 14, 4, {h[0], h[1], h[2], other[1]},
                 "the docstring's example (14 tokens, local hit h0, the store has h0 h1 h2)")


def check_kv_connector(plan_kv_load, release_finished_sends, *, num_seeds: int = 20,
                       quiet: bool = False) -> CheckResult:
    """Check your ``plan_kv_load`` and ``release_finished_sends``; print and return the result."""
    h = make_hashes(16)            # a prompt of 16 tokens: 4 full blocks h0..h3
    other = make_hashes(8, seed=9)

    def the_example():
        the_contract_example(plan_kv_load)

    def nothing_to_load():
        compare_plan(plan_kv_load, h, 18, 0, set(other), "the store has none of the request's blocks")
        compare_plan(plan_kv_load, h, 18, 16, set(h), "the local hit covers every full block: nothing left")
        compare_plan(plan_kv_load, [], 3, 0, set(h), "a prompt shorter than one block")

    def not_what_is_local():
        compare_plan(plan_kv_load, h, 18, 8, set(h), "local hit h0 h1, the store has all four: load h2 h3 only")

    def never_the_last_token():
        compare_plan(plan_kv_load, h, 16, 0, set(h), "a prompt of exactly 4 blocks, all stored: 3 blocks, the "
                                                     "last token's block is computed")
        compare_plan(plan_kv_load, h[:2], 9, 4, set(h), "9 tokens, local hit h0: h1 only")

    def a_miss_ends_the_run():
        compare_plan(plan_kv_load, h, 18, 0, {h[0], h[2], h[3]}, "the store lost h1: h0 only")
        compare_plan(plan_kv_load, h, 18, 4, {h[0], h[2], h[3]}, "local hit h0, the store lost h1: nothing")

    def only_reported_sends():
        compare_release(release_finished_sends, {"a": (3, 4), "b": (5,)}, ["a"],
                        "a finished its send; b is still being sent")
        compare_release(release_finished_sends, {"a": (2,)}, None, "no report this step")

    def never_delayed_frees_nothing():
        compare_release(release_finished_sends, {"a": (2,)}, ["z"],
                        "z reported, a request kv_sending never held: nothing to free")

    def each_send_once():
        sending = {"a": (3, 4)}
        compare_release(release_finished_sends, sending, ["a"], "a reported")
        compare_release(release_finished_sends, sending, ["a"], "a reported a second time: nothing more to free")

    def in_request_id_order():
        compare_release(release_finished_sends, {"b": (1,), "a": (2,)}, ["b", "a", "z"],
                        "two reported (and z, never delayed): both freed, in request-id order")

    def random_arrivals():
        for seed in range(num_seeds):
            simulate(plan_kv_load, release_finished_sends, seed=seed)

    cases = [
        Case("the docstring's example: the stored blocks past the local hit", the_example),
        Case("nothing to load: load_async False", nothing_to_load),
        Case("never a block the local prefix cache holds", not_what_is_local),
        Case("never the block of the last token", never_the_last_token),
        Case("the first block the store lacks ends the load", a_miss_ends_the_run),
        Case("the delayed free: only the reported sends", only_reported_sends),
        Case("a reported request kv_sending does not hold frees nothing", never_delayed_frees_nothing),
        Case("each send freed once: a second report frees nothing", each_send_once),
        Case("several reported: freed in request-id order", in_request_id_order),
        Case(f"property: {num_seeds} random arrival patterns through a small scheduler (no local block loaded, "
             "nothing scheduled before its load, no block freed while sent or twice)", random_arrivals),
    ]
    return run_checks("plan_kv_load and release_finished_sends", cases, quiet=quiet)


# --------------------------------------------------------------------- the engine

PREFIX_LEN, NUM_PROMPTS = 48, 12
PREFIX_ORDER = (0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1)   # prefix 4 comes once, and pushes part of the tier out
SUFFIX_LENS = (5, 8, 0)   # 0 and 8 end on a block boundary: the last token's block is a full one
NUM_CPU_BLOCKS = 33       # the tier's slots, fewer than the 30 prefix blocks + the prompts' own: it evicts (LRU)
NEVER_DELAYED = "never-delayed"   # a request id the scheduler never saw, added to every report of finished sends


def kv_tier_prompts() -> list[dict]:
    """The engine cell's workload: prefixes of 48 tokens in ``PREFIX_ORDER`` (four that come
    back, one that comes once), each + 5, 8 or 0 tokens of its own (8 and 0 end on a block
    boundary), and last the previous prompt again (every block but its last token's is in the
    pool: nothing to load). Between a prefix's visits the pool loses it, and the tier, which
    evicts its least recently used blocks, may keep only part of it: a gap in the tier."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 200) for _ in range(PREFIX_LEN)] for _ in range(max(PREFIX_ORDER) + 1)]
    prompts = [{"prompt_token_ids": prefixes[prefix] + [rng.randrange(3, 200) for _ in range(SUFFIX_LENS[i % 3])]}
               for i, prefix in enumerate(PREFIX_ORDER)]
    return prompts + [prompts[-1]]


def _watched(plan_kv_load, release_finished_sends, seen: dict):
    """The two functions as the engine calls them, with what the calls were (``seen``):
    plans past a gap in the tier, plans with every block local, reports of finished sends;
    and two answers the engine cannot tell from the right one, or only by crashing: a wait
    with nothing to load, a None in the freed lists. Each report gets ``NEVER_DELAYED``
    added (in the package's run too: the same workload)."""
    def plan(block_hashes, num_tokens, num_local_tokens, block_size, remote_has):
        seen["plan_kv_load"] += 1
        first = num_local_tokens // block_size
        wanted = block_hashes[first:(num_tokens - 1) // block_size]
        held = [block_hash in remote_has for block_hash in wanted]
        if False in held and True in held[held.index(False):]:
            seen["gaps"] += 1        # the tier lacks a block and holds a later one
        if not wanted:
            seen["all_local"] += 1   # every block but the last token's is local already
        answer = plan_kv_load(block_hashes, num_tokens, num_local_tokens, block_size, remote_has)
        indices = tuple(getattr(answer, "block_indices", ()))
        if indices != tuple(range(first, first + len(indices))):
            seen["not_in_a_row"] += 1
        if not getattr(answer, "num_external_tokens", 1) and getattr(answer, "load_async", False):
            seen["waits_for_nothing"] += 1
        return answer

    def release(kv_sending, finished_sending):
        seen["release_finished_sends"] += 1
        if finished_sending is not None:
            seen["reports"] += 1
            finished_sending = {*finished_sending, NEVER_DELAYED}
        freed = release_finished_sends(kv_sending, finished_sending)
        freed = list(freed) if freed is not None else None   # a generator is read once: here, for the engine
        if any(blocks is None for blocks in freed or ()):
            seen["freed_none"] += 1
        return freed

    return plan, release


def run_kv_tier_with(plan_kv_load, release_finished_sends, *, quiet: bool = False):
    """Run the engine on a tiny random Llama (written to a temporary folder) with the
    in-process ``OffloadingConnector`` (a second KV tier), a pool too small for the shared
    48-token prefixes and a tier that evicts too (``kv_tier_prompts``), prompts one after
    another: once with the package's scheduler side, once with yours in its place in
    ``microvllm.core.scheduler_kv_connector`` (put back afterwards, even on an error). Every
    report of finished sends also names ``NEVER_DELAYED``, a request the scheduler never
    delayed. Compares the greedy tokens, the prefix hits and the blocks the tier loaded,
    counts the calls to yours, and says where your plan asked a request to wait with nothing
    to load (``load_async=True``), which this engine ignores. Returns an ``EngineRunResult``."""
    import tempfile

    import microvllm.core.scheduler_kv_connector as module
    from microvllm import LLM, SamplingParams
    from microvllm.checks.engine_run import EngineRunResult, _quiet
    from microvllm.models.tiny import make_tiny_model

    def report(same, reference, yours, message):
        if not quiet:
            print(message)
        return EngineRunResult(same, reference, yours, message)

    try:   # a part not written yet is said in one line, before the engine starts
        the_contract_example(plan_kv_load)
        compare_release(release_finished_sends, {"a": (3, 4), "b": (5,)}, ["a"],
                        "a finished its send; b is still being sent")
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        todo = not_implemented_message(exc)
        return report(False, [], [], f"run_kv_tier_with: not implemented yet ({todo})" if todo is not None else
                      f"your scheduler side fails the docstring's example: {exc} (run check_kv_connector above)")

    prompts = kv_tier_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": NUM_CPU_BLOCKS}}
    package = (module.plan_kv_load, module.release_finished_sends)

    def generate(folder, functions, seen):
        module.plan_kv_load, module.release_finished_sends = _watched(*functions, seen)
        # A connector call that raises fails its request (fault isolation), quietly here:
        # the first such error is re-raised, so that the report names the learner's bug.
        isolation_log = logging.getLogger("microvllm.core.scheduler_kv_connector")
        level, isolation_log.level = isolation_log.level, logging.CRITICAL
        try:
            with _quiet():
                llm = LLM(folder, block_size=8, num_kv_blocks=20, max_num_seqs=2, kv_transfer_config=tier,
                          debug_invariants=True)
            outs = [out for p in prompts for out in llm.generate([p], params, use_tqdm=False)]
        finally:
            isolation_log.setLevel(level)
            module.plan_kv_load, module.release_finished_sends = package
        errors = [out.error for out in outs if out.error is not None]
        if errors:
            raise RuntimeError(errors[0])
        engine = llm.llm_engine
        return ([list(out.outputs[0].token_ids) for out in outs], engine.prefix_cache_hits,
                engine.scheduler.connector.num_blocks_loaded)

    def counters():
        return dict.fromkeys(("plan_kv_load", "release_finished_sends", "gaps", "all_local", "reports",
                              "not_in_a_row", "waits_for_nothing", "freed_none"), 0)

    workload, seen = counters(), counters()
    with tempfile.TemporaryDirectory(prefix="microvllm-kv-tier-") as folder:
        with _quiet():
            make_tiny_model(folder, "llama", seed=19)
        reference, ref_hits, ref_loaded = generate(folder, package, workload)
        try:
            got, hits, loaded = generate(folder, (plan_kv_load, release_finished_sends), seen)
        except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
            return report(False, reference, [], f"The engine stopped inside your scheduler side: "
                                                f"{type(exc).__name__}: {exc}{_why_stopped(seen)} (run "
                                                "check_kv_connector above, which names the first rule yours breaks)")
    lines = [f"A tiny random Llama, a pool of 19 blocks of 8 tokens, the OffloadingConnector tier of {NUM_CPU_BLOCKS} "
             f"blocks; {NUM_PROMPTS} prompts one after another: {PREFIX_LEN}-token prefixes (four that come back after "
             "the pool lost them, one that comes once) + 0, 5 or 8 tokens, the last prompt twice "
             f"({seen['plan_kv_load']} calls to your plan_kv_load, {seen['release_finished_sends']} to your "
             "release_finished_sends)",
             f"  the calls: {workload['gaps']} plans past a gap in the tier (a block missing, a later one held), "
             f"{workload['all_local']} with every block local (nothing to load), {workload['reports']} reports of "
             f"finished sends, each also naming {NEVER_DELAYED!r}, a request the scheduler never delayed",
             f"  prefix-cache hit tokens: yours {hits}, the package's {ref_hits}; tier blocks loaded: yours {loaded}, "
             f"the package's {ref_loaded}",
             f"  greedy tokens: {'✓ identical' if got == reference else '✗ different'}"]
    same = got == reference and hits == ref_hits and loaded == ref_loaded
    called = seen["plan_kv_load"] > 0 and seen["release_finished_sends"] > 0
    if not called:
        lines.append("✗ The engine never called one of your functions.")
    elif seen["waits_for_nothing"]:
        lines.append(f"✗ {seen['waits_for_nothing']} of your plans offered nothing and said load_async=True. This "
                     "engine starts a load only when tokens are offered, so its tokens cannot show it; a scheduler "
                     "that honours load_async would park the request in WAITING_FOR_REMOTE_KVS, waiting for a load "
                     "that never comes. Nothing to load is KVLoadPlan(0, (), False).")
    elif same:
        lines.append("✓ Same greedy tokens, prefix-cache hits and tier loads as the package's scheduler side. (The "
                     "order of the block lists release_finished_sends returns makes no difference to the engine: "
                     "check_kv_connector checks it.)")
    else:
        lines.append("✗ Yours differs from the package's: run check_kv_connector above, which names the first rule "
                     "yours breaks.")
    return report(same and called and not seen["waits_for_nothing"], reference, got, "\n".join(lines))


def _why_stopped(seen: dict) -> str:
    """What yours answered that stops the engine, where the engine's own error does not say it."""
    if seen["freed_none"]:
        return (f". Your release_finished_sends returned None among the freed block lists (for {NEVER_DELAYED!r}, "
                "a reported request kv_sending does not hold), and the scheduler freed it as blocks")
    if seen["not_in_a_row"]:
        return (". Your plan skipped a block and offered later ones: the connector loads the blocks in a row from the "
                "local hit, so it looked for the skipped block in the tier, which lacks it")
    return ""
