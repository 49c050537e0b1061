"""Expert parallelism (``enable_expert_parallel=True``): each of 2 worker processes holds
half the experts, whole, and tokens travel to them by all-to-all
(``layers/fused_moe/expert_parallel.py``). The same greedy tokens as one process and as
Hugging Face, under chunked prefill, preemption and prefix hits at once; a killed rank
is a clear error; what cannot be split is refused before any worker starts."""

import multiprocessing
import os
import threading
import time

import pytest

from microvllm import LLM, SamplingParams
from microvllm.executor.multiproc_executor import WorkerError
from microvllm.models.tiny import make_tiny_model
from tests.engine.conftest import hf_greedy, varied_prompts
from tests.engine.test_tensor_parallel import alive, assert_all_exited, worker_pids

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_ep2_matches_one_process_and_hf(tiny_models, arch):
    folder = tiny_models[arch]
    prompts = varied_prompts(512, count=12, seed={"qwen3_moe": 31, "mixtral": 32}[arch])
    settings = dict(max_model_len=128, num_kv_blocks=14, max_num_batched_tokens=32, trace=True,
                    debug_invariants=True)
    one = LLM(str(folder), **settings)
    expected = generate(one, prompts)
    llm = LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True, **settings)
    pids = worker_pids(llm)
    try:
        experts = llm.engine.config.parallel_config
        assert experts.enable_expert_parallel and experts.tensor_parallel_size == 2
        assert generate(llm, prompts) == expected
        for prompt, tokens in zip(prompts, expected):
            assert tokens == hf_greedy(str(folder), tuple(prompt), MAX_TOKENS)
        trace = llm.trace
        assert trace.preemption_steps(), "the 14-block pool was meant to preempt"
        assert any(s.kind == "prefill" and s.num_scheduled_tokens < s.num_prompt_tokens
                   for step in trace for s in step.scheduled), "no prompt was chunked"
        assert any(s.prefix_hit_tokens for step in trace for s in step.scheduled), "no prefix hit"
        # Every step's routed pairs: k per computed token, in every MoE layer.
        top_k = 2
        for step in trace:
            for counts in step.expert_load.values():
                assert sum(counts) == top_k * step.num_scheduled_tokens
        # The ranks count what one process counts: same routing, same steps.
        assert [s.expert_load for s in one.trace] == [s.expert_load for s in trace]
    finally:
        llm.shutdown()
    assert_all_exited(pids)


@pytest.mark.multiprocess
def test_a_killed_expert_parallel_rank_is_a_clear_error(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3_moe", seed=3, tokenizer=False)
    llm = LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=1024)
    pids = worker_pids(llm)
    assert all(alive(p) for p in pids)
    victim = pids[1]
    threading.Timer(0.5, os.kill, (victim, 9)).start()
    started = time.monotonic()
    with pytest.raises(WorkerError, match=f"worker rank 1 \\(pid {victim}\\) died"):
        llm.generate({"prompt_token_ids": [5, 6, 7]},
                     SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 15
    assert_all_exited(pids)


@pytest.mark.parametrize("overrides, settings, message", [
    (dict(num_experts=6), dict(tensor_parallel_size=4, enable_expert_parallel=True),
     r"num_experts=6 is not divisible by tensor_parallel_size=4"),
    (dict(moe_intermediate_size=30), dict(tensor_parallel_size=4),
     r"moe_intermediate_size=30 is not divisible by tensor_parallel_size=4"),
])
def test_experts_that_do_not_split_are_refused_before_any_worker_starts(tmp_path, overrides, settings, message):
    folder = make_tiny_model(tmp_path, "qwen3_moe", tokenizer=False, **overrides)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **settings)
    assert set(multiprocessing.active_children()) == before


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    with pytest.raises(ValueError, match="this model has no experts"):
        LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True)
