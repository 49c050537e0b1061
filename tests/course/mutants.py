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


# --------------------------------------------------------------- exercise 15: token masks

from microvllm.structured_output.backend_regex import TokenTrie  # noqa: E402


def _subtree_ids(trie, node):
    ids, stack = [], [node]
    while stack:
        current = stack.pop()
        ids.extend(trie.ends[current])
        stack.extend(trie.children[current].values())
    return ids


class TrieFirstCharacterOnly(TokenTrie):
    """Checks only each token's first character: '5a' passes because '5' does."""

    def allowed_from(self, dfa, state):
        return [token_id for ch, child in self.children[0].items() if dfa.step(state, ch) != dfa.DEAD
                for token_id in _subtree_ids(self, child)]


class TrieWalksThroughDead(TokenTrie):
    """Never prunes: steps on below a dead prefix (the right ids, at the cost of the whole trie)."""

    def allowed_from(self, dfa, state):
        allowed, stack = [], [(0, state)]
        while stack:
            node, at = stack.pop()
            if node and at != dfa.DEAD:
                allowed.extend(self.ends[node])
            for ch, child in self.children[node].items():
                stack.append((child, dfa.step(at, ch)))
        return allowed


class TrieAllowsEverything(TokenTrie):
    """Every token, whatever the state (a mask that masks nothing)."""

    def allowed_from(self, dfa, state):
        return [token_id for ids in self.ends for token_id in ids]


class TrieAddsChildBeforeStepping(TokenTrie):
    """Off by one node: adds a child's ids before checking the child's own character, so a
    token whose last character dies is allowed."""

    def allowed_from(self, dfa, state):
        allowed, stack = [], [(0, state)]
        while stack:
            node, at = stack.pop()
            for ch, child in self.children[node].items():
                allowed.extend(self.ends[child])
                nxt = dfa.step(at, ch)
                if nxt != dfa.DEAD:
                    stack.append((child, nxt))
        return allowed


class TrieFromTheStart(TokenTrie):
    """Ignores the state it is given: always the start state's mask."""

    def allowed_from(self, dfa, state):
        return super().allowed_from(dfa, dfa.start)


class TrieLeavesOnly(TokenTrie):
    """Adds ids only at nodes without children: '1' is lost because '1.' is below it."""

    def allowed_from(self, dfa, state):
        return [token_id for token_id in super().allowed_from(dfa, state)
                if any(token_id in self.ends[node] and not self.children[node] for node in range(len(self.ends)))]


# ------------------------------------------------------- exercise 14: the rejection sampler

import microvllm.sample.rejection_sampler as rejection_module  # noqa: E402


def rejection_mutants() -> dict:
    """name -> (rejection_sample, residual_probs) of a copy of the module with one bug."""
    bugs = {
        "accepts everything": [("accepted = (uniform * q_of_draft < p_of_draft) & is_draft", "accepted = is_draft")],
        "forgets the bonus token": [("output[rows, num_accepted] = next_token",
                                     "output[rows, num_accepted] = torch.where(num_accepted == num_draft_tokens, "
                                     "PLACEHOLDER_TOKEN_ID, next_token)")],
        "residual not normalized": [("return torch.where(total > 0, residual / total.clamp(min=torch.finfo("
                                     "residual.dtype).tiny), target_probs)", "return residual")],
        "q/p instead of p/q": [("accepted = (uniform * q_of_draft < p_of_draft) & is_draft",
                                "accepted = (uniform * p_of_draft < q_of_draft) & is_draft")],
    }
    copies = {name: mutant(rejection_module, replacements) for name, replacements in bugs.items()}
    return {name: (copy.rejection_sample, copy.residual_probs) for name, copy in copies.items()}


# ------------------------------------------------------- exercise 07: the model runner

import microvllm.worker.model_runner as model_runner_module  # noqa: E402


def sampling_rule_mutants() -> dict:
    """name -> a ModelRunner whose _prepare_inputs picks the sampling rows by the prompt's length
    instead of all known tokens: right for every fresh request, wrong for one resumed after
    preemption (its NewRequestData carries prompt + output tokens, recomputed in chunks)."""
    rule = "if s == len(n.token_ids)]"
    bugs = {
        "samples once past the prompt": [(rule, "if s >= n.num_prompt_tokens]")],
        "samples at the prompt's end or on a decode": [(rule, "if s == n.num_prompt_tokens or num_scheduled[i] == 1]")],
    }
    # the copy returns the package's ModelInputs (the checker tests isinstance)
    return {name: mutant(model_runner_module, replacements, ModelInputs=model_runner_module.ModelInputs).ModelRunner
            for name, replacements in bugs.items()}


# ------------------------------------------------- exercise 17: moe_align_block_size

import importlib  # noqa: E402

# (the package's __init__ exports the function under the module's name: import the module itself)
moe_align_module = importlib.import_module("microvllm.layers.fused_moe.moe_align_block_size")

_PLACE = "    sorted_token_ids[expert_offsets[experts] + rank] = order\n"
_RETURN = "    return AlignedRouting(sorted_token_ids, expert_ids, total, expert_offsets)\n"


def align_stopping_at_an_empty_expert(topk_ids, block_size, num_experts):
    """A loop over experts that stops (``break``) at the first expert with no pairs: the
    pairs of every expert after it are lost, and so are their offsets."""
    import torch

    flat = topk_ids.flatten().tolist()
    pad = len(flat)
    sorted_ids, expert_ids, offsets = [], [], [0]
    for expert in range(num_experts):
        pairs = [i for i, e in enumerate(flat) if e == expert]
        if not pairs:
            break
        rows = -(-len(pairs) // block_size) * block_size
        sorted_ids += pairs + [pad] * (rows - len(pairs))
        expert_ids += [expert] * (rows // block_size)
        offsets.append(offsets[-1] + rows)
    offsets += [offsets[-1]] * (num_experts + 1 - len(offsets))
    return moe_align_module.AlignedRouting(torch.tensor(sorted_ids, dtype=torch.long),
                                           torch.tensor(expert_ids, dtype=torch.long), offsets[-1],
                                           torch.tensor(offsets, dtype=torch.long))


def moe_align_mutants() -> dict:
    """name -> a wrong ``moe_align_block_size``."""
    bugs = {
        # torch's default sort: equal expert ids may come out in any order
        "unstable sort": [("stable=True", "stable=False")],
        # expert_offsets[e] holds where expert e's run ends, not where it starts
        "offsets one entry early": [(_RETURN, _RETURN.replace(
            "expert_offsets)", "torch.cat([expert_offsets[1:], expert_offsets[-1:]]))"))],
        # pairs packed back to back (unpadded starts): a run spills into the next expert's block
        "padding overlaps the next expert": [(_PLACE, _PLACE.replace("expert_offsets[experts]",
                                                                     "unpadded_starts[experts]"))],
    }
    found = {name: mutant(moe_align_module, replacements).moe_align_block_size for name, replacements in bugs.items()}
    found["tokens dropped after an expert with no pairs"] = align_stopping_at_an_empty_expert
    return found


# ------------------------------------------------- exercise 20: choose_prefix_replica

prefix_aware_module = importlib.import_module("microvllm.router.prefix_aware")

_BEST = "best = min(replicas, key=lambda r: (-matched[r.index], r.load, r.kv_cache_usage, r.index))"
_MISS = "            if block_hash not in replica.cached_block_hashes:\n                break"
_ABS = "best.load - least.load > balance_abs_threshold"
_REL = "            and best.load > balance_rel_threshold * least.load"


def prefix_choice_mutants() -> dict:
    """name -> a wrong ``choose_prefix_replica``."""
    bugs = {
        # the longest match, ties by index; no overload test, no least-loaded fallback
        "ignores load": [(_BEST, "best = min(replicas, key=lambda r: (-matched[r.index], r.index))"),
                         ("least = least_loaded_replica(replicas)", "least = best"),
                         ("if (best.load - least.load > balance_abs_threshold", "if (False")],
        # matches each block's own tokens (its text), not the engine's chained hashes
        "matches the prompt's text, not the block hashes": [
            ("        for block_hash in request.block_hashes:\n",
             "        size = request.block_size\n"
             "        tokens = request.prompt_token_ids\n"
             "        for start in range(0, len(request.block_hashes) * size, size):\n"
             "            block_hash = hash_block_tokens(None, tokens[start:start + size])\n")],
        # counts every hash the replica holds, past the first missing one
        "keeps matching past the first miss": [(_MISS, _MISS.replace("break", "continue"))],
        # overloaded when either threshold is crossed
        "or instead of and": [(_REL, _REL.replace("and", "or"))],
        # overloaded already at a threshold: >= for > (both tests, then the relative one only)
        ">= instead of >": [(_ABS, _ABS.replace(">", ">=")), (_REL, _REL.replace(">", ">="))],
        ">= on the relative threshold": [(_REL, _REL.replace(">", ">="))],
        # equal matches go to the lower index, not the less loaded replica
        "ties by index, not load": [(_BEST, "best = min(replicas, key=lambda r: (-matched[r.index], r.index))")],
        # the best match is never overloaded
        "no overload test": [("if (best.load - least.load > balance_abs_threshold", "if (False")],
    }
    from microvllm.core.kv_cache_utils import hash_block_tokens

    return {name: mutant(prefix_aware_module, replacements, hash_block_tokens=hash_block_tokens).choose_prefix_replica
            for name, replacements in bugs.items()}
