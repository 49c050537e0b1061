"""Every checker passes the package's own code, reports an unfinished exercise as "not
implemented yet", and catches deliberately wrong implementations with a message that
names the problem."""

from __future__ import annotations

import hashlib
import re

import torch

import microvllm.attention.triton_kernels.decode as decode_module
import microvllm.core.block_pool as block_pool_module
import microvllm.core.kv_cache_manager as kv_cache_manager_module
import microvllm.core.scheduler as scheduler_module
import microvllm.detokenizer as detokenizer_module
import microvllm.sample.sampler as sampler_module
import microvllm.sample.topk_topp_sampler as topk_module
from microvllm import checks
from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from microvllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, hash_block_tokens
from microvllm.core.scheduler import Scheduler
from microvllm.detokenizer import IncrementalDetokenizer, find_stop_string
from microvllm.sample.sampler import Sampler
from microvllm.structured_output.backend_regex import TokenTrie
from microvllm.worker.block_table import BlockTable
from microvllm.worker.model_runner import ModelRunner
from tests.course.mutants import (
    PoolFreesTwice,
    TrieAddsChildBeforeStepping,
    TrieAllowsEverything,
    TrieFirstCharacterOnly,
    TrieFromTheStart,
    TrieLeavesOnly,
    TrieWalksThroughDead,
    mutant,
    rejection_mutants,
    sampling_rule_mutants,
)


def caught(result, pattern: str) -> None:
    """The checker failed (not "not implemented"), and its explanation matches ``pattern``."""
    assert not result.passed and not result.not_implemented, result.report()
    assert re.search(pattern, result.message, re.S), result.report()


def todo(result) -> None:
    report = result.report()
    assert result.not_implemented and not result.passed, report
    assert "not implemented yet" in report and "✗" not in report, report


# ------------------------------------------------------------------ free queue

class QueueForgetsCounter(FreeKVCacheBlockQueue):
    def remove(self, block):
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None:
            raise ValueError("not queued")
        prev_block.next_free_block, next_block.prev_free_block = next_block, prev_block
        block.prev_free_block = block.next_free_block = None


class QueuePopsNewest(FreeKVCacheBlockQueue):
    def popleft(self):
        last = self.fake_free_list_tail.prev_free_block
        if last is self.fake_free_list_head:
            raise ValueError("empty")
        self.remove(last)
        return last


class QueueSearchesToRemove(FreeKVCacheBlockQueue):
    def remove(self, block):
        node = self.fake_free_list_head
        while node is not block and node is not None:  # an O(n) walk first
            node = node.next_free_block
        super().remove(block)


class QueueTodo(FreeKVCacheBlockQueue):
    def remove(self, block):
        raise NotImplementedError("FreeKVCacheBlockQueue.remove: unlink it")


def test_free_block_queue_checker():
    assert checks.check_free_block_queue(FreeKVCacheBlockQueue, quiet=True).passed
    caught(checks.check_free_block_queue(QueueForgetsCounter, quiet=True), r"len\(queue\) is wrong.*num_free_blocks")
    caught(checks.check_free_block_queue(QueuePopsNewest, quiet=True),
           r"popleft\(\) must return the least recently freed block")
    caught(checks.check_free_block_queue(QueueSearchesToRemove, quiet=True), r"remove\(\) must be O\(1\)")
    todo(checks.check_free_block_queue(QueueTodo, quiet=True))


# ------------------------------------------------------------------ block pool

class PoolTouchKeepsQueued(BlockPool):
    def touch(self, blocks):
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1  # forgets to take free blocks out of the queue


class PoolMissesRepeats(BlockPool):
    def free_blocks(self, ordered_blocks):
        blocks = [block for block in ordered_blocks if not block.is_null]
        for block in blocks:   # checks each block once, not counting a block listed twice
            if block.ref_cnt <= 0:
                raise ValueError("freed twice")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)


class PoolKeepsHashes(BlockPool):
    def get_new_blocks(self, num_blocks):
        if num_blocks > self.get_num_free_blocks():
            raise ValueError("too few")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            block.ref_cnt = 1  # forgets to evict the old hash
        return blocks


class PoolTodo(BlockPool):
    def touch(self, blocks):
        raise NotImplementedError("BlockPool.touch: take a reference")


def test_block_pool_checker():
    assert checks.check_block_pool(BlockPool, quiet=True).passed
    caught(checks.check_block_pool(PoolTouchKeepsQueued, quiet=True),
           r"touch\(\) must take a free cached block out of the free queue")
    caught(checks.check_block_pool(PoolFreesTwice, quiet=True),
           r"block 3 came back from free_blocks\(\) twice.*must not be pushed onto the free queue again")
    caught(checks.check_block_pool(PoolKeepsHashes, quiet=True), r"must lose its hash")
    # a broken queue under a correct pool: the first check names the queue, not the pool
    over_broken_queue = mutant(block_pool_module, FreeKVCacheBlockQueue=QueueForgetsCounter).BlockPool
    result = checks.check_block_pool(over_broken_queue, quiet=True)
    caught(result, r"the pool's QueueForgetsCounter fails check_free_block_queue")
    assert result.cases[0].status == "fail", result.report()   # the first check, before the pool's own
    caught(checks.check_block_pool(PoolMissesRepeats, quiet=True),
           r"free_blocks\(\[4, 4\]\) with one reference on block 4 must raise ValueError")
    todo(checks.check_block_pool(PoolTodo, quiet=True))


# ---------------------------------------------------------------- prefix hashing

def hash_without_parent(parent, token_ids, extra_keys=None):
    return hash_block_tokens(None, token_ids, extra_keys)


def hash_with_repr(parent, token_ids, extra_keys=None):
    return BlockHash(hashlib.sha256(repr((parent, list(token_ids), extra_keys)).encode()).digest())


def hash_ignoring_extra_keys(parent, token_ids, extra_keys=None):
    return hash_block_tokens(parent, token_ids)


def hash_todo(parent, token_ids, extra_keys=None):
    raise NotImplementedError("hash_block_tokens: sha256 of parent, tokens, extra keys")


def test_hash_checker():
    assert checks.check_hash_block_tokens(hash_block_tokens, quiet=True).passed
    caught(checks.check_hash_block_tokens(hash_without_parent, quiet=True),
           r"after another prefix must hash differently")
    caught(checks.check_hash_block_tokens(hash_with_repr, quiet=True), r"the engine's exact one")
    caught(checks.check_hash_block_tokens(hash_ignoring_extra_keys, quiet=True), r"extra keys .* must change")
    todo(checks.check_hash_block_tokens(hash_todo, quiet=True))


# ------------------------------------------------------------------- cache hits

class HitsTheLastToken(KVCacheManager):
    def get_computed_blocks(self, request):
        if not self.enable_caching:
            return self.create_empty_block_list(), 0
        hits = [m.find_longest_cache_hit(request.block_hashes, request.num_tokens)
                for m in self.single_type_managers]
        return KVCacheBlocks(tuple(hits)), min(len(b) for b in hits) * self.block_size


class GroupsNeverRetry(KVCacheManager):
    def get_computed_blocks(self, request):
        if not self.enable_caching:
            return self.create_empty_block_list(), 0
        hits = [m.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
                for m in self.single_type_managers]
        shortest = min(len(b) for b in hits)
        return KVCacheBlocks(tuple(b[:shortest] for b in hits)), shortest * self.block_size


class HitsCappedByThePrompt(KVCacheManager):
    """Caps the hit by the prompt's length: a request resumed after preemption loses the
    blocks of the tokens it generated."""

    def get_computed_blocks(self, request):
        if not self.enable_caching:
            return self.create_empty_block_list(), 0
        hits = [m.find_longest_cache_hit(request.block_hashes, request.num_prompt_tokens - 1)
                for m in self.single_type_managers]
        shortest = min(len(b) for b in hits)
        return KVCacheBlocks(tuple(b[:shortest] for b in hits)), shortest * self.block_size


class HitsTodo(KVCacheManager):
    def get_computed_blocks(self, request):
        raise NotImplementedError("KVCacheManager.get_computed_blocks: find the hit")


def test_get_computed_blocks_checker():
    assert checks.check_get_computed_blocks(KVCacheManager, quiet=True).passed
    caught(checks.check_get_computed_blocks(HitsTheLastToken, quiet=True), r"never cover the last token")
    caught(checks.check_get_computed_blocks(GroupsNeverRetry, quiet=True), r"must all retry at the shortest hit")
    caught(checks.check_get_computed_blocks(HitsCappedByThePrompt, quiet=True),
           r"resumed after preemption hits its generated tokens.*not by the prompt's length")
    # The fourth walk's bug: the hit length counted in blocks, not tokens.
    in_blocks = mutant(kv_cache_manager_module, [
        ("shortest = min(len(blocks) for blocks in hits) * self.block_size",
         "shortest = min(len(blocks) for blocks in hits)")]).KVCacheManager
    caught(checks.check_get_computed_blocks(in_blocks, quiet=True), r"the hit is counted in tokens")
    todo(checks.check_get_computed_blocks(HitsTodo, quiet=True))


# -------------------------------------------------------------------- scheduler

def test_scheduler_checker():
    assert checks.check_scheduler(Scheduler, quiet=True).passed
    ignores_budget = mutant(scheduler_module, [("token_budget -= num_new_tokens", "pass")]).Scheduler
    caught(checks.check_scheduler(ignores_budget, quiet=True), r"the token budget max_num_batched_tokens is")
    preempts_oldest = mutant(scheduler_module,
                             [("victim = self.running.pop()", "victim = self.running.pop(0)")]).Scheduler
    caught(checks.check_scheduler(preempts_oldest, quiet=True), r"the most recently admitted request is preempted")
    too_many_seats = mutant(scheduler_module, [(" and len(self.running) < self.max_num_seqs", "")]).Scheduler
    caught(checks.check_scheduler(too_many_seats, quiet=True), r"requests run but max_num_seqs is 2")
    admits_after_preempting = mutant(scheduler_module,
                                     [("while not preempted and self.waiting", "while self.waiting")]).Scheduler
    caught(checks.check_scheduler(admits_after_preempting, quiet=True),
           r"a step that preempted admits no waiting request, even one whose chunk would fit")
    forgets_cached = mutant(scheduler_module, [("request.num_cached_tokens = num_hit_tokens", "pass")]).Scheduler
    caught(checks.check_scheduler(forgets_cached, quiet=True), r"records its prefix-cache hit in num_cached_tokens")

    class SchedulerTodo(Scheduler):
        def schedule(self):
            raise NotImplementedError("Scheduler.schedule: plan one step")
    todo(checks.check_scheduler(SchedulerTodo, quiet=True))


# ---------------------------------------------------------------------- sampler

def test_sampler_checker():
    assert checks.check_sampler(Sampler, quiet=True).passed
    drops_crossing = mutant(topk_module, [("mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs",
                                           "mass_above = sorted_probs.cumsum(dim=-1)")])
    sampler = mutant(sampler_module, apply_top_p=drops_crossing.apply_top_p).Sampler
    caught(checks.check_sampler(sampler, quiet=True), r"top_p=0\.7.*the token that crosses 0\.7 stays")
    caught(checks.check_sampler(sampler, quiet=True), r"only the top_p rows are wrong")   # not the broadcasting
    multiplies = mutant(sampler_module, [("logits = logits / torch.where(is_greedy, 1.0, temperature)",
                                          "logits = logits * torch.where(is_greedy, 1.0, temperature)")]).Sampler
    caught(checks.check_sampler(multiplies, quiet=True), r"temperature 0\.5 must give p\^\(1/T\)")
    # The fourth walk's bug: temperature applied after top-k / top-p (top_p then measures the
    # mass of the unscaled distribution); every other check passed it.
    filters_first = mutant(sampler_module, [
        ("        logits = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)\n", ""),
        ("        probs = logits.softmax(dim=-1)\n",
         "        probs = (logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1))"
         ".softmax(dim=-1)\n")]).Sampler
    caught(checks.check_sampler(filters_first, quiet=True),
           r"temperature=0\.5, top_p=0\.6.*divide by the temperature first")

    def shared_noise_only(probs, generators, shared_generator):
        return topk_module.random_sample(probs, {}, shared_generator)
    ignores_seeds = mutant(sampler_module, random_sample=shared_noise_only).Sampler
    caught(checks.check_sampler(ignores_seeds, quiet=True), r"must not depend on the rest of the batch")

    class SamplerTodo(Sampler):
        def sample(self, logits, sampling_metadata):
            raise NotImplementedError("Sampler.sample: greedy and random rows")
    todo(checks.check_sampler(SamplerTodo, quiet=True))


# ------------------------------------------------------------ rejection sampler

def test_rejection_sampler_checker():
    from microvllm.sample.rejection_sampler import rejection_sample, residual_probs

    assert checks.check_rejection_sampler(rejection_sample, residual_probs, quiet=True).passed
    bugs = rejection_mutants()
    expected = {
        "accepts everything": r"greedy row 1: drafts \[5, 2, 7\].*expected: \[5, 3, -1, -1\].*stop at the first draft",
        "forgets the bonus token": r"greedy row 0.*got: +\[5, 2, 7, -1\].*hint: +when all .* accepted.*bonus",
        "residual not normalized": r"expected: \[0\.75, 0\.25, 0\.0, 0\.0\].*divide by the sum",
        "q/p instead of p/q": r"must be rejected: min\(1, p/q\) = 0\.25.*\(p/q, not q/p\)",
    }
    for name, pattern in expected.items():
        caught(checks.check_rejection_sampler(*bugs[name], quiet=True), pattern)
    # Through rejection_sample alone (the engine's residual_probs checked), the unnormalized
    # residual is still caught where it is sampled from; each mutant fails the distribution test.
    fixed_residual = checks.check_rejection_sampler(bugs["residual not normalized"][0], residual_probs, quiet=True)
    caught(fixed_residual, r"sample\(\) was given a row that is not a probability distribution")
    for name in ("accepts everything", "forgets the bonus token", "q/p instead of p/q"):
        result = checks.check_rejection_sampler(*bugs[name], quiet=True)
        assert [c.status for c in result.cases[-2:]] == ["fail", "fail"], (name, result.report())

    def draws_twice(drafts, num, target, q, uniform, sample):   # e.g. the bonus and the residual apart
        sample(target[:, 0])
        return rejection_sample(drafts, num, target, q, uniform, sample)
    caught(checks.check_rejection_sampler(draws_twice, residual_probs, quiet=True),
           r"must call sample\(\) exactly once; it called it 2 times")

    def todo_sample(*args):
        raise NotImplementedError("rejection_sample: accept, then one more token")
    todo(checks.check_rejection_sampler(todo_sample, residual_probs, quiet=True))


def test_rejection_sampler_checker_statistics_catch_a_wrong_residual():
    """A replacement drawn from p itself (no subtraction of q) passes the greedy cases (the
    residual of a one-hot p is p) but not the draft-by-draft walk nor the chi-square tests:
    the output over-weights the tokens the drafter proposes."""
    import microvllm.sample.rejection_sampler as rejection_module

    def residual_is_p(p, q):
        return p.clone()
    copy = mutant(rejection_module, residual_probs=residual_is_p)
    result = checks.check_rejection_sampler(copy.rejection_sample, rejection_module.residual_probs, quiet=True)
    statuses = {c.name.split(":")[0]: c.status for c in result.cases}
    assert statuses["greedy rows"] == "pass", result.report()
    assert result.cases[-1].status == result.cases[-2].status == "fail", result.report()
    caught(result, r"token 1 is off the target.s p: chi-square")


# ----------------------------------------------------------------- model runner

class SlotsIgnoreTheTable(BlockTable):
    def slot_mapping(self, batch_table, request_index, positions):
        return positions.clone()


class SlotsWithoutOffset(BlockTable):
    def slot_mapping(self, batch_table, request_index, positions):
        return batch_table[request_index, positions // self.block_size].long() * self.block_size


def test_slot_mapping_checker():
    assert checks.check_slot_mapping(BlockTable, quiet=True).passed
    caught(checks.check_slot_mapping(SlotsIgnoreTheTable, quiet=True), r"the slot of each token.*physical")
    caught(checks.check_slot_mapping(SlotsWithoutOffset, quiet=True), r"the slot of each token")

    class Todo(BlockTable):
        def slot_mapping(self, batch_table, request_index, positions):
            raise NotImplementedError("BlockTable.slot_mapping: block id * B + offset")
    todo(checks.check_slot_mapping(Todo, quiet=True))


class PositionsFromZero(ModelRunner):
    def _prepare_inputs(self, plan):
        inputs = super()._prepare_inputs(plan)
        qsl = inputs.attn_metadata[0].query_start_loc.tolist()
        for i in range(len(inputs.req_ids)):  # every chunk restarts at position 0
            inputs.positions[qsl[i]:qsl[i + 1]] = torch.arange(qsl[i + 1] - qsl[i])
        return inputs


class LogitsFromFirstRow(ModelRunner):
    def _prepare_inputs(self, plan):
        inputs = super()._prepare_inputs(plan)
        qsl = inputs.attn_metadata[0].query_start_loc.tolist()
        inputs.logits_indices = torch.tensor([qsl[i] for i in inputs.sampling_req_indices], dtype=torch.long)
        return inputs


class ReturnsATuple(ModelRunner):
    def _prepare_inputs(self, plan):
        return tuple(vars(super()._prepare_inputs(plan)).values())   # the contract before ModelInputs


class Int64Offsets(ModelRunner):
    """The contract says int32; int64 offsets worked in every value check before."""

    def _prepare_inputs(self, plan):
        inputs = super()._prepare_inputs(plan)
        for m in inputs.attn_metadata:
            m.query_start_loc, m.seq_lens = m.query_start_loc.long(), m.seq_lens.long()
        return inputs


def test_prepare_inputs_checker():
    assert checks.check_prepare_inputs(ModelRunner, quiet=True).passed
    caught(checks.check_prepare_inputs(PositionsFromZero, quiet=True), r"positions.*num_computed_tokens \+ its offset")
    caught(checks.check_prepare_inputs(LogitsFromFirstRow, quiet=True), r"logits must come from the request's last row")
    caught(checks.check_prepare_inputs(ReturnsATuple, quiet=True), r"must return a ModelInputs, got a tuple")
    caught(checks.check_prepare_inputs(Int64Offsets, quiet=True), r"query_start_loc must be int32")
    for name, runner in sampling_rule_mutants().items():   # right for fresh requests, wrong when resumed
        caught(checks.check_prepare_inputs(runner, quiet=True),
               r"resumed after preemption.*Compare seq_len with len\(state.token_ids\), not with the prompt's length")

    class Todo(ModelRunner):
        def _prepare_inputs(self, plan):
            raise NotImplementedError("ModelRunner._prepare_inputs: flatten the plan")
    todo(checks.check_prepare_inputs(Todo, quiet=True))


# ---------------------------------------------------------------- decode kernel

def test_decode_kernel_checker():
    assert checks.check_decode_kernel(decode_module.decode_attention, quiet=True).passed
    unscaled = mutant(decode_module,
                      [("s = tl.sum(k * q[None, :], axis=1) * scale", "s = tl.sum(k * q[None, :], axis=1)")])
    caught(checks.check_decode_kernel(unscaled.decode_attention, quiet=True), r"WITHOUT the 1/sqrt\(head_dim\) scale")
    no_window = mutant(decode_module, [("first_key = tl.maximum(query_pos - SLIDING_WINDOW + 1, 0)", "first_key = 0")])
    caught(checks.check_decode_kernel(no_window.decode_attention, quiet=True),
           r"sliding window that starts.*WITHOUT the sliding window")
    misses_own_key = mutant(decode_module, [("visible = (key_pos >= first_key) & (key_pos <= query_pos)",
                                             "visible = (key_pos >= first_key) & (key_pos < query_pos)")])
    caught(checks.check_decode_kernel(misses_own_key.decode_attention, quiet=True),
           r"leaves out the newest key.*\(<=, not <\)")
    misses_first_key = mutant(decode_module, [("visible = (key_pos >= first_key) & (key_pos <= query_pos)",
                                            "visible = (key_pos > first_key) & (key_pos <= query_pos)")])
    caught(checks.check_decode_kernel(misses_first_key.decode_attention, quiet=True),
           r"leaves out the oldest visible key.*\(>=, not >\)")
    # The fourth walk's bug: the sums not rescaled when the max grows (right within one page).
    unrescaled = mutant(decode_module, [("        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)",
                                         "        acc = acc + tl.sum(p[:, None] * v, axis=0)")])
    caught(checks.check_decode_kernel(unrescaled.decode_attention, quiet=True),
           r"keys fit in one page are right.*what carries from one page to the next")
    query_strides = mutant(decode_module, [
        ("tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims",
         "tl.store(out_ptr + token * stride_query_token + head * stride_query_head + dims")])
    caught(checks.check_decode_kernel(query_strides.decode_attention, quiet=True),
           r"your kernel wrote outside `out`.*store with out's strides")
    unwritten = mutant(decode_module, [("    ### BEGIN SOLUTION\n    # A query that saw no key",
                                        "    raise NotImplementedError(\"decode_attention_kernel: store\")\n"
                                        "    # A query that saw no key")])
    todo(checks.check_decode_kernel(unwritten.decode_attention, quiet=True))


# ------------------------------------------------------------------ detokenizer

class DecodesEachTokenAlone(IncrementalDetokenizer):
    def _decode_next(self):
        self.read_offset = len(self.output_token_ids)
        return self._decode(self.output_token_ids[-1:])


class DecodesEverything(IncrementalDetokenizer):
    def _decode_next(self):
        tokens = self.output_token_ids
        prefix_text, new_text = self._decode(tokens[:self.read_offset]), self._decode(tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.read_offset = len(tokens)
        return new_text[len(prefix_text):]


class StallsOnAnyReplacementChar(IncrementalDetokenizer):
    """Waits whenever the window holds a '\ufffd' anywhere, not only at its end: one invalid
    byte then stalls the stream and the window grows without bound."""

    def _decode_next(self):
        tokens = self.output_token_ids
        prefix_text = self._decode(tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or "\ufffd" in new_text:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        return new_text[len(prefix_text):]


def stop_in_new_text_only(output_text, new_char_count, stop):
    """Searches only the new characters: misses a stop string that straddles old and new."""
    if new_char_count <= 0:
        return None
    start = len(output_text) - new_char_count
    found = [(s, output_text.find(s, start)) for s in stop if output_text.find(s, start) != -1]
    return min(found, key=lambda f: f[1]) if found else None


def test_detokenizer_checker():
    assert checks.check_detokenizer(IncrementalDetokenizer, quiet=True).passed
    caught(checks.check_detokenizer(DecodesEachTokenAlone, quiet=True), r"a delta showed a half character")
    caught(checks.check_detokenizer(DecodesEverything, quiet=True), r"each step must decode a short window")
    caught(checks.check_detokenizer(StallsOnAnyReplacementChar, quiet=True),
           r"text after an invalid byte must keep streaming.*only new_text.endswith")

    class Todo(IncrementalDetokenizer):
        def _decode_next(self):
            raise NotImplementedError("IncrementalDetokenizer._decode_next: the window")
    todo(checks.check_detokenizer(Todo, quiet=True))


def test_find_stop_string_checker():
    assert checks.check_find_stop_string(find_stop_string, quiet=True).passed
    caught(checks.check_find_stop_string(stop_in_new_text_only, quiet=True), r"straddles old and new text")
    latest = mutant(detokenizer_module, [("index < best[1]", "index > best[1]")]).find_stop_string
    caught(checks.check_find_stop_string(latest, quiet=True), r"the earliest stop string wins")
    one_too_early = mutant(detokenizer_module, [("len(output_text) - new_char_count - len(stop_string) + 1",
                                                 "len(output_text) - new_char_count - len(stop_string)")])
    caught(checks.check_find_stop_string(one_too_early.find_stop_string, quiet=True),
           r"ends just before the new text was searched on an earlier step")


# ------------------------------------------------------------------ the report

# ------------------------------------------------------------ token masks (exercise 15)

class TrieTodo(TokenTrie):
    def allowed_from(self, dfa, state):
        raise NotImplementedError("TokenTrie.allowed_from: walk the trie")


def test_token_trie_checker():
    assert checks.check_token_trie(TokenTrie, quiet=True).passed
    caught(checks.check_token_trie(TrieFirstCharacterOnly, quiet=True),
           r"token 3 '5a' must be masked out: after '35a'.*its character 'a'.*"
           r"hint: +step the DFA by every character")
    caught(checks.check_token_trie(TrieWalksThroughDead, quiet=True),
           r"walked below a dead prefix: dfa.step\(\) was called on dfa.DEAD.*do not push that child")
    caught(checks.check_token_trie(TrieAllowsEverything, quiet=True), r"allowed every token")
    caught(checks.check_token_trie(TrieAddsChildBeforeStepping, quiet=True),
           r"token 3 '5a' must be masked out")
    caught(checks.check_token_trie(TrieFromTheStart, quiet=True),
           r"token 1 '.5' must be allowed: '3.5'.*walk from the state you are given")
    caught(checks.check_token_trie(TrieLeavesOnly, quiet=True),
           r"token 2 '.' must be allowed.*not only of leaves")
    todo(checks.check_token_trie(TrieTodo, quiet=True))


def test_token_trie_checker_compares_with_a_per_token_walk():
    """The property case alone catches a mask that is wrong only past the examples' shapes:
    here one that forgets tokens of exactly three characters."""
    class ForgetsThreeCharacterTokens(TokenTrie):
        def allowed_from(self, dfa, state):
            return [i for i in super().allowed_from(dfa, state) if not self._depth_is_three(i)]

        def _depth_is_three(self, token_id):
            stack = [(0, 0)]
            while stack:
                node, depth = stack.pop()
                if token_id in self.ends[node]:
                    return depth == 3
                stack.extend((child, depth + 1) for child in self.children[node].values())
            return False

    result = checks.check_token_trie(ForgetsThreeCharacterTokens, quiet=True)
    caught(result, r"must be allowed")
    assert result.cases[-1].status == "fail", result.report()


def test_report_shows_input_expected_got_and_hint(capsys):
    result = checks.check_block_pool(PoolTouchKeepsQueued)
    out = capsys.readouterr().out
    assert out.strip() == result.report().strip()
    assert "✗ touch() revives a free cached block" in out
    for label in ("input:", "expected:", "got:", "hint:"):
        assert label in out
    assert "Traceback" not in out


def test_an_unexpected_exception_says_where(capsys):
    class Crashes(FreeKVCacheBlockQueue):
        def popleft(self):
            return [][0]
    result = checks.check_free_block_queue(Crashes, quiet=True)
    assert "your code raised IndexError: list index out of range" in result.message
    assert "popleft(), line" in result.message


def test_a_property_case_is_skipped_without_hypothesis():
    from microvllm.checks.report import Case, run_checks

    def needs_hypothesis():
        raise ModuleNotFoundError("No module named 'hypothesis'", name="hypothesis")
    result = run_checks("check_x", [Case("a", lambda: None), Case("property: b", needs_hypothesis)], quiet=True)
    assert result.passed and "skipped, hypothesis is not installed" in result.report()


def test_floats_are_shown_rounded():
    drops_crossing = mutant(topk_module, [("mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs",
                                           "mass_above = sorted_probs.cumsum(dim=-1)")])
    sampler = mutant(sampler_module, apply_top_p=drops_crossing.apply_top_p).Sampler
    report = checks.check_sampler(sampler, quiet=True).report()
    assert "probabilities [0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]" in report, report
    assert "0.34999" not in report and "00000" not in report, report


def test_a_long_shrunk_example_is_trimmed():
    from microvllm.checks.report import Case, run_checks

    def fails():
        exc = AssertionError("the pool leaked a block")
        exc.add_note("Falsifying example: " + "\n".join(f"state.operation_{i}()" for i in range(30)))
        raise exc
    result = run_checks("check_x", [Case("property: x", fails)], quiet=True)
    lines = result.failures[0].lines
    assert lines[0] == "the pool leaked a block" and len(lines) <= 9, lines
    assert "    state.operation_0()" in lines and "    ... (24 more)" in lines
    assert lines[-1] == "    state.operation_29()"


def test_a_cascade_explains_its_first_failure_and_names_the_others():
    """One bug (a free queue that forgets its counter, under a correct pool) fails all 9 pool
    checks: the report explains the first (the root cause) and gives the others one line each."""
    over_broken_queue = mutant(block_pool_module, FreeKVCacheBlockQueue=QueueForgetsCounter).BlockPool
    result = checks.check_block_pool(over_broken_queue, quiet=True)
    report = result.report()
    assert len(result.failures) == 9 and report.count("  ✗ ") == 9, report
    assert report.count("hint:") == 1 and "fix the free queue first" in report, report
    assert len(report) < 1700, report   # every explanation in full: about 2,900
    assert "Fix the first ✗" in report and len(result.message) > len(report), report


def hash_uint16(parent, token_ids, extra_keys=None):
    """Packs token ids as uint16: a wrong digest for small ids, struct.error for ids >= 65536."""
    import struct

    from microvllm.core.kv_cache_utils import ROOT_BLOCK_HASH, _encode_extra_keys

    parent = ROOT_BLOCK_HASH if parent is None else parent
    payload = bytes(parent) + struct.pack(f"<{len(token_ids)}H", *token_ids)
    if extra_keys:
        payload += b"|" + _encode_extra_keys(extra_keys)
    return BlockHash(hashlib.sha256(payload).digest())


def test_hypothesis_distinct_failures_each_show_their_smallest_input():
    result = checks.check_hash_block_tokens(hash_uint16, quiet=True)
    caught(result, r"hypothesis found 2 different failures; each with its smallest failing input:"
                   r".*\(1\) your code raised error: ushort format.*blocks=\[\(\[65536\], None\)\]"
                   r".*\(2\) a chain of blocks hashed differently.*input: +blocks .* = \[\(\[0\], None\)\]")
    assert "ExceptionGroup" not in result.message, result.message
