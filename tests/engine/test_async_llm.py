"""AsyncLLM: the same greedy tokens as LLM.generate, cancellation frees blocks, many
concurrent requests finish, bad requests are refused without harming the engine."""

import asyncio

import pytest

from microvllm import LLM, SamplingParams
from microvllm.engine.async_llm import AsyncLLM, EngineDeadError

SETTINGS = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = ["the engine", "a block table", "hello world and the scheduler", "tokens"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def async_llm(tiny_models, request):
    """One engine per scheduling mode: every test that uses it runs with async scheduling
    off and on (the core plans a step while the step before it runs)."""
    llm = AsyncLLM(str(tiny_models["llama"]), async_scheduling=request.param, **SETTINGS)
    yield llm
    llm.shutdown()
    assert not llm._thread.is_alive()


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(llm, prompt, params, request_id=None):
    outs = [out async for out in llm.generate(prompt, params, request_id)]
    return outs


def test_same_greedy_tokens_as_llm_generate(async_llm, tiny_models):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = LLM(str(tiny_models["llama"]), **SETTINGS).generate(PROMPTS, params, use_tqdm=False)

    async def all_at_once():
        return await asyncio.gather(*(collect(async_llm, p, params) for p in PROMPTS))

    results = run(all_at_once())
    for outs, want in zip(results, expected):
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert final.outputs[0].token_ids == want.outputs[0].token_ids
        assert final.outputs[0].text == want.outputs[0].text
        # The deltas add up to the whole: each output is a snapshot, not a shared object.
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == want.outputs[0].token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == want.outputs[0].text


async def wait_until(predicate, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_cancelling_a_generator_aborts_the_request_and_frees_its_blocks(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    engine = async_llm.engine

    async def cancel_midway():
        seen, two_outputs = [], asyncio.Event()

        async def consume():
            async for out in async_llm.generate("the engine " * 8, params, "to-cancel"):
                seen.append(out)
                if len(seen) == 2:
                    two_outputs.set()
        task = asyncio.create_task(consume())
        await asyncio.wait_for(two_outputs.wait(), 60)
        assert engine.kv_cache_manager.usage > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: async_llm.metrics.num_requests_running == 0
                         and async_llm.metrics.kv_cache_usage_perc == 0.0)
        return seen

    seen = run(cancel_midway())
    assert not seen[-1].finished and len(seen[-1].outputs[0].token_ids) < 900
    assert engine.kv_cache_manager.usage == 0.0


def test_many_concurrent_requests_finish(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def many():
        return await asyncio.gather(*(collect(async_llm, f"request {i} the", params) for i in range(32)))

    results = run(many(), timeout=120)
    assert all(outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6 for outs in results)
    assert async_llm.engine.kv_cache_manager.usage == 0.0
    settled(async_llm)


def settled(async_llm) -> None:
    """Nothing left in the engine. With async scheduling the step planned while the last
    one ran is still in flight when the last output arrives: the engine thread updates from
    it (and throws its tokens away) a moment later."""
    run(wait_until(lambda: not async_llm.engine.has_unfinished_requests()))


def test_bad_request_raises_and_engine_stays_usable(async_llm):
    async def bad_then_good():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(async_llm, {"prompt_token_ids": [5] * 1100}, SamplingParams(max_tokens=4))
        return await collect(async_llm, "ok", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))

    outs = run(bad_then_good())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


def test_shutdown_refuses_new_requests(tiny_models):
    llm = AsyncLLM(str(tiny_models["llama"]), **SETTINGS)
    llm.shutdown()
    assert not llm._thread.is_alive()
    with pytest.raises(EngineDeadError):
        run(collect(llm, "hi", SamplingParams(max_tokens=2)))


def test_trace_records_arrivals_and_the_timeline_marks_them(tiny_models):
    """A request that arrives while another runs: its arrival step is recorded, its
    first token comes at or after it, and the timeline draws both markers."""
    from microvllm.viz.timeline import plot_timeline

    llm = AsyncLLM(str(tiny_models["llama"]), trace=True, **SETTINGS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def staggered():
        three, later = asyncio.Event(), []

        async def first():
            count = 0
            async for _ in llm.generate("the engine", params, "early"):
                count += 1
                if count == 3:
                    three.set()
        task = asyncio.create_task(first())
        await asyncio.wait_for(three.wait(), 60)
        later = await collect(llm, "a block table", params, "late")
        await task
        return later

    try:
        run(staggered())
    finally:
        llm.shutdown()
    trace = llm.engine.trace
    assert trace.arrival_steps["early"] == 0 and trace.arrival_steps["late"] >= 3
    first_tokens = trace.first_token_steps()
    assert first_tokens["late"] >= trace.arrival_steps["late"] and first_tokens["early"] == 0
    ax = plot_timeline(trace).axes[0]
    gids = {c.get_gid() for c in ax.collections}
    assert {"arrivals", "first-tokens"} <= gids


def test_delta_and_final_only_output_kinds(async_llm, tiny_models):
    """vLLM's RequestOutputKind: DELTA outputs hold only the new tokens and text (they add
    up to the whole), FINAL_ONLY yields one output."""
    from microvllm import RequestOutputKind

    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    whole = run(collect(async_llm, "the engine", SamplingParams(**base)))[-1].outputs[0]
    deltas = run(collect(async_llm, "the engine", SamplingParams(**base, output_kind=RequestOutputKind.DELTA)))
    assert len(deltas) > 1 and deltas[-1].finished
    assert [t for o in deltas for t in o.outputs[0].token_ids] == whole.token_ids
    assert "".join(o.outputs[0].text for o in deltas) == whole.text
    assert [row for o in deltas for row in o.outputs[0].logprobs] == whole.logprobs
    final = run(collect(async_llm, "the engine", SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == whole.token_ids


def test_vllm_async_streaming_shape(tiny_models):
    """What vLLM's examples/offline_inference/async_llm_streaming.py does, with the import
    edit (vllm.engine.arg_utils -> microvllm, vllm.v1.engine.async_llm -> microvllm.engine):
    AsyncEngineArgs, AsyncLLM.from_engine_args, generate by keyword with DELTA outputs."""
    from microvllm import AsyncEngineArgs, RequestOutputKind

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_models["llama"]), enforce_eager=True,
                                                       **SETTINGS))
    try:
        params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=42,
                                output_kind=RequestOutputKind.DELTA)

        async def stream():
            pieces = []
            async for output in engine.generate(request_id="stream-1", prompt="In a galaxy",
                                                sampling_params=params):
                pieces.extend(completion.text for completion in output.outputs)
                if output.finished:
                    break
            return pieces

        pieces = run(stream())
        again = LLM(str(tiny_models["llama"]), enforce_eager=True, **SETTINGS).generate(   # the same draw
            "In a galaxy", SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=42), use_tqdm=False)
        assert "".join(pieces) == again[0].outputs[0].text
    finally:
        engine.shutdown()


def test_a_request_cancelled_before_the_engine_takes_it_leaves_the_engine_running(async_llm):
    """A client that hangs up while its request waits for the engine thread cancels the
    request's future; the engine thread must skip it (it once raised InvalidStateError
    there and the engine-core loop died: every later request got 503)."""
    import concurrent.futures

    processed = async_llm.engine.process_request("cancelled-early", "hello", SamplingParams(max_tokens=2))
    future = concurrent.futures.Future()
    future.cancel()
    async_llm._commands.put(("add", processed, future))
    outs = run(collect(async_llm, "still here", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    assert outs[-1].finished and async_llm.is_running
    settled(async_llm)   # the cancelled one was never added
