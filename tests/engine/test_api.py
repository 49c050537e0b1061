"""The LLM API and engine calls: generate, chat, stream, n > 1, seeds, logprobs, stop
strings, abort, and the trace."""

import math

import pytest

from microvllm import LLM, SamplingParams
from microvllm.trace import Trace


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), max_model_len=256, trace=True, debug_invariants=True)


def all_blocks_free(llm):
    manager = llm.engine.kv_cache_manager
    return manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks


def test_text_prompts_and_input_order(llm):
    prompts = ["Hello there", "A much longer prompt about many things", "x"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in prompts]
    for o in outs:
        assert len(o.outputs[0].token_ids) == 5
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)
    assert all_blocks_free(llm)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["a b", "c d"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                         SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="2 prompts but 1 sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_seeded_sample_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("The same prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["noise one", "The same prompt", "noise two two"], [others, params, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate("The same prompt", different, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}  # 2 full blocks + 8 tokens
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    start = len(llm.trace)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seed + index should give different samples"
    # After the first sample computed the prompt, the others hit its 2 full blocks.
    hits = [s.prefix_hit_tokens for step in llm.trace.steps[start:] for s in step.scheduled if s.is_new]
    assert sorted(hits)[-2:] == [32, 32]
    assert all_blocks_free(llm)


def test_logprobs(llm):
    out = llm.generate("logprobs please", SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs):
        # The sampled token plus the top 2; greedy, so the sampled one IS the top-1 (2 entries).
        assert token in entry and len(entry) == 2
        assert max(entry, key=lambda t: entry[t].logprob) == token
        assert entry[token].rank == 1
        assert all(v.logprob <= 0 for v in entry.values())
    assert math.isclose(out.cumulative_logprob,
                        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_stop_string_trims_and_frees(llm):
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = llm.generate("stop test", free, use_tqdm=False)[0].outputs[0].text
    stop = text[5:8]
    assert stop.strip(), "need a non-blank stop string for this test"
    out = llm.generate("stop test", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert all_blocks_free(llm)


def test_stream_yields_the_generated_text(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    whole = llm.generate("stream me", params, use_tqdm=False)[0].outputs[0].text
    assert "".join(llm.stream("stream me", params)) == whole
    # Stopping early aborts the request and frees its blocks.
    gen = llm.stream("stream me", params)
    next(gen)
    gen.close()
    assert not llm.engine.has_unfinished_requests() and all_blocks_free(llm)


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_engine_step_loop_and_abort(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("keep", "a request that runs to the end", params)
    engine.add_request("drop", "a request that is aborted", params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("keep", "duplicate", params)
    for _ in range(3):
        engine.step()
    assert engine.abort_request("drop") is True
    assert engine.abort_request("drop") is False  # already gone: a no-op
    assert engine.abort_request("never-added") is False
    engine.check_invariants()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert len(finished[0].outputs[0].token_ids) == 50
    assert all_blocks_free(llm)


def test_trace_round_trips_through_json(llm):
    trace = llm.trace
    assert len(trace) > 0
    trace.check_consistency()  # ref counts = block-table entries, free iff ref 0, budget kept
    again = Trace.from_json(trace.to_json())
    assert again.to_json() == trace.to_json()
    step = trace.steps[0]
    assert step.token_budget == llm.engine.config.scheduler_config.max_num_batched_tokens
    assert len(step.ref_cnts) == llm.engine.num_kv_blocks
    assert step.num_scheduled_tokens <= step.token_budget


def test_kv_cache_sized_from_memory_budget(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=64, max_num_seqs=4)
    assert llm.engine.num_kv_blocks == 4 * 4 + 1  # capped at what 4 x 64 tokens could use
    llm = LLM(str(tiny_models["llama"]), max_model_len=64, kv_cache_memory_bytes=2 * 8192)
    assert llm.engine.num_kv_blocks == 2
