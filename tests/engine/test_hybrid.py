"""A hybrid (tiny Qwen3.5: Gated DeltaNet layers beside full attention) in the engine:
prefix hits resume from state snapshots, with the same tokens as Hugging Face; without
snapshots (``mamba_cache_mode="none"``) a hybrid never hits; n > 1, mixed long and short
prompts; what a hybrid cannot do is refused with what to change."""

import pytest

from microvllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def shared_prefix_waves(system_len: int):
    """Two waves of prompts: a shared 'system prompt' of ``system_len`` tokens, then a
    different question each; the second wave arrives after the first finished."""
    system = [(7 * i) % 500 + 3 for i in range(system_len)]
    first = [system + [100 + i, 200 + i, 300 + i] for i in range(3)]
    second = [system + [400 + i, 50 + i] for i in range(3)]
    return first, second


def run_waves(folder, waves, **settings):
    llm = LLM(str(folder), trace=True, debug_invariants=True, max_model_len=256, **settings)
    hits = []
    for prompts in waves:
        start = len(llm.trace)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert tuple(out.outputs[0].token_ids) == hf_greedy(str(folder), tuple(prompt), MAX_TOKENS)
        hits.append([s.prefix_hit_tokens for step in list(llm.trace)[start:] for s in step.scheduled
                     if s.kind == "prefill" and s.prefix_hit_tokens])
    kv = llm.engine.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_usable_blocks
    return llm, hits


@pytest.mark.parametrize("mode", [None, "align", "all"])   # None: the default, vLLM's "align"
def test_a_second_wave_resumes_from_the_snapshots(tiny_models, mode):
    settings = {} if mode is None else {"mamba_cache_mode": mode}
    llm, hits = run_waves(tiny_models["qwen3_5"], shared_prefix_waves(40), **settings)
    assert llm.engine.config.cache_config.mamba_cache_mode == (mode or "align")
    assert hits[1] == [32, 32, 32], "each of the second wave should resume at the last snapshot (2 blocks of 16)"


def test_without_snapshots_a_hybrid_never_hits(tiny_models):
    _, hits = run_waves(tiny_models["qwen3_5"], shared_prefix_waves(40), mamba_cache_mode="none")
    assert hits == [[], []]


def test_a_system_prompt_shorter_than_a_block_never_hits(tiny_models):
    """vLLM issue #40696's case: only full blocks are cached, in every group."""
    _, hits = run_waves(tiny_models["qwen3_5"], shared_prefix_waves(12))
    assert hits == [[], []]


def test_smaller_blocks_hit_shorter_prefixes(tiny_models):
    """The state fits a page of 8 tokens here: a 12-token system prompt then hits 8."""
    llm, hits = run_waves(tiny_models["qwen3_5"], shared_prefix_waves(12), block_size=8)
    assert llm.engine.config.cache_config.block_size == 8
    assert hits[1] == [8, 8, 8]


def test_block_size_is_raised_until_a_page_holds_a_state(tiny_models):
    llm = LLM(str(tiny_models["qwen3_5"]), block_size=2, max_model_len=64)
    assert llm.engine.config.cache_config.block_size == 8   # a state of 256 values, 32 per token
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], GREEDY, use_tqdm=False)[0]
    assert tuple(out.outputs[0].token_ids) == hf_greedy(str(tiny_models["qwen3_5"]), (5, 6, 7, 8, 9), MAX_TOKENS)


def test_n_greedy_samples_and_a_mixed_batch(tiny_models):
    folder = tiny_models["qwen3_5"]
    long = [(11 * i) % 500 + 3 for i in range(150)]
    prompts = [long, [9, 8, 7], long[:37], [42] * 20]
    llm = LLM(str(folder), trace=True, debug_invariants=True, max_model_len=256, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want = hf_greedy(str(folder), tuple(prompt), MAX_TOKENS)
        assert [tuple(c.token_ids) for c in out.outputs] == [want, want]
    mixed = [step for step in llm.trace
             if {s.kind for s in step.scheduled} >= {"prefill", "decode"}]
    assert mixed, "a long prompt's chunks were meant to run beside other requests' decodes"


@pytest.mark.parametrize("settings,message", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "roll the state back"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=1"),
    (dict(mamba_cache_mode="every_block"), r"mamba_cache_mode='every_block' is not one of 'align', 'all', 'none'"),
])
def test_what_a_hybrid_cannot_do_is_refused(tiny_models, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_models["qwen3_5"]), **settings)
