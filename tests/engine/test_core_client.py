"""The engine core behind a client: in this process (``InprocClient``) or in a process of
its own (``SyncMPClient``, ``EngineCoreProc``), with msgspec on the socket.

The same requests give the same tokens through both; a core in another process refuses
what it cannot take with the same words; a core that dies fails its caller within
seconds and leaves no process behind; nothing but plain data crosses the socket.
"""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest

from microvllm import LLM, SamplingParams
from microvllm.core.outputs import EngineCoreOutput, LogprobsLists
from microvllm.core.stats import SchedulerStats
from microvllm.engine.core import EngineCoreOutputs, EngineCoreRequest
from microvllm.engine.core_client import DPLBMPClient, EngineDeadError, InprocClient, SyncMPClient
from microvllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from microvllm.models.tiny import make_tiny_model
from microvllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.multiprocess   # each test starts an engine core process (a few seconds)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


def _mp_llm(model: str, monkeypatch, **kwargs) -> LLM:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(model, **kwargs)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    return llm


def _summary(outputs):
    return [[(list(c.token_ids), c.text, c.finish_reason,
              [sorted(row) for row in c.logprobs] if c.logprobs is not None else None)
             for c in out.outputs] for out in outputs]


def test_the_same_tokens_through_both_clients(tiny, monkeypatch):
    """Greedy and seeded sampling, n > 1, stop strings, logprobs, prompt logprobs and a
    regex grammar: the same outputs whether the core runs here or in its own process."""
    prompts = ["hello there", "the cat sat on", {"prompt_token_ids": [5, 6, 7, 8, 9]}, "a b c d"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, stop=["e"], prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(regex="(ab|cd)+"))]
    here = LLM(tiny, max_model_len=128, num_kv_blocks=64)
    expected = here.generate(prompts, params, use_tqdm=False)
    assert isinstance(here.llm_engine.engine_core, InprocClient)
    there = _mp_llm(tiny, monkeypatch, max_model_len=128, num_kv_blocks=64)
    try:
        assert isinstance(there.llm_engine.engine_core, SyncMPClient)
        got = there.generate(prompts, params, use_tqdm=False)
        assert _summary(got) == _summary(expected)
        assert got[2].prompt_logprobs == expected[2].prompt_logprobs
        assert got[2].outputs[0].finish_reason == "stop" or got[2].outputs[0].finish_reason == "length"
        assert there.llm_engine.prefix_cache_queries == here.llm_engine.prefix_cache_queries > 0
        # A prompt seen before hits the prefix cache in the core's process (40 tokens: 2 blocks).
        long_prompt = {"prompt_token_ids": list(range(10, 50))}
        first, again = (there.generate(long_prompt, params[0], use_tqdm=False)[0] for _ in range(2))
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
        assert _summary([again]) == _summary([first])
    finally:
        there.shutdown()
    assert not there.llm_engine.engine_core.process.is_alive()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_data_parallel_cores_give_the_same_tokens(tiny, monkeypatch, async_scheduling):
    """``DPLBMPClient``: the requests (a request's n samples too) spread over two cores,
    each in its own process, and come back as one core in this process gives them."""
    prompts = ["hello there", "the cat sat on", {"prompt_token_ids": [5, 6, 7, 8, 9]}, "a b c d"] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, stop=["e"]),
              SamplingParams(temperature=0.0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(regex="(ab|cd)+"))] * 2
    expected = LLM(tiny, max_model_len=128, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    there = _mp_llm(tiny, monkeypatch, max_model_len=128, num_kv_blocks=64, data_parallel_size=2,
                    async_scheduling=async_scheduling)
    client = there.llm_engine.engine_core
    try:
        assert isinstance(client, DPLBMPClient) and len(client.cores) == 2
        assert _summary(there.generate(prompts, params, use_tqdm=False)) == _summary(expected)
        assert sorted(index for index, _ in there.llm_engine.prefix_cache_by_engine.items()) == [0, 1], \
            "every request went to one core"
        assert [core.in_flight for core in client.cores] == [0, 0]
    finally:
        there.shutdown()
    assert not any(core.process.is_alive() for core in client.cores)


def test_a_core_in_another_process_refuses_with_the_same_words(tiny, monkeypatch):
    llm = _mp_llm(tiny, monkeypatch, max_model_len=64, num_kv_blocks=4, block_size=16)
    try:
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.generate({"prompt_token_ids": [3] * 80}, use_tqdm=False)
        with pytest.raises(ValueError, match=r"needs \d+ KV blocks .* only 3 usable blocks"):
            llm.generate({"prompt_token_ids": [3] * 60}, use_tqdm=False)
        # Nothing was left behind: the core still serves.
        out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        with pytest.raises(RuntimeError, match="no utility method 'shutdown'"):
            llm.llm_engine.engine_core.call_utility("shutdown")   # only the listed methods are reachable
        with pytest.raises(AttributeError, match="process of its own"):
            llm.llm_engine.scheduler
    finally:
        llm.shutdown()


def test_the_course_hooks_need_the_core_in_this_process(tiny, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="trace=True .* another process"):
        LLM(tiny, max_model_len=64, trace=True)


def test_a_killed_core_fails_its_caller_within_seconds(tiny, monkeypatch):
    llm = _mp_llm(tiny, monkeypatch, max_model_len=128, num_kv_blocks=64)
    client = llm.llm_engine.engine_core
    engine = llm.llm_engine
    engine.add_request("long", "hello", SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.step()
    os.kill(client.process.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 5
    with pytest.raises(EngineDeadError):
        engine.add_request("after", "hello", SamplingParams(max_tokens=2))
    llm.shutdown()
    assert not client.process.is_alive()


def test_only_plain_data_crosses_the_socket():
    """msgspec, not pickle: a request and a step's outputs round-trip field for field, and an
    object with no encoding is refused rather than pickled."""
    params = SamplingParams(temperature=0.5, seed=3, stop=["x"], logit_bias={4: 1.5}, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}),
                            extra_args={"kv_transfer_params": {"do_remote_prefill": True}})
    params.bad_words_token_ids = [[1, 2]]
    request = EngineCoreRequest("0_7", [1, 2, 3], params, eos_token_id=2, arrival_time=1.5, cache_salt="s")
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert decoded == request and decoded.sampling_params.bad_words_token_ids == [[1, 2]]
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("0_7", (5, 6), "length", None, 16, None, LogprobsLists([[5, 1]], [[-0.5, -1.0]], [2]))],
        SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25, expert_load={"0": [3, 1]}), 12.5)
    assert MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs)) == outputs

    class Anything:
        def __reduce__(self):   # what pickle would run on the other side
            return (os.system, ("true",))

    with pytest.raises(TypeError, match="cannot cross to an engine core process"):
        MsgpackEncoder().encode(EngineCoreRequest("a", [1], params, None, 0.0, grammar=Anything()))
    with pytest.raises(msgspec.ValidationError):   # a malformed message is refused field by field
        MsgpackDecoder(EngineCoreRequest).decode(msgspec.msgpack.encode({"request_id": 7}))


def test_a_core_that_cannot_start_says_why_and_leaves_no_process(tmp_path, monkeypatch):
    """The weights are loaded in the core's process: a broken file there is an error here,
    raised within seconds (the startup handshake), with the core's own words."""
    import multiprocessing

    folder = make_tiny_model(tmp_path / "broken", "llama")
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])   # truncated: the header promises more
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    started = time.monotonic()
    with pytest.raises(ValueError, match="is not a readable safetensors file"):   # the loader's own words
        LLM(str(folder), max_model_len=64)
    assert time.monotonic() - started < 60
    assert not [p for p in multiprocessing.active_children() if p.name == "microvllm-engine-core"]
