"""``run_engine_with`` (the last cell of each exercise) catches a WRONG component, not only a
crashing one: each buggy component below generates the same greedy tokens as the reference
(so a token-only check, as the engine cell had before, passes it), and the engine cell
fails it, naming the step, the limit or the pool call."""

from __future__ import annotations

import re

import pytest

import microvllm.core.block_pool as block_pool_module
import microvllm.core.scheduler as scheduler_module
import microvllm.sample.sampler as sampler_module
import microvllm.sample.topk_topp_sampler as topk_module
from microvllm.checks import run_engine_with
from microvllm.checks.engine_workloads import GREEDY
from microvllm.checks.pool_watch import BlockPoolError, watch_block_pool
from microvllm.core.block_pool import BlockPool
from microvllm.core.kv_cache_manager import KVCacheManager
from microvllm.core.scheduler import Scheduler
from microvllm.sample.sampler import Sampler
from microvllm.structured_output.backend_regex import TokenTrie
from tests.course.mutants import PoolFreesTwice, TrieFirstCharacterOnly, mutant


def passes(components):
    result = run_engine_with(components, quiet=True)
    assert result.same, result.message
    assert "✓ Same" in result.message and "✗" not in result.message, result.message


def caught(components, pattern: str, *, same_greedy_tokens: bool = True):
    """The engine cell fails ``components`` with a message matching ``pattern``; with
    ``same_greedy_tokens``, every greedy prompt still got the reference's tokens (what the
    old, token-only engine cell compared)."""
    result = run_engine_with(components, quiet=True)
    assert not result.same, result.message
    assert re.search(pattern, result.message, re.S), result.message
    if same_greedy_tokens:
        params = _workload_params(components)
        assert any(p == GREEDY for p in params)
        for index, p in enumerate(params):
            if p == GREEDY:
                assert result.yours[index] == result.reference[index], result.message
    return result


def _workload_params(components):
    from microvllm.checks.engine_workloads import GREEDY_RUN, WORKLOADS

    return next((WORKLOADS[name] for name in components if name in WORKLOADS), GREEDY_RUN).params


# -------------------------------------------------------------------- scheduler

def test_the_package_scheduler_passes():
    passes({"scheduler": Scheduler})


def test_a_scheduler_that_ignores_max_num_seqs_is_named_at_its_step():
    seats = mutant(scheduler_module, [(" and len(self.running) < self.max_num_seqs", "")]).Scheduler
    result = run_engine_with({"scheduler": seats}, quiet=True)
    assert not result.same
    assert "step 16: your scheduler ran 5 requests, max_num_seqs=4" in result.message, result.message
    assert "len(self.running) < self.max_num_seqs" in result.message  # the hint


def test_a_scheduler_that_preempts_the_oldest_request_is_caught():
    oldest = mutant(scheduler_module, [("victim = self.running.pop()", "victim = self.running.pop(0)")]).Scheduler
    caught({"scheduler": oldest}, r"step 4: your scheduler preempted request 0; the reference preempts "
                                  r"request 3.*victim = self\.running\.pop\(\)")


def test_a_scheduler_that_skips_prefix_hits_is_caught():
    no_hits = mutant(scheduler_module, [(
        "hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)",
        "hit_blocks, num_hit_tokens = self.kv_cache_manager.create_empty_block_list(), 0")]).Scheduler
    caught({"scheduler": no_hits}, r"step 1: your scheduler planned a different batch.*"
                                   r"reference: .*16-token prefix hit.*get_computed_blocks")


def test_a_scheduler_that_admits_in_a_step_that_preempted_is_caught():
    # The freed blocks would take a waiting chunk in step 4: admitting it only hands them back.
    admits = mutant(scheduler_module, [("while not preempted and self.waiting", "while self.waiting")]).Scheduler
    caught({"scheduler": admits}, r"step 4: your scheduler planned a different batch.*request 3: 13 prefill tokens"
                                  r".*a step that preempted admits no waiting request")


def test_a_scheduler_over_the_token_budget_is_named_before_the_runner_fails():
    over_budget = mutant(scheduler_module, [("            token_budget -= num_new_tokens\n            index += 1",
                                             "            index += 1")]).Scheduler
    result = run_engine_with({"scheduler": over_budget}, quiet=True)
    assert "step 1: your scheduler scheduled 22 tokens, max_num_batched_tokens=16" in result.message, result.message
    assert "_prepare_inputs" not in result.message


# ------------------------------------------------------------------- block pool

def test_the_package_block_pool_passes():
    passes({"block_pool": BlockPool})


def test_a_pool_that_hands_out_the_newest_free_blocks_is_caught():
    lifo = mutant(block_pool_module, [(
        "blocks = self.free_block_queue.popleft_n(num_blocks)",
        "blocks = [self.free_block_queue.remove(b) or b\n"
        "                  for b in self.free_block_queue.get_all_free_blocks()[::-1][:num_blocks]]")]).BlockPool
    caught({"block_pool": lifo}, r"after step 0: request 0 holds blocks \[5, 4\] with your BlockPool; with the "
                                 r"reference it holds \[1, 2\].*least recently freed")


def test_a_pool_that_frees_in_reverse_order_is_caught():
    reverse = mutant(block_pool_module, [
        ("        for block in blocks:\n            block.ref_cnt -= 1",
         "        for block in reversed(blocks):\n            block.ref_cnt -= 1")]).BlockPool
    caught({"block_pool": reverse}, r"after step 12: request 2 holds blocks .* with your BlockPool")


def test_a_pool_that_forgets_hashes_on_free_is_caught():
    forgets = mutant(block_pool_module, [(
        "            if block.ref_cnt == 0:\n                self.free_block_queue.append(block)",
        "            if block.ref_cnt == 0:\n                self._maybe_evict_cached_block(block)\n"
        "                self.free_block_queue.append(block)")]).BlockPool
    caught({"block_pool": forgets}, r"after step 11: no block is cached with your BlockPool; with the reference "
                                    r"blocks \[1, 2, 3\] are")


def test_a_pool_error_names_the_pool_call():
    keeps_reference = mutant(block_pool_module, [("            block.ref_cnt -= 1\n            if block.ref_cnt == 0:",
                                                  "            if block.ref_cnt == 1:")]).BlockPool
    result = run_engine_with({"block_pool": keeps_reference}, quiet=True)
    assert "stopped with your BlockPool at step 11" in result.message, result.message
    assert "after your BlockPool.free_blocks([5, 4]): block 4 has ref_cnt 1 but is also in the free queue" \
        in result.message
    assert "Scheduler" not in result.message and "finish_requests" not in result.message


def test_a_double_free_is_named():
    pool = watch_block_pool(PoolFreesTwice)(4)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(BlockPoolError, match=r"your PoolFreesTwice.free_blocks\(\[1\]\): block 1 was freed "
                                             r"twice \(its ref_cnt went below 0, to -1\)"):
        pool.free_blocks(blocks)


def test_the_package_kv_cache_manager_passes_and_a_missed_hit_is_caught():
    passes({"kv_cache_manager": KVCacheManager})

    class NeverHits(KVCacheManager):
        def get_computed_blocks(self, request):
            return self.create_empty_block_list(), 0
    caught({"kv_cache_manager": NeverHits}, r"step 0: your NeverHits planned a different batch.*prefix hit.*"
                                            r"hint: get_computed_blocks\(\) returns the longest run")


# ---------------------------------------------------------------------- sampler

def test_the_package_sampler_passes():
    passes({"sampler": Sampler})


def test_a_sampler_that_ignores_top_k_is_caught():
    keeps_all = mutant(topk_module, [("return logits.masked_fill(logits < kth_value",
                                      "return logits.masked_fill(logits < kth_value - 1e9")])
    sampler = mutant(sampler_module, apply_top_k=keeps_all.apply_top_k).Sampler
    caught({"sampler": sampler}, r"prompt 1 \(temperature=0\.8, top_k=3, seed=11\): ✗.*hint: apply_top_k")


def test_a_sampler_that_drops_the_token_crossing_top_p_is_caught():
    drops_crossing = mutant(topk_module, [("mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs",
                                           "mass_above = sorted_probs.cumsum(dim=-1)")])
    sampler = mutant(sampler_module, apply_top_p=drops_crossing.apply_top_p).Sampler
    caught({"sampler": sampler}, r"prompt 2 \(temperature=0\.3, top_p=0\.6, seed=12\): ✗.*hint: apply_top_p")


def test_a_sampler_that_ignores_request_seeds_is_caught():
    def shared_noise_only(probs, generators, shared_generator):
        return topk_module.random_sample(probs, {}, shared_generator)
    sampler = mutant(sampler_module, random_sample=shared_noise_only).Sampler
    caught({"sampler": sampler}, r"prompt 4 \(temperature=1\.0, seed=14\): ✗.*its own generator")


def test_a_sampler_that_ignores_min_p_is_caught():
    sampler = mutant(sampler_module, apply_min_p=lambda logits, min_p: logits).Sampler
    caught({"sampler": sampler}, r"prompt 3 \(temperature=0\.5, min_p=0\.5, seed=13\): ✗.*hint: .*min-p")


@pytest.mark.parametrize("name, prompt", [("apply_top_k", 6), ("apply_top_p", 7), ("apply_min_p", 8)])
def test_a_sampler_that_ignores_a_filter_entirely_fails_its_many_draws(name, prompt):
    """Each filter has a prompt with 16 seeded samples at temperature 1, where the filter cuts
    off much of the mass: ignoring it changes draws there (top-p used to pass: its only
    prompt sampled at temperature 0.3, where the nucleus rarely matters)."""
    sampler = mutant(sampler_module, **{name: lambda logits, value: logits}).Sampler
    filter_name = name.removeprefix("apply_")
    caught({"sampler": sampler}, rf"prompt {prompt} \(temperature=1\.0, {filter_name}=[\d.]+, seed=\d+, n=16\): "
                                 rf"✗ \d+ of 16 samples differ.*hint: "
                                 rf".*({filter_name}|{filter_name.replace('_', '-')})")


# ----------------------------------------------------------------- model runner

def test_the_model_runner_cell_runs_seeded_rows_and_still_catches_wrong_positions():
    from microvllm.worker.block_table import BlockTable
    from microvllm.worker.model_runner import ModelRunner
    from tests.course.test_checkers import PositionsFromZero

    passes({"block_table": BlockTable, "model_runner": ModelRunner})
    result = run_engine_with({"block_table": BlockTable, "model_runner": PositionsFromZero}, quiet=True)
    assert not result.same and "✗ Your code changed what the engine generates" in result.message, result.message


def test_the_model_runner_cell_resumes_preempted_requests_and_catches_a_prompt_length_sampling_rule():
    """The workload preempts requests and recomputes prompt + outputs in chunks of 8: a runner that
    decides which rows sample by the prompt's length fails the cell (a seeded prompt diverges, or the
    engine stops for a missing token), with the resumed-request hint."""
    from microvllm.worker.block_table import BlockTable
    from tests.course.mutants import sampling_rule_mutants

    for name, runner in sampling_rule_mutants().items():
        result = run_engine_with({"block_table": BlockTable, "model_runner": runner}, quiet=True)
        assert not result.same, name
        assert re.search(r"preemptions in \d+ steps?", result.message) or "stopped" in result.message, result.message
        assert "hint:" in result.message and "resumed after preemption" in result.message, result.message


class PoolHandsOutNewestThenCrashes(BlockPool):
    def get_new_blocks(self, num_blocks):
        blocks = self.free_block_queue.get_all_free_blocks()[::-1][:num_blocks]
        for block in blocks:
            self.free_block_queue.remove(block)
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        if self.get_num_free_blocks() == 0:
            raise RuntimeError("out of blocks")
        return blocks


def test_a_crash_also_shows_the_first_step_that_differed():
    result = run_engine_with({"block_pool": PoolHandsOutNewestThenCrashes}, quiet=True)
    assert "stopped with your PoolHandsOutNewestThenCrashes at step 1:" in result.message, result.message
    assert "get_new_blocks(1) raised RuntimeError: out of blocks" in result.message
    assert "the first difference from the reference: after step 0: request 0 holds blocks [5, 4]" in result.message


# ------------------------------------------------------------------- token trie (exercise 15)

def test_the_package_token_trie_passes_and_every_output_matches_its_regex():
    result = run_engine_with({"token_trie": TokenTrie}, quiet=True)
    assert result.same and "✓ Same tokens" in result.message and "✗" not in result.message, result.message
    assert "regex '[0-9]{3}-[0-9]{4}', greedy): ✓" in result.message, result.message


def test_a_token_trie_that_checks_only_first_characters_changes_the_outputs():
    result = run_engine_with({"token_trie": TrieFirstCharacterOnly}, quiet=True)
    assert not result.same, result.message
    assert re.search(r"✗ Your code changed what the engine generates", result.message), result.message


# ---------------------------------------------------------------- decode kernel

def test_a_decode_kernel_that_fails_its_checker_is_not_launched():
    """A kernel that stores with the query's strides writes past the end of the engine's
    output tensor (the query is a view into the fused QKV): the engine cell must refuse to
    launch it, with the checker's reason, instead of letting it corrupt memory."""
    import microvllm.attention.triton_kernels.decode as decode_module
    from microvllm.attention import register_backend
    from microvllm.attention.triton_backend import TritonAttentionBackend

    query_strides = mutant(decode_module, [
        ("tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims",
         "tl.store(out_ptr + token * stride_query_token + head * stride_query_head + dims")])

    @register_backend("test-wrong-strides-decode")
    class WrongStrides(TritonAttentionBackend):
        def __init__(self):
            super().__init__(use_decode_kernel=True)
            self._decode_attention = query_strides.decode_attention

    result = run_engine_with(attention_backend="test-wrong-strides-decode", quiet=True, max_tokens=2,
                             prompts=["Hi"])
    assert not result.same and result.yours == [], result.message
    assert re.search(r"✗ not run: your decode kernel fails check_decode_kernel.*wrote outside `out`",
                     result.message, re.S), result.message


# ------------------------------------------------------------ prefix cache + hash

def test_the_package_hash_and_manager_pass_and_the_learners_hash_is_used():
    from microvllm.core import kv_cache_utils

    calls, engine_hash = [], kv_cache_utils.hash_block_tokens

    def counting_hash(parent, token_ids, extra_keys=None):
        calls.append(1)
        return engine_hash(parent, token_ids, extra_keys)
    result = run_engine_with({"kv_cache_manager": KVCacheManager}, hash_block_tokens=counting_hash, quiet=True)
    assert result.same and "✗" not in result.message, result.message
    assert calls, "the engine cell never called the learner's hash_block_tokens"
    assert kv_cache_utils.hash_block_tokens is not counting_hash   # restored after the run


def test_a_hit_capped_by_the_prompt_is_caught_on_the_resumed_request():
    from tests.course.test_checkers import HitsCappedByThePrompt

    caught({"kv_cache_manager": HitsCappedByThePrompt}, r"planned a different batch.*prefix hit")


@pytest.mark.parametrize("name", ["hash_without_parent", "hash_ignoring_extra_keys"])
def test_a_hash_that_fails_its_checker_fails_the_engine_cell(name):
    import tests.course.test_checkers as checker_tests

    result = run_engine_with({"kv_cache_manager": KVCacheManager}, hash_block_tokens=getattr(checker_tests, name),
                             quiet=True)
    assert not result.same and re.search(r"step \d+: your KVCacheManager.*planned a different batch",
                                         result.message, re.S), result.message


# ------------------------------------------------------------------ detokenizer

def test_the_detokenizer_workload_exercises_its_rules():
    """The workload's properties come from the tiny model's own output: if it drifts, say so."""
    from microvllm.checks.engine_run import _reference, tiny_model_folder
    from microvllm.checks.engine_workloads import DETOKENIZER_RUN
    from microvllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(str(tiny_model_folder("llama")))
    reference = _reference(DETOKENIZER_RUN, {"max_model_len": 128, **dict(DETOKENIZER_RUN.settings)}, 12, "llama")

    def texts(rid):   # the text after each token
        ids = reference.tokens(rid)
        return [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    # prompt 0: "ter(" ends the text, and no single token's text held all of it
    assert reference.outputs["0"].outputs[0].stop_reason == "ter(", reference.text("0")
    assert "ter(" in tok.decode(reference.tokens("0")), texts("0")
    assert not any("ter(" in tok.decode([t]) for t in reference.tokens("0")), texts("0")
    # prompt 1: "plan" ends exactly where the text of the first min_tokens = 2 tokens ends
    assert texts("1")[1].endswith("plan"), texts("1")
    # prompts 2 and 4: a character split over two tokens (half of it decodes to '\ufffd')
    for rid, char in (("2", "ֱ"), ("4", "܄")):
        out = texts(rid)
        assert any(a.endswith("\ufffd") and b == a[:-1] + char for a, b in zip(out, out[1:])), out


def test_the_package_detokenizer_passes_with_text_compared_after_every_step():
    from microvllm.detokenizer import IncrementalDetokenizer

    result = run_engine_with({"detokenizer": IncrementalDetokenizer}, quiet=True)
    assert result.same and "✗" not in result.message, result.message


def test_a_detokenizer_that_shows_half_characters_is_caught():
    from tests.course.test_checkers import DecodesEachTokenAlone

    caught({"detokenizer": DecodesEachTokenAlone}, r"prompt 2 \(temperature=1\.0, seed=2\): ✗",
           same_greedy_tokens=False)


def test_a_detokenizer_that_stalls_after_an_invalid_byte_is_caught_by_the_streamed_text():
    from tests.course.test_checkers import StallsOnAnyReplacementChar

    caught({"detokenizer": StallsOnAnyReplacementChar},
           r"✗ prompt [12], step \d+: the same final text, but not streamed at the same time.*"
           r"reference had shown '[^']*\ufffd'.*yours had shown", same_greedy_tokens=False)


def test_a_stop_string_search_of_the_new_text_only_is_caught():
    import microvllm.detokenizer as detokenizer_module
    from tests.course.test_checkers import stop_in_new_text_only

    detokenizer = mutant(detokenizer_module, find_stop_string=stop_in_new_text_only).IncrementalDetokenizer
    caught({"detokenizer": detokenizer}, r"prompt 0 \(greedy, stop=\['ter\('\]\): ✗", same_greedy_tokens=False)


def test_a_stop_string_search_one_character_too_early_is_caught_after_min_tokens():
    import microvllm.detokenizer as detokenizer_module

    detokenizer = mutant(detokenizer_module, [("len(output_text) - new_char_count - len(stop_string) + 1",
                                               "len(output_text) - new_char_count - len(stop_string)")])
    caught({"detokenizer": detokenizer.IncrementalDetokenizer}, r"prompt 1 \(greedy, min_tokens=2",
           same_greedy_tokens=False)


# ------------------------------------------------------- exercise 14: the rejection sampler

def _rejection_sampler(name: str):
    import sys

    from tests.course.mutants import rejection_mutants

    rejection_sample, _ = rejection_mutants()[name]
    return sys.modules[rejection_sample.__module__].RejectionSampler


def test_the_package_rejection_sampler_passes_step_by_step():
    from microvllm.sample.rejection_sampler import RejectionSampler

    result = run_engine_with({"rejection_sampler": RejectionSampler}, quiet=True)
    assert result.same, result.message
    assert "✓ every step kept the reference's drafts" in result.message, result.message


def test_the_spec_decode_workload_keeps_rejects_and_adds_bonus_tokens():
    """What the workload's comment promises, measured on the reference engine: greedy and
    seeded requests both have steps that keep every draft and steps with a rejection, and
    some requests get no drafts (K = 0 rows beside drafted ones)."""
    from microvllm.checks.engine_run import _reference
    from microvllm.checks.engine_workloads import SPEC_DECODE_RUN

    run = _reference(SPEC_DECODE_RUN, {"max_model_len": 128, **dict(SPEC_DECODE_RUN.settings)}, 12, "llama")
    kinds: dict[str, set[str]] = {}
    for step in run.trace:
        for r in step.scheduled:
            if r.num_computed_tokens_before >= r.num_prompt_tokens:
                drafts, got = r.num_scheduled_tokens - 1, len(step.new_tokens.get(r.request_id, []))
                kind = "none" if drafts == 0 else "all kept" if got == drafts + 1 else "rejected"
                kinds.setdefault(r.request_id, set()).add(kind)
    assert {"all kept", "rejected"} <= kinds["0"]                  # greedy
    assert any({"all kept", "rejected"} <= kinds[r] for r in "15")  # seeded
    assert kinds["4"] == {"rejected"} or "rejected" in kinds["4"]   # residual draws under top-k
    assert any(kinds[r] == {"none"} for r in kinds)


@pytest.mark.parametrize("name", ["accepts everything", "q/p instead of p/q"])
def test_a_rejection_sampler_that_keeps_wrong_drafts_is_named_at_its_step(name):
    result = run_engine_with({"rejection_sampler": _rejection_sampler(name)}, quiet=True)
    assert not result.same
    assert re.search(r"step \d+: request 0 \(greedy\) checked \d drafts? \[.*kept 0 of the drafts.*"
                     r"hint: your sampler kept a draft the reference rejects", result.message, re.S), result.message


def test_a_rejection_sampler_without_the_bonus_token_stops_the_engine_with_a_hint():
    result = run_engine_with({"rejection_sampler": _rejection_sampler("forgets the bonus token")}, quiet=True)
    assert not result.same
    assert "every row needs one token after its accepted drafts" in result.message, result.message


def test_a_replacement_drawn_from_p_instead_of_the_residual_changes_a_seeded_request():
    import microvllm.sample.rejection_sampler as rejection_module

    copy = mutant(rejection_module, residual_probs=lambda p, q: p.clone())
    result = run_engine_with({"rejection_sampler": copy.RejectionSampler}, quiet=True)
    assert not result.same, result.message
    assert re.search(r"\(seeded\) checked .*hint: where the reference rejected a draft, your token is that "
                     r"draft itself", result.message, re.S), result.message
