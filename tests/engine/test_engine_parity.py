"""The engine generates exactly what Hugging Face ``generate`` gives for each prompt
alone — whatever batching, chunking, preemption and prefix caching it does."""

import pytest

from microvllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, varied_prompts

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

SETTINGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=32),
    "preemption": dict(num_kv_blocks=14, max_num_batched_tokens=64),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "block_size_1": dict(block_size=1, max_num_batched_tokens=48),
    "no_chunking": dict(enable_chunked_prefill=False, max_model_len=128, max_num_batched_tokens=128),
}


def run_and_compare(folder, prompts, **settings):
    settings.setdefault("max_model_len", 256)  # keeps the default pool small: invariants are O(blocks)
    llm = LLM(str(folder), trace=True, debug_invariants=True, **settings)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        expected = hf_greedy(str(folder), tuple(prompt), MAX_TOKENS)
        assert tuple(out.outputs[0].token_ids) == expected, \
            f"prompt of {len(prompt)} tokens diverged under {settings}"
    assert llm.engine.kv_cache_manager.block_pool.get_num_free_blocks() == \
        llm.engine.kv_cache_manager.num_usable_blocks
    return llm


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen3_5"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tiny_models(tiny_models, arch, setting):
    seeds = {"llama": 11, "mistral": 12, "qwen3": 13, "qwen3_moe": 14, "mixtral": 15, "qwen3_5": 16}
    prompts = varied_prompts(512, seed=seeds[arch])
    settings = dict(SETTINGS[setting])
    if arch == "qwen3_5" and setting == "preemption":   # 4 cache groups (full + 3 of states) per request
        settings["num_kv_blocks"] = 30
    llm = run_and_compare(tiny_models[arch], prompts, **settings)
    trace = llm.trace
    if setting == "preemption":
        assert trace.preemption_steps(), "the pool was meant to be small enough to preempt"
    if setting == "chunked":
        assert any(s.kind == "prefill" and s.num_scheduled_tokens < s.num_prompt_tokens
                   for step in trace for s in step.scheduled), "no prompt was chunked"
    if setting == "default" and arch != "qwen3_5":   # a hybrid hits only computed states: test_hybrid.py
        hits = [s.prefix_hit_tokens for step in trace for s in step.scheduled if s.prefix_hit_tokens]
        assert hits, "prompts sharing a prefix should have hit the prefix cache"


@pytest.mark.slow   # 15-60 s each on 2 cores: the quick tier keeps the tiny models' parity above
@pytest.mark.parametrize("setting", ["default", "preemption", "block_size_1"])
def test_default_model(default_model_folder, setting):
    prompts = varied_prompts(49152, count=16, seed=11, max_len=40)
    settings = dict(SETTINGS[setting])
    if setting == "preemption":
        settings["num_kv_blocks"] = 12
    llm = run_and_compare(default_model_folder, prompts, **settings)
    if setting == "preemption":
        assert llm.trace.preemption_steps()


def test_seeded_sampling_is_unchanged_by_preemption(tiny_models):
    """A seeded request's random stream continues where it stopped when it resumes after
    preemption, so it samples what it would have sampled had it never been preempted
    (restarting the stream would replay its first draws)."""
    prompts = varied_prompts(512, count=8, seed=14)
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for name, settings in (("roomy", dict()), ("preempting", dict(num_kv_blocks=14, max_num_batched_tokens=64))):
        llm = LLM(str(tiny_models["llama"]), max_model_len=256, trace=True, **settings)
        outs[name] = [o.outputs[0].token_ids for o in
                      llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        if name == "preempting":
            assert llm.trace.preemption_steps(), "the pool was meant to be small enough to preempt"
    assert outs["preempting"] == outs["roomy"]
