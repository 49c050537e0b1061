"""Checks for exercise 20: the prefix-aware router's choice (``router/prefix_aware.py``)::

    request.block_hashes      h0   h1   h2   h3
    replica 0 holds           h0   h1                 matches 2 blocks   load 3
    replica 1 holds           h0   h1   h2      h9    matches 3 blocks   load 5   <- chosen
    replica 2 holds                h1   h2   h3       matches 0 blocks   load 1

The answer is fixed by the contract, so each case compares yours with the package's
``choose_prefix_replica`` (replica and matched blocks; the reason is yours to word). When
they differ, ``_diagnose`` recomputes the case the ways the usual mistakes would (counting
past the first missing block, matching each block's own tokens instead of the chained
hashes, ``>=`` for ``>`` or ``or`` for ``and`` in the overload test, leaving load out) and
names the one yours agrees with. The hand cases come one rule at a time, so the first one
that fails points at one mistake; the docstring's example, which mixes them, comes after.
"""

from __future__ import annotations

from collections.abc import Sequence

from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    not_implemented_message,
    property_settings,
    run_checks,
    run_property,
)
from microvllm.core.kv_cache_utils import BlockHash, hash_block_tokens, hash_new_full_blocks
from microvllm.router.policy import Choice, ReplicaState, RoutedRequest

BLOCK_SIZE = 4
ABS, REL = 4, 1.5   # the package's defaults: balance_abs_threshold, balance_rel_threshold

HINT_CHAIN = ("stop counting at the first block the replica does not hold: request.block_hashes[k] covers every "
              "block before it, so block k is a hit only if blocks 0..k-1 are too (the engine's "
              "find_longest_cache_hit stops at its first miss). Break out of the loop at a miss; do not count "
              "the hashes found further on")
HINT_TEXT = ("match request.block_hashes as they are: they are the engine's chained hashes (each covers its parent's "
             "hash and its own tokens), the same keys the replicas cache. Hashing each block's tokens on its own "
             "(or comparing the prompt's text) only finds the first block, and counts blocks whose tokens are "
             "equal after a different prefix")
HINT_LOAD = ("load matters in three places: among replicas matching the same number of blocks, take the less loaded "
             "(load, then kv_cache_usage, then index); when no replica matches, take least_loaded_replica(replicas); "
             "and when the best match is overloaded (best.load - least.load > balance_abs_threshold and best.load > "
             "balance_rel_threshold * least.load), take the least loaded instead")
HINT_MATCHED = ("Choice.matched_blocks is the number of the prompt's leading blocks the *chosen* replica holds: "
                "for the least loaded replica (no match, or the best one overloaded) its own count, often 0")
HINT_AND = ("overloaded takes both thresholds crossed: best.load - least.load > balance_abs_threshold *and* "
            "best.load > balance_rel_threshold * least.load. Join the two comparisons with and, not or: a best match "
            "a few requests busier than an idle replica, or far busier than a busy one by a small factor, keeps "
            "the request")
HINT_STRICT = ("the thresholds are strict: best.load - least.load > balance_abs_threshold and best.load > "
               "balance_rel_threshold * least.load, with >, not >=. A difference of exactly balance_abs_threshold "
               "requests, or a load of exactly balance_rel_threshold times the least loaded's, is not overloaded: "
               "the best match keeps the request")


def _reference(request, replicas, abs_threshold=ABS, rel_threshold=REL) -> Choice:
    from microvllm.router.prefix_aware import choose_prefix_replica

    return choose_prefix_replica(request, replicas, balance_abs_threshold=abs_threshold,
                                 balance_rel_threshold=rel_threshold)


def _count(hashes: Sequence[BlockHash], cached, *, stop_at_miss: bool = True) -> int:
    if not stop_at_miss:
        return sum(h in cached for h in hashes)
    count = 0
    for h in hashes:
        if h not in cached:
            break
        count += 1
    return count


def _unchained(request: RoutedRequest) -> list[BlockHash]:
    """Each block's tokens hashed alone (no parent): what matching the text block by block gives."""
    tokens, size = request.prompt_token_ids, request.block_size
    return [hash_block_tokens(None, tokens[i:i + size]) for i in range(0, len(request.block_hashes) * size, size)]


def _overloaded(best: ReplicaState, least: ReplicaState, abs_threshold, rel_threshold, test: str) -> bool:
    """The overload test as written (``"and"``), and as the usual slips write it."""
    over_abs = best.load - least.load > abs_threshold
    over_rel = best.load > rel_threshold * least.load
    if test == "or":
        return over_abs or over_rel
    if test in (">=", ">= abs"):
        over_abs = best.load - least.load >= abs_threshold
    if test in (">=", ">= rel"):
        over_rel = best.load >= rel_threshold * least.load
    return test != "none" and over_abs and over_rel


def _choose_with(counts: dict[int, int], replicas, abs_threshold, rel_threshold, *, ties_by_load: bool = True,
                 fallback: bool = True, test: str = "and") -> tuple[int, int]:
    """(replica, its matched blocks) by the contract, given ``counts``, with one rule changed."""
    if ties_by_load:
        best = min(replicas, key=lambda r: (-counts[r.index], r.load, r.kv_cache_usage, r.index))
    else:
        best = min(replicas, key=lambda r: (-counts[r.index], r.index))
    least = min(replicas, key=lambda r: (r.load, r.kv_cache_usage, r.index))
    if fallback and (counts[best.index] == 0 or _overloaded(best, least, abs_threshold, rel_threshold, test)):
        return least.index, counts[least.index]
    return best.index, counts[best.index]


def _diagnose(got: Choice, want: Choice, request, replicas, abs_threshold, rel_threshold) -> str:
    counts = {r.index: _count(request.block_hashes, r.cached_block_hashes) for r in replicas}
    past_miss = {r.index: _count(request.block_hashes, r.cached_block_hashes, stop_at_miss=False) for r in replicas}
    text = {r.index: _count(_unchained(request), r.cached_block_hashes) for r in replicas}
    # Each usual mistake, as the choice it would make here; the first that agrees with yours names it.
    # The thresholds' slips come before "or": on a case where both explain yours, "or" was caught earlier
    # by a case with one threshold crossed and the other not.
    mistakes = [(HINT_CHAIN, past_miss, {}), (HINT_TEXT, text, {})]
    mistakes += [(HINT_STRICT, counts, {"test": test}) for test in (">=", ">= abs", ">= rel")]
    mistakes += [(HINT_AND, counts, {"test": "or"})]
    mistakes += [(HINT_LOAD, counts, rules) for rules in ({"ties_by_load": False, "fallback": False},
                                                          {"ties_by_load": False}, {"test": "none"})]
    predicted = [(hint, _choose_with(c, replicas, abs_threshold, rel_threshold, **rules))
                 for hint, c, rules in mistakes]
    predicted = [(hint, choice) for hint, choice in predicted if choice != (want.replica, want.matched_blocks)]
    for hint, choice in predicted:          # the same replica and the same count: the best evidence
        if choice == (got.replica, got.matched_blocks):
            return hint
    if got.replica == want.replica:
        return HINT_MATCHED
    for hint, (replica, _) in predicted:    # the same replica, another count
        if replica == got.replica:
            return hint
    return ("count each replica's matched blocks (stop at the first miss), take the most (ties: less loaded), and "
            "fall back to least_loaded_replica(replicas) when nothing matches or the best one is overloaded")


def _describe(request: RoutedRequest, replicas: Sequence[ReplicaState], abs_threshold, rel_threshold) -> str:
    names = {h: f"h{i}" for i, h in enumerate(request.block_hashes)}
    parts = [f"request.block_hashes = [{' '.join(names.values())}]"]
    for r in replicas:
        held = [names[h] for h in request.block_hashes if h in r.cached_block_hashes]
        size = getattr(r.cached_block_hashes, "__len__", None)
        others = size() - len(held) if size is not None else 0
        parts.append(f"replica {r.index}: holds [{' '.join(held)}]" + (f" (+{others} other)" if others else "")
                     + f", load {r.load} ({r.num_running} running, {r.num_waiting} waiting), "
                       f"kv_cache_usage {r.kv_cache_usage:.2f}")
    parts.append(f"balance_abs_threshold={abs_threshold}, balance_rel_threshold={rel_threshold}")
    return "; ".join(parts)


def compare(fn, request, replicas, where: str, abs_threshold=ABS, rel_threshold=REL) -> None:
    """Call ``fn``; raise a ``CheckFailure`` saying what differs from the package's choice and why."""
    got = fn(request, list(replicas), balance_abs_threshold=abs_threshold, balance_rel_threshold=rel_threshold)
    want = _reference(request, replicas, abs_threshold, rel_threshold)
    description = _describe(request, replicas, abs_threshold, rel_threshold)
    if not all(hasattr(got, name) for name in ("replica", "reason", "matched_blocks")):
        raise CheckFailure(f"{where}: choose_prefix_replica must return a Choice", input=description,
                           got=repr(got), hint="return Choice(replica.index, 'a reason in words', matched_blocks)")
    if not isinstance(got.reason, str) or not got.reason:
        raise CheckFailure(f"{where}: Choice.reason must say why, in words", input=description, got=repr(got.reason),
                           hint="e.g. f'holds {n} of {len(request.block_hashes)} blocks' or 'least loaded'")
    if (got.replica, got.matched_blocks) == (want.replica, want.matched_blocks):
        return
    raise CheckFailure(f"{where}: chose replica {got.replica} ({got.matched_blocks} matched blocks), expected "
                       f"replica {want.replica} ({want.matched_blocks} matched blocks)",
                       input=description, expected=f"Choice(replica={want.replica}, matched_blocks="
                                                   f"{want.matched_blocks}): {want.reason}",
                       got=f"Choice(replica={got.replica}, matched_blocks={got.matched_blocks}): {got.reason}",
                       hint=_diagnose(got, want, request, replicas, abs_threshold, rel_threshold))


# --------------------------------------------------------------------- the cases


def make_request(token_ids: Sequence[int], request_id: str = "req") -> RoutedRequest:
    hashes: list[BlockHash] = []
    hash_new_full_blocks(hashes, list(token_ids), BLOCK_SIZE)
    return RoutedRequest(request_id, tuple(token_ids), tuple(hashes), BLOCK_SIZE)


def replica(index: int, hashes=(), running: int = 0, waiting: int = 0, usage: float = 0.0) -> ReplicaState:
    return ReplicaState(index, running, waiting, usage, frozenset(hashes))


# The docstring's example: a prompt of 4 full blocks (and 2 tokens more).
REQUEST = make_request(list(range(10, 28)))
H = REQUEST.block_hashes
OTHER = make_request(list(range(100, 112))).block_hashes          # another prompt's chain
EXAMPLE = [replica(0, H[:2], running=3), replica(1, [*H[:3], OTHER[1]], running=3, waiting=2),
           replica(2, H[1:4], running=1)]


def check_prefix_choice(choose_prefix_replica, *, max_examples: int = 80, quiet: bool = False) -> CheckResult:
    """Check your ``choose_prefix_replica(request, replicas, *, balance_abs_threshold,
    balance_rel_threshold)``; print and return the result."""
    fn = choose_prefix_replica

    def the_example():
        compare(fn, REQUEST, EXAMPLE, "the docstring's example")

    def nothing_matches():
        compare(fn, REQUEST, [replica(0, OTHER, running=2), replica(1, running=1, usage=0.5),
                              replica(2, running=1, usage=0.25)],
                "no replica holds block 0: the least loaded (fewest requests, then lowest kv_cache_usage)")
        compare(fn, make_request([5, 6, 7]), [replica(0, H, running=2), replica(1, running=2)],
                "a prompt shorter than one block has no block hash: the least loaded (ties: lower index)")

    def ties():
        compare(fn, REQUEST, [replica(0, H[:2], running=3), replica(1, H[:2], running=1),
                              replica(2, H[:1], running=1)],
                "replicas 0 and 1 both match 2 blocks: the less loaded of them")
        compare(fn, REQUEST, [replica(0, H[:3], running=2, usage=0.75), replica(1, H[:3], waiting=2, usage=0.5)],
                "equal matches and equal loads: the lower kv_cache_usage")

    def overloaded():
        compare(fn, REQUEST, [replica(0, H, running=8, waiting=2), replica(1, H[:1], running=1), replica(2)],
                "the best match has 10 requests, the least loaded 0: both thresholds crossed, the least loaded")
        compare(fn, REQUEST, [replica(0, H, running=9), replica(1, H[:2], running=4)],
                "the best match has 9 requests vs 4 (9 - 4 > 4 and 9 > 1.5 * 4): the least loaded, with its "
                "own 2 matched blocks")

    def one_threshold_is_not_enough():
        compare(fn, REQUEST, [replica(0, H, running=20), replica(1, running=14)],
                "20 vs 14 requests: 20 - 14 = 6 > 4 but 20 is not > 1.5 * 14 = 21, so the best match stays")
        compare(fn, REQUEST, [replica(0, H, running=3), replica(1)],
                "3 vs 0: 3 > 1.5 * 0 but 3 - 0 = 3 is not > 4, so the best match stays")
        compare(fn, REQUEST, [replica(0, H, running=3), replica(1)],
                "3 vs 0 with balance_abs_threshold=2: both crossed, the least loaded", abs_threshold=2)

    def at_a_threshold_is_not_over():
        compare(fn, REQUEST, [replica(0, H, running=8), replica(1, running=4)],
                "8 vs 4 requests: 8 > 1.5 * 4 = 6, but 8 - 4 = 4 is not > balance_abs_threshold 4 (it equals it), "
                "so the best match stays")
        compare(fn, REQUEST, [replica(0, H, running=15), replica(1, running=10)],
                "15 vs 10: 15 - 10 = 5 > 4, but 15 is not > 1.5 * 10 = 15 (it equals it), so the best match stays")

    def hole_in_the_chain():
        compare(fn, REQUEST, [replica(0, [H[0], H[2], H[3]]), replica(1, H[:2], running=1)],
                "replica 0 lost block 1 (evicted): its blocks 2 and 3 can no longer be hits")

    def chained_not_text():
        # The same 4 tokens as block 1 of REQUEST, as the first block of another prompt.
        moved = make_request(list(REQUEST.prompt_token_ids[4:8]) + list(range(200, 212)))
        compare(fn, REQUEST, [replica(0, [*H[:1], *moved.block_hashes]), replica(1, H[:3], running=2)],
                "replica 0 holds block 1's tokens, but after another prefix: only block 0 matches there")

    def one_replica():
        compare(fn, REQUEST, [replica(0, H[:1], running=30)], "one replica: always it, however loaded")

    def random_states():
        from hypothesis import given, strategies as st

        @property_settings(max_examples, report_multiple_bugs=False)
        @given(st.integers(0, 5), st.integers(1, 4), st.sampled_from([0, 2, 4]), st.sampled_from([1.0, 1.5, 2.0]),
               st.data())
        def test(num_blocks, num_replicas, abs_threshold, rel_threshold, data):
            tokens = data.draw(st.lists(st.integers(3, 500), min_size=num_blocks * BLOCK_SIZE,
                                        max_size=num_blocks * BLOCK_SIZE + BLOCK_SIZE - 1), label="tokens")
            request = make_request(tokens)
            states = []
            for index in range(num_replicas):
                held = data.draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks), label="held")
                hashes = [h for h, keep in zip(request.block_hashes, held) if keep] + list(OTHER[:index])
                states.append(replica(index, hashes, running=data.draw(st.integers(0, 12), label="running"),
                                      waiting=data.draw(st.integers(0, 3), label="waiting"),
                                      usage=data.draw(st.sampled_from([0.0, 0.25, 0.5]), label="usage")))
            compare(fn, request, states, f"random states ({num_replicas} replicas, {num_blocks} blocks)",
                    abs_threshold, rel_threshold)

        run_property(test)

    cases = [   # one rule at a time, so that the first failure names one mistake; the example mixes them
        Case("no replica holds the first block: the least loaded", nothing_matches),
        Case("equal matches: the less loaded replica", ties),
        Case("the best match is overloaded: the least loaded", overloaded),
        Case("one threshold crossed is not overloaded (and, not or)", one_threshold_is_not_enough),
        Case("exactly at a threshold is not over it (>, not >=)", at_a_threshold_is_not_over),
        Case("the docstring's example: the longest cached prefix, 5 - 1 = 4 is not > 4", the_example),
        Case("a missing block ends the match (the hashes chain)", hole_in_the_chain),
        Case("matching is by chained block hash, not by a block's tokens", chained_not_text),
        Case("one replica", one_replica),
        Case(f"property: {max_examples} random states (matches stop at the first miss, ties by load, the "
             "thresholds)", random_states),
    ]
    return run_checks("choose_prefix_replica", cases, quiet=quiet)


# --------------------------------------------------------------------- the engine

# The engine cell's run: the notebook's 48 requests, 8 arriving between two steps of the replicas (a
# burst fills one replica's queue), and balance_abs_threshold 2 instead of 4, so that this small run
# crosses the thresholds, sits exactly on them and splits equal matches by load: every rule of the
# contract decides some request (the tests check that each usual mistake changes a choice).
ENGINE_ABS, ENGINE_REL, ARRIVALS_PER_STEP = 2, REL, 8
NOT_SEEN = ("Not seen by this run: a replica holding a prompt's later blocks without an earlier one. The router's "
            "tree keeps each prompt from its first block on (it forgets leaves first), so counting past a "
            "missing block changes no choice here; check_prefix_choice's 'a missing block ends the match' "
            "case checks it.")


def _situations(request, replicas, abs_threshold, rel_threshold) -> list[str]:
    """Which rules of the contract decide this choice (for the engine cell's summary)."""
    counts = {r.index: _count(request.block_hashes, r.cached_block_hashes) for r in replicas}
    best = min(replicas, key=lambda r: (-counts[r.index], r.load, r.kv_cache_usage, r.index))
    least = min(replicas, key=lambda r: (r.load, r.kv_cache_usage, r.index))
    if counts[best.index] == 0:
        return ["no match"]
    found = []
    if any(r.index != best.index and counts[r.index] == counts[best.index] and r.load != best.load for r in replicas):
        found.append("tie")
    over_abs = best.load - least.load > abs_threshold
    over_rel = best.load > rel_threshold * least.load
    if over_abs and over_rel:
        found.append("overloaded")
    elif over_abs or over_rel:
        found.append("one threshold")
    if best.load - least.load == abs_threshold or best.load == rel_threshold * least.load:
        found.append("on a threshold")
    return found


def run_router_with(choose_prefix_replica, *, quiet: bool = False):
    """Run two in-process replicas of a tiny random Llama (written to a temporary folder)
    behind the Router on the shared-system-prompt workload, 8 requests arriving between two
    steps, with the prefix-aware policy (balance_abs_threshold 2): once with the package's
    ``choose_prefix_replica``, once with yours; compare every request's replica, its greedy
    tokens and the prefix-cache hit rate (round robin shown for scale). Returns an
    ``EngineRunResult`` (``reference`` / ``yours``: the replica of each request)."""
    import tempfile
    from collections import Counter

    from microvllm.checks.engine_run import EngineRunResult
    from microvllm.models.tiny import make_tiny_model
    from microvllm.router import PrefixAwarePolicy, compare_policies, make_replicas, shared_prefix_workload
    from microvllm.router.prefix_aware import choose_prefix_replica as package_choice

    def report(same, reference, yours, message):
        if not quiet:
            print(message)
        return EngineRunResult(same, reference, yours, message)

    try:   # a part not written yet is said in one line, before the engines start
        on_example = choose_prefix_replica(REQUEST, list(EXAMPLE), balance_abs_threshold=ABS,
                                           balance_rel_threshold=REL)
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        todo = not_implemented_message(exc)
        return report(False, [], [], f"run_router_with: not implemented yet ({todo})" if todo is not None else
                      f"your choose_prefix_replica fails on the docstring's example: {type(exc).__name__}: {exc} "
                      "(run check_prefix_choice above)")

    calls, seen = [], Counter()

    def yours(*args, **kwargs):
        calls.append(1)
        return choose_prefix_replica(*args, **kwargs)

    def package(request, replicas, **thresholds):
        seen.update(_situations(request, replicas, thresholds["balance_abs_threshold"],
                                thresholds["balance_rel_threshold"]))
        return package_choice(request, replicas, **thresholds)

    def policy(choose):
        return PrefixAwarePolicy(balance_abs_threshold=ENGINE_ABS, balance_rel_threshold=ENGINE_REL, choose=choose)

    workload = shared_prefix_workload()
    with tempfile.TemporaryDirectory(prefix="microvllm-router-") as folder:
        make_tiny_model(folder, "llama", seed=20)
        replicas = make_replicas(folder, 2, workload)
        try:
            comparison = compare_policies(policies=["round_robin", policy(package)], replicas=replicas,
                                          workload=workload, arrivals_per_step=ARRIVALS_PER_STEP)
            reference = comparison.reports["prefix_aware"]
            mine = compare_policies(policies=[policy(yours)], replicas=replicas, workload=workload,
                                    arrivals_per_step=ARRIVALS_PER_STEP).reports["prefix_aware"]
        except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
            return report(False, [], [], f"The router stopped inside your choose_prefix_replica: "
                                         f"{type(exc).__name__}: {exc}")
    ref_choices = [d.replica for d in reference.decisions]
    my_choices = [d.replica for d in mine.decisions]
    round_robin = comparison.reports["round_robin"]
    tokens_same = [o.outputs[0].token_ids for o in reference.outputs] == [o.outputs[0].token_ids for o in mine.outputs]
    situations = ", ".join(f"{seen[key]} {words}" for key, words in (
        ("no match", "with no block matched"), ("tie", "between equal matches of unequal load"),
        ("overloaded", "with the best match overloaded"), ("one threshold", "with one threshold crossed but not both"),
        ("on a threshold", "exactly on a threshold")))
    lines = [f"2 replicas of a tiny random Llama, {workload.num_kv_blocks} KV blocks each; {len(workload.prompts)} "
             f"requests ({workload.num_prefixes} system prompts of {workload.prefix_blocks} blocks, a short question "
             f"after each, shuffled), {ARRIVALS_PER_STEP} arriving between two steps; balance_abs_threshold="
             f"{ENGINE_ABS}, balance_rel_threshold={ENGINE_REL} ({len(calls)} calls to yours)",
             f"  among the package's {len(reference.decisions)} choices: {situations}",
             f"  prefix-cache hit rate: yours {mine.hit_rate:.1%}, the package's {reference.hit_rate:.1%}, "
             f"round robin {round_robin.hit_rate:.1%}",
             f"  requests per replica:  yours {[r.requests for r in mine.replicas]}, the package's "
             f"{[r.requests for r in reference.replicas]}"]
    differ = [i for i, (a, b) in enumerate(zip(ref_choices, my_choices)) if a != b]
    want = _reference(REQUEST, EXAMPLE)
    example_wrong = (getattr(on_example, "replica", None), getattr(on_example, "matched_blocks", None)) != \
        (want.replica, want.matched_blocks)
    if differ:
        first = differ[0]
        lines.append(f"  request {first} went to replica {my_choices[first]} ({mine.decisions[first].reason}); the "
                     f"package's choice: replica {ref_choices[first]} ({reference.decisions[first].reason})")
        lines.append(f"✗ Your choices differ on {len(differ)} of {len(ref_choices)} requests: run check_prefix_choice "
                     "above, which names the first rule yours breaks.")
    elif not calls:
        lines.append("✗ The router never called your choose_prefix_replica.")
    elif not tokens_same:
        lines.append("✗ Every request went to the same replica, but the greedy tokens differ: the engines did not "
                     "run as the package's did (did your function change a replica's state?).")
    else:
        lines.append("  " + NOT_SEEN)
        if example_wrong:
            lines.append(f"✗ Every request went to the same replica as with the package's choice, but on the "
                         f"docstring's example yours chooses replica {getattr(on_example, 'replica', '?')} "
                         f"({getattr(on_example, 'matched_blocks', '?')} matched blocks), not {want.replica} "
                         f"({want.matched_blocks}): run check_prefix_choice above.")
        else:
            lines.append("✓ Same greedy tokens as with the package's choice for every request, and the same "
                         "replica: your choose_prefix_replica routes the real engines.")
    same = not differ and bool(calls) and tokens_same and not example_wrong
    return report(same, [ref_choices], [my_choices], "\n".join(lines))
