"""Async scheduling (``async_scheduling=True``): the core plans step N+1 while step N's
forward runs, and generates exactly what it generates without, token for token: Hugging
Face's greedy tokens under chunking and preemption, seeded samples, stop rules, logprobs,
structured outputs; through the in-process client and the core in its own process."""

import asyncio

import pytest

from microvllm import LLM, SamplingParams
from microvllm.core.async_scheduler import AsyncScheduler, with_async_scheduling
from microvllm.core.scheduler import Scheduler
from microvllm.engine.async_llm import AsyncLLM
from microvllm.sampling_params import StructuredOutputsParams
from tests.engine.conftest import hf_greedy, varied_prompts
from tests.engine.test_engine_parity import GREEDY, MAX_TOKENS, SETTINGS as PARITY_SETTINGS

SETTINGS = PARITY_SETTINGS   # every regime of the synchronous parity test


class CountingScheduler(Scheduler):
    """A learner's scheduler stand-in: counts plans, updates and preemptions, and records
    whether a plan was ever made while another one waited for its update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plans = self.updates = self.preemptions = self.most_in_flight = self.plans_with_drafts = 0

    def schedule(self):
        plan = super().schedule()
        self.plans += 1
        self.plans_with_drafts += bool(plan.scheduled_spec_decode_tokens)
        self.most_in_flight = max(self.most_in_flight, self.plans - self.updates)
        return plan

    def update_from_output(self, *args, **kwargs):
        self.updates += 1
        return super().update_from_output(*args, **kwargs)

    def _preempt(self, request):
        self.preemptions += 1
        super()._preempt(request)


def generate(folder, prompts, params, **settings):
    settings.setdefault("max_model_len", 256)
    llm = LLM(str(folder), debug_invariants=True, components={"scheduler": CountingScheduler}, **settings)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    manager = llm.llm_engine.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks, "a block leaked"
    return llm, outs


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen3_5"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_are_hugging_faces(tiny_models, arch, setting):
    prompts = varied_prompts(512, count=12, seed=21)
    settings = dict(SETTINGS[setting])
    if arch == "qwen3_5" and setting == "preemption":   # 4 cache groups per request
        settings["num_kv_blocks"] = 30
    llm, outs = generate(tiny_models[arch], prompts, GREEDY, async_scheduling=True, **settings)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].finish_reason == "length"
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(tiny_models[arch]), tuple(prompt), MAX_TOKENS), \
            f"prompt of {len(prompt)} tokens diverged under {setting}"
    scheduler = llm.llm_engine.scheduler
    assert isinstance(scheduler, AsyncScheduler) and isinstance(scheduler, CountingScheduler)
    assert scheduler.most_in_flight == 2, "no plan was made while the step before it ran"
    # A placeholder is no draft: without speculative decoding no plan schedules drafts (it once
    # did, empty ones, and sent every decode down the rejection sampler's path).
    assert scheduler.plans_with_drafts == 0
    if setting == "preemption":
        assert scheduler.preemptions, "the pool was meant to be small enough to preempt"


def test_without_async_scheduling_one_plan_at_a_time(tiny_models):
    llm, _ = generate(tiny_models["llama"], varied_prompts(512, count=4, seed=2), GREEDY)
    assert not isinstance(llm.llm_engine.scheduler, AsyncScheduler)
    assert llm.llm_engine.scheduler.most_in_flight == 1


PARAMS = {
    "seeded, preempted": (SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20),
                          dict(num_kv_blocks=14, max_num_batched_tokens=64)),
    "stop tokens and eos": (SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[5, 9, 17]), {}),
    "max_tokens 1": (SamplingParams(temperature=0.0, max_tokens=1), {}),
    "n=3, logprobs": (SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=10, logprobs=3, prompt_logprobs=2), {}),
    "min_tokens, penalties": (SamplingParams(temperature=0.0, max_tokens=16, min_tokens=8, repetition_penalty=1.3,
                                             presence_penalty=0.5), {}),
    "max_model_len": (SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), dict(max_model_len=80)),
    # the front end finds them and aborts the sample in the core, whose next step is in flight
    "stop strings": (SamplingParams(temperature=0.0, max_tokens=30, stop=["a", "e"], n=2), {}),
}


@pytest.mark.parametrize("case", list(PARAMS))
def test_same_outputs_as_without(tiny_models, case):
    """Everything a request can ask for comes out the same with async scheduling on: the
    token ids, finish reasons, stop reasons and logprobs."""
    params, settings = PARAMS[case]
    prompts = varied_prompts(512, count=10, seed=5)
    results = {}
    for on in (False, True):
        _, outs = generate(tiny_models["llama"], prompts, params, async_scheduling=on, **settings)
        results[on] = [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
                       + [o.prompt_logprobs] for o in outs]
    assert results[True] == results[False]


def test_structured_outputs_wait_for_the_token_their_mask_needs(tiny_models):
    """A grammar's mask for step N+1 needs the token step N samples: that plan waits for
    N's update. The outputs match their patterns and are those of synchronous steps."""
    patterns = [r"(ab|cd)+e", r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=p))
              for p in patterns] + [SamplingParams(temperature=0.0, max_tokens=24)]
    prompts = ["the engine", "a block table", "hello", "plain text alongside"]
    texts = {}
    for on in (False, True):
        llm = LLM(str(tiny_models["llama"]), max_model_len=256, async_scheduling=on, debug_invariants=True)
        texts[on] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert texts[True] == texts[False]
    assert texts[True][2] in ("yes", "no", "maybe")


def test_a_learners_scheduler_runs_under_async_scheduling():
    """``with_async_scheduling`` puts AsyncScheduler's overrides in front of the class it
    gets: the learner's ``schedule()`` is unchanged, the placeholders count in
    ``_cap_new_tokens``."""
    composed = with_async_scheduling(CountingScheduler)
    assert composed.__mro__[1:3] == (AsyncScheduler, CountingScheduler)
    assert with_async_scheduling(Scheduler) is AsyncScheduler
    assert with_async_scheduling(AsyncScheduler) is AsyncScheduler


@pytest.mark.parametrize("settings, words", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}}), "kv_transfer_config"),
    (dict(trace=True), "trace=True"),
])
def test_what_it_does_not_combine_with_is_refused(tiny_models, settings, words):
    with pytest.raises(ValueError, match=words):
        LLM(str(tiny_models["llama"]), max_model_len=256, async_scheduling=True, **settings)


def test_async_llm_streams_the_same_tokens(tiny_models):
    """AsyncLLM (the core in a thread here) with async scheduling: concurrent requests get
    LLM.generate's tokens, and an aborted one frees its blocks."""
    prompts = ["the engine", "a block table", "hello world and the scheduler", "tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(tiny_models["llama"]), max_model_len=256).generate(prompts, params, use_tqdm=False)]
    llm = AsyncLLM(str(tiny_models["llama"]), max_model_len=256, async_scheduling=True, multiprocess=False)
    try:
        async def one(prompt, i):
            return [out async for out in llm.generate(prompt, params, f"r{i}")][-1].outputs[0].token_ids

        async def all_at_once():
            return await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))

        assert asyncio.run(asyncio.wait_for(all_at_once(), 60)) == expected
    finally:
        llm.shutdown()


@pytest.mark.multiprocess
def test_the_core_in_its_own_process(tiny_models, monkeypatch):
    """The core in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``):
    EngineCoreProc's busy loop calls ``step_fn`` (the batch queue's step): Hugging Face's
    greedy tokens."""
    prompts = varied_prompts(512, count=6, seed=3)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, async_scheduling=True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert tuple(out.outputs[0].token_ids) == hf_greedy(str(tiny_models["llama"]), tuple(prompt), MAX_TOKENS)
    finally:
        llm.shutdown()


def test_a_fault_in_a_step_that_a_grammars_plan_waits_for(tmp_path, monkeypatch):
    """A structured request's plan waits for the step in flight (its mask needs that step's
    token). When that step raises, the waiting plan was made on top of it: it is undone
    with it and never sent. Fault isolation fails the request at fault; the others finish
    with the tokens they get alone."""
    from microvllm.engine.fault_isolation import FaultIsolation
    from microvllm.models.tiny import make_tiny_model

    folder = str(make_tiny_model(tmp_path / "llama", "llama", seed=4))
    mark = 0.777   # the faulty request's temperature: nothing else uses it
    regex = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"[a-e]+"))
    prompts = ["the engine", "a block table", "hello world"]
    params = [regex, SamplingParams(temperature=mark, max_tokens=12, ignore_eos=True), GREEDY]
    alone = [LLM(folder, max_model_len=128).generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids
             for p, q in ((prompts[0], regex), (prompts[2], GREEDY))]
    llm = LLM(folder, max_model_len=128, async_scheduling=True, debug_invariants=True)
    llm.llm_engine.core.fault_isolation = FaultIsolation()   # as AsyncLLM does
    sampler = llm.llm_engine.executor.worker.model_runner.sampler
    real, calls, faults = sampler.forward, [], []

    def faulty(logits, metadata):
        calls.append(1)
        # From the 4th step on (the grammar's request decodes, so its plan waits on the step
        # in flight), every step with the marked request raises: fault isolation pins it.
        if len(calls) < 4 or not (metadata.temperature == mark).any():
            return real(logits, metadata)
        faults.append(1)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(sampler, "forward", faulty)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert faults and outs[1].error and "injected fault" in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    manager = llm.llm_engine.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks
