"""Tensor parallelism: the same greedy tokens as Hugging Face (tiny models) or as one
process (the default model), with the model split over worker processes; a dead worker
is an error within seconds; no worker process outlives its LLM.

Each multiprocess engine costs seconds to start (every rank imports torch and loads its
shard), so each test drives one engine through several regimes at once: chunked prefill
(a 32-token budget), preemption (a 14-block pool) and prefix caching (shared prefixes).
"""

import multiprocessing
import os
import threading
import time

import pytest

from microvllm import LLM, SamplingParams
from microvllm.executor.multiproc_executor import WorkerError
from microvllm.models.tiny import make_tiny_model
from tests.engine.conftest import hf_greedy, varied_prompts

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCH_SEEDS = {"llama": 11, "mistral": 12, "qwen3": 13}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_pids(llm) -> list[int]:
    return [proc.pid for proc in llm.engine.executor.procs]


def assert_all_exited(pids, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"worker processes left running: {pids}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_tp2_matches_hf_under_chunking_preemption_and_prefix_caching(tiny_models, arch):
    folder = tiny_models[arch]
    prompts = varied_prompts(512, count=12, seed=ARCH_SEEDS[arch])   # fixed: hash(str) varies per run
    llm = LLM(str(folder), tensor_parallel_size=2, max_model_len=128, num_kv_blocks=14,
              max_num_batched_tokens=32, trace=True, debug_invariants=True)
    pids = worker_pids(llm)
    assert len(pids) == 2 and all(alive(p) for p in pids)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert tuple(out.outputs[0].token_ids) == hf_greedy(str(folder), tuple(prompt), MAX_TOKENS), \
                f"{arch}, tp=2: a prompt of {len(prompt)} tokens diverged from Hugging Face"
        trace = llm.trace
        assert trace.preemption_steps(), "the pool was meant to be small enough to preempt"
        assert any(s.kind == "prefill" and s.num_scheduled_tokens < s.num_prompt_tokens
                   for step in trace for s in step.scheduled), "no prompt was chunked"
        assert any(s.prefix_hit_tokens for step in trace for s in step.scheduled), "no prefix-cache hit"
        if arch == "mistral":
            assert max(len(p) for p in prompts) + MAX_TOKENS > 8, "the sliding window should be active"
        if arch == "llama":
            # Seeded random sampling: every rank samples from the same gathered logits with the
            # same generators; a rank that drew differently would feed the others wrong tokens.
            sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
                       for i in range(4)]
            one_process = LLM(str(folder), max_model_len=128, num_kv_blocks=14, max_num_batched_tokens=32)
            requests = [{"prompt_token_ids": p} for p in prompts[:4]]
            assert [o.outputs[0].token_ids for o in llm.generate(requests, sampled, use_tqdm=False)] == \
                   [o.outputs[0].token_ids for o in one_process.generate(requests, sampled, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert_all_exited(pids)


@pytest.mark.multiprocess
def test_default_model_tp3_matches_tp1(default_model_folder):
    """SmolLM2-135M: 9 query heads and 3 KV heads, one KV head per rank at tp=3."""
    prompts = [{"prompt_token_ids": p} for p in varied_prompts(49152, count=4, seed=5, max_len=24)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(default_model_folder), max_model_len=128).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(default_model_folder), tensor_parallel_size=3, max_model_len=128)
    pids = worker_pids(llm)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del llm   # garbage collection stops the workers too (weakref.finalize)
    assert got == expected
    assert_all_exited(pids)


@pytest.mark.multiprocess
def test_a_killed_worker_is_a_clear_error_not_a_hang(tmp_path):
    # A vocabulary of 509 does not divide by 2: each rank holds 255 rows, the last one padding.
    folder = make_tiny_model(tmp_path, "llama", seed=3, tokenizer=False, vocab_size=509)
    llm = LLM(str(folder), tensor_parallel_size=2, max_model_len=1024)
    pids = worker_pids(llm)
    prompt = [5, 6, 7, 508]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert tuple(out.outputs[0].token_ids) == hf_greedy(str(folder), tuple(prompt), MAX_TOKENS)
    # Kill rank 1 while a long generation runs.
    victim = pids[1]
    threading.Timer(0.5, os.kill, (victim, 9)).start()
    started = time.monotonic()
    with pytest.raises(WorkerError, match=f"worker rank 1 \\(pid {victim}\\) died"):
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 15
    assert_all_exited(pids)   # the executor stopped rank 0 too
    with pytest.raises(WorkerError, match="create a new LLM"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)


@pytest.mark.multiprocess
def test_an_error_in_a_worker_arrives_with_its_traceback(tmp_path):
    """The engine process reads config.json only; the workers read the weights."""
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    before = set(multiprocessing.active_children())
    with pytest.raises(WorkerError, match=r"(?s)worker rank \d \(pid \d+\) raised in startup\(\):\n"
                                          r"Traceback .*not a readable safetensors file"):
        LLM(str(folder), tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before


def test_heads_that_do_not_divide_are_refused_before_any_worker_starts(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=72,
                             num_attention_heads=9, num_key_value_heads=3)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"num_attention_heads=9 .*tensor_parallel_size=2.*"
                                         r"Choose tensor_parallel_size from \[1, 3, 9\]"):
        LLM(str(folder), tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before
