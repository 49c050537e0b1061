"""No lost work, no hang: every request ends finished (with a reason) or aborted, every
aborted or preempted request gives back all its blocks, a request that can never be
scheduled raises an error that says why instead of spinning, and Ctrl-C (or an error)
in the middle of a step leaves an engine that is consistent and still right."""

import functools

import pytest

from microvllm import LLM, SamplingParams
from microvllm.core import PoolTooSmallError, RequestStatus
from tests.engine.conftest import hf_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [list(range(10, 10 + n)) for n in (3, 17, 30, 9, 24)]  # some share a prefix
# 12 usable blocks of 4 tokens, 8 tokens a step: chunked prefill, waiting requests,
# and preemption whenever two long requests decode together.
TIGHT = dict(max_model_len=64, block_size=4, num_kv_blocks=13, max_num_batched_tokens=8)


@functools.lru_cache(maxsize=None)
def alone(folder: str, prompt: tuple, max_tokens: int = MAX_TOKENS) -> list[int]:
    """What the engine generates for this prompt alone, in a roomy configuration."""
    llm = _roomy(folder)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)[0].outputs[0].token_ids


@functools.lru_cache(maxsize=None)
def _roomy(folder: str) -> LLM:
    return LLM(folder, max_model_len=128, enable_prefix_caching=False)


def test_reference_matches_hugging_face(tiny_llama):
    for prompt in PROMPTS[:2]:
        assert tuple(alone(str(tiny_llama), tuple(prompt))) == hf_greedy(str(tiny_llama), tuple(prompt), MAX_TOKENS)


def all_free(engine) -> bool:
    manager = engine.kv_cache_manager
    return manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks


def holds_no_block(engine, request_id) -> bool:
    return not any(engine.kv_cache_manager.get_block_ids(request_id))


def run(engine, max_steps=1000) -> dict:
    """Step to the end; the final output of each request. Fails instead of spinning."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} finished twice"
                finished[out.request_id] = out
    raise AssertionError(f"no progress after {max_steps} steps: {engine.scheduler.requests}")


# ----------------------------------------------------------------- every request ends
def test_every_request_ends_with_a_reason(tiny_llama):
    llm = LLM(str(tiny_llama), debug_invariants=True, **{**TIGHT, "num_kv_blocks": 17})  # 64 tokens
    engine = llm.engine
    ref = alone(str(tiny_llama), tuple(PROMPTS[1]))
    stop_token = ref[3]
    submitted = {
        "length": ({"prompt_token_ids": PROMPTS[0]}, GREEDY),
        "stop-token": ({"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token])),
        "n=3": ({"prompt_token_ids": PROMPTS[2]},
                SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)),
        "max_model_len": ({"prompt_token_ids": list(range(100, 156))},
                          SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)),
        "seeded": ({"prompt_token_ids": PROMPTS[3]},
                   SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=5, ignore_eos=True)),
        "text": ("Hello there", SamplingParams(temperature=0, max_tokens=3)),
    }
    for request_id, (prompt, params) in submitted.items():
        engine.add_request(request_id, prompt, params)
    finished = run(engine)
    assert set(finished) == set(submitted)
    for request_id, out in finished.items():
        assert out.finished
        for completion in out.outputs:
            assert completion.finish_reason in ("stop", "length"), (request_id, completion)
    assert finished["length"].outputs[0].token_ids == alone(str(tiny_llama), tuple(PROMPTS[0]))
    stop = finished["stop-token"].outputs[0]
    assert (stop.finish_reason, stop.stop_reason) == ("stop", stop_token)
    assert stop.token_ids == ref[:ref.index(stop_token) + 1]
    assert [c.token_ids for c in finished["n=3"].outputs] == [alone(str(tiny_llama), tuple(PROMPTS[2]))] * 3
    capped = finished["max_model_len"].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 64 - 56
    assert all_free(engine)


# ----------------------------------------------------------------- aborts free blocks
def test_abort_in_every_state_frees_the_blocks(tiny_llama):
    llm = LLM(str(tiny_llama), debug_invariants=True, **TIGHT)
    engine = llm.engine
    engine.add_request("decoding", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.add_request("prefilling", {"prompt_token_ids": PROMPTS[2]}, GREEDY)  # 30 tokens: 4 chunks
    engine.add_request("waiting", {"prompt_token_ids": PROMPTS[4]}, GREEDY)
    engine.add_request("n=2", {"prompt_token_ids": PROMPTS[3]},
                       SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.add_request("keeps going", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.step()
    engine.step()
    scheduler = engine.scheduler
    status = {r.request_id: r for r in scheduler.requests.values()}
    assert status["decoding"].num_output_tokens > 0
    assert 0 < status["prefilling"].num_computed_tokens < 30 and status["prefilling"].status == RequestStatus.RUNNING
    assert status["waiting"].status == RequestStatus.WAITING
    for request_id in ("prefilling", "waiting", "decoding"):
        assert engine.abort_request(request_id)
        assert holds_no_block(engine, request_id) and request_id not in scheduler.requests
        engine.check_invariants()
    for _ in range(50):  # until the n=2 request's first sample is decoding
        engine.step()
        if scheduler.requests["0_n=2"].num_output_tokens:
            break
    assert 0 < scheduler.requests["0_n=2"].num_output_tokens < MAX_TOKENS
    assert engine.abort_request("n=2")  # both samples are stopped, wherever they are
    assert holds_no_block(engine, "0_n=2") and holds_no_block(engine, "1_n=2")
    finished = run(engine)
    assert list(finished) == ["keeps going"]
    assert finished["keeps going"].outputs[0].token_ids == alone(str(tiny_llama), tuple(PROMPTS[1]))
    assert all_free(engine)


# ------------------------------------------------------------ preemption frees blocks
def test_preempted_requests_hold_no_blocks_and_lose_no_work(tiny_llama):
    llm = LLM(str(tiny_llama), trace=True, debug_invariants=True, **TIGHT)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finished, preemptions = {}, 0
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        for request_id in llm.trace.steps[-1].preempted:
            preemptions += 1
            request = engine.scheduler.requests[request_id]
            if request.status == RequestStatus.PREEMPTED:  # not already readmitted this step
                assert holds_no_block(engine, request_id) and request.num_computed_tokens == 0
    assert preemptions > 0, "the pool was meant to be tight enough to preempt"
    for i, prompt in enumerate(PROMPTS):
        assert finished[str(i)].outputs[0].token_ids == alone(str(tiny_llama), tuple(prompt), 16), i
    assert all_free(engine)


# ------------------------------------------------------------------ never spin forever
def test_request_that_outgrows_the_pool_raises_instead_of_spinning(tiny_llama):
    """8 usable blocks of 4 = 32 tokens: a 20-token prompt starts, but cannot grow to
    20 + 30 tokens. When it can neither run nor be admitted, step() says why."""
    llm = LLM(str(tiny_llama), max_model_len=64, block_size=4, num_kv_blocks=9, debug_invariants=True)
    engine = llm.engine
    engine.add_request("big", {"prompt_token_ids": PROMPTS[4][:20]},
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    with pytest.raises(PoolTooSmallError) as error:
        run(engine, max_steps=100)
    message = str(error.value)
    assert "request 'big'" in message and "only 8 usable blocks" in message and "num_kv_blocks" in message
    engine.check_invariants()
    assert engine.abort_request("big") and all_free(engine)
    # Through generate: the error propagates, nothing is left behind, the LLM still works.
    with pytest.raises(PoolTooSmallError):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[4][:20]}],
                     SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert not engine.has_unfinished_requests() and all_free(engine)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone(str(tiny_llama), tuple(PROMPTS[0]))


def test_sliding_window_prompt_that_needs_big_chunks_is_refused_at_the_door(tiny_folders):
    """Mistral (window 8): a 30-token prompt fits 4 blocks when computed a few tokens at
    a time, but a 32-token budget computes it in one chunk of 8 blocks. That is refused
    when it is added, not after it started; a small budget runs it."""
    folder = str(tiny_folders["mistral"])
    prompt = {"prompt_token_ids": PROMPTS[2]}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    big_budget = LLM(folder, max_model_len=128, block_size=4, num_kv_blocks=5, max_num_batched_tokens=32)
    with pytest.raises(PoolTooSmallError) as error:
        big_budget.engine.add_request("long", prompt, params)
    assert "needs 8 KV blocks" in str(error.value) and big_budget.engine.num_steps == 0
    small_budget = LLM(folder, max_model_len=128, block_size=4, num_kv_blocks=5, max_num_batched_tokens=4,
                       debug_invariants=True)
    out = small_budget.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == alone(folder, tuple(PROMPTS[2]), 20)


# ------------------------------------------------------------------------- Ctrl-C
class Interrupt:
    """Wraps a callable; raises ``error`` on call number ``at`` (1-based), once."""

    def __init__(self, wrapped, at: int, error=KeyboardInterrupt):
        self.wrapped, self.at, self.error, self.calls = wrapped, at, error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error()
        return self.wrapped(*args, **kwargs)


def assert_clean_and_right(llm, folder):
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert all_free(engine)
    engine.check_invariants()
    # The same prompts again: any prefix-cache hit must hold KV that was really written.
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == alone(folder, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert all_free(engine)


@pytest.mark.parametrize("at", [1, 3, 7])
def test_keyboard_interrupt_between_steps(tiny_llama, monkeypatch, at):
    llm = LLM(str(tiny_llama), debug_invariants=True, **TIGHT)
    monkeypatch.setattr(llm.engine, "step", Interrupt(llm.engine.step, at))
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_right(llm, str(tiny_llama))


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("at", [1, 2, 5])
def test_interrupt_inside_the_model(tiny_llama, monkeypatch, at, error):
    """Ctrl-C while the model runs: the step's KV may be half written, yet its blocks
    were already registered in the prefix cache when the step was planned. They must be
    forgotten, or the next identical prompt reads KV that was never written."""
    llm = LLM(str(tiny_llama), debug_invariants=True, **TIGHT)
    executor = llm.engine.executor
    monkeypatch.setattr(executor, "execute_model", Interrupt(executor.execute_model, at, error))
    with pytest.raises(error):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_right(llm, str(tiny_llama))


def test_engine_loop_continues_after_an_interrupted_step(tiny_llama, monkeypatch):
    """Driving the engine by hand: catch the interrupt and keep stepping. The step's
    requests are recomputed; nothing is lost and the outputs are unchanged. Interrupting
    more often than there are runner slots (max_num_seqs) must not leak them."""
    llm = LLM(str(tiny_llama), debug_invariants=True, max_num_seqs=2, **TIGHT)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    real = engine.executor.execute_model
    calls = 0

    def flaky(plan):
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise KeyboardInterrupt
        return real(plan)

    monkeypatch.setattr(engine.executor, "execute_model", flaky)
    finished, interrupts = {}, 0
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            interrupts += 1
            engine.check_invariants()
            continue
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
    assert interrupts > 2 * 2
    for i, prompt in enumerate(PROMPTS):
        assert finished[str(i)].outputs[0].token_ids == alone(str(tiny_llama), tuple(prompt)), i
    assert all_free(engine)


def test_keyboard_interrupt_while_streaming(tiny_llama):
    llm = LLM(str(tiny_llama), debug_invariants=True, **TIGHT)
    stream = llm.stream({"prompt_token_ids": PROMPTS[1]}, GREEDY)
    next(stream)
    with pytest.raises(KeyboardInterrupt):
        stream.throw(KeyboardInterrupt)
    assert_clean_and_right(llm, str(tiny_llama))


def test_interrupt_after_the_model_ran_raises_instead_of_spinning(tiny_llama, monkeypatch):
    """Ctrl-C in the instant between the model's return and the scheduler taking its
    sampled tokens: the request's tokens are all computed, but it has no new one. A
    hand-driven loop that steps on gets an error naming it, not an endless loop;
    ``generate`` simply aborts its requests."""
    llm = LLM(str(tiny_llama), debug_invariants=True, **TIGHT)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    scheduler = engine.scheduler
    monkeypatch.setattr(scheduler, "update_from_output", Interrupt(scheduler.update_from_output, 1))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(RuntimeError) as error:
        run(engine, max_steps=10)
    assert "running request 'a'" in str(error.value) and "abort" in str(error.value)
    assert engine.abort_request("a") and all_free(engine)
    monkeypatch.setattr(scheduler, "update_from_output", Interrupt(scheduler.update_from_output, 2))
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_right(llm, str(tiny_llama))
