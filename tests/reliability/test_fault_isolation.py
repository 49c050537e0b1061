"""Defence in depth when serving (``AsyncLLM`` turns it on; offline ``LLM`` raises, as
vLLM's does): an exception inside an engine step fails only the request it can be
pinned on (its blocks freed, its caller told why); every other request of the batch
completes with exactly the tokens it gives alone, and the engine keeps serving.
Only an error that leaves the engine's state unknown (a dead worker) stops it.

The fault is injected into one request's sampling: the sampler raises whenever a row
with that request's (otherwise unused) temperature is in the batch, whatever else is.
"""

import pytest

from microvllm import LLM, SamplingParams
from microvllm.engine.fault_isolation import FaultIsolation
from microvllm.executor.multiproc_executor import WorkerError
from tests.reliability.test_lifecycle import PROMPTS, TIGHT, Interrupt, all_free, alone, assert_clean_and_right, run

MARK = 0.777   # the faulty request's temperature: nothing else uses it
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def serving_llm(folder, **settings) -> LLM:
    llm = LLM(folder, **settings)
    llm.engine.fault_isolation = FaultIsolation()   # as AsyncLLM does
    return llm


def inject_sampling_fault(monkeypatch, llm, error=RuntimeError("injected fault in sampling")):
    sampler = llm.engine.executor.worker.model_runner.sampler
    real = sampler.forward
    calls = {"faults": 0}

    def faulty(logits, metadata):
        if (metadata.temperature == MARK).any():
            calls["faults"] += 1
            raise error
        return real(logits, metadata)

    monkeypatch.setattr(sampler, "forward", faulty)
    return calls


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async_scheduling"])
@pytest.mark.parametrize("faulty_index", [0, 2, 4])
@pytest.mark.parametrize("n", [1, 2])
def test_a_fault_in_one_requests_sampling_fails_only_that_request(tiny_llama, monkeypatch, faulty_index, n,
                                                                   async_scheduling):
    """With async scheduling the step planned after the faulty one is undone with it."""
    folder = str(tiny_llama)
    llm = serving_llm(folder, debug_invariants=True, async_scheduling=async_scheduling,
                      **TIGHT)   # chunked prefill, preemption, prefix hits
    calls = inject_sampling_fault(monkeypatch, llm)
    params = [GREEDY] * len(PROMPTS)
    params[faulty_index] = SamplingParams(n=n, temperature=MARK, max_tokens=8, ignore_eos=True, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert calls["faults"] >= 1
    for index, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        if index == faulty_index:
            assert out.finished and len(out.outputs) == n
            assert all(c.finish_reason == "error" for c in out.outputs)
            assert "injected fault in sampling" in out.error
        else:
            assert out.error is None
            assert out.outputs[0].token_ids == alone(folder, tuple(prompt)), f"request {index}"
    assert all_free(llm.engine) and not llm.engine.fault_isolation.active
    monkeypatch.undo()
    assert_clean_and_right(llm, folder)


def test_engine_driven_by_hand_reports_the_failed_request_once(tiny_llama, monkeypatch):
    llm = serving_llm(str(tiny_llama), debug_invariants=True, **TIGHT)
    engine = llm.engine
    inject_sampling_fault(monkeypatch, llm)
    engine.add_request("good", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.add_request("bad", {"prompt_token_ids": PROMPTS[2]},
                       SamplingParams(temperature=MARK, max_tokens=8, ignore_eos=True))
    finished = run(engine)   # fails if a request finishes twice or the engine spins
    assert finished["bad"].error and finished["bad"].outputs[0].finish_reason == "error"
    assert finished["good"].outputs[0].token_ids == alone(str(tiny_llama), tuple(PROMPTS[1]))
    assert all_free(engine)


def test_a_fault_in_every_step_fails_each_request_and_the_engine_stays_usable(tiny_llama, monkeypatch):
    """Not any request's fault (every step raises): each request is blamed in turn, each
    is reported, every block comes back; afterwards the engine serves normally."""
    llm = serving_llm(str(tiny_llama), debug_invariants=True, **TIGHT)
    executor = llm.engine.executor

    def broken(plan):
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(executor, "execute_model", broken)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] * len(PROMPTS)
    assert all("the model is broken" in o.error for o in outs)
    monkeypatch.undo()
    assert_clean_and_right(llm, str(tiny_llama))


def test_a_dead_worker_stops_the_engine_instead(tiny_llama, monkeypatch):
    """A dead tensor-parallel worker leaves the engine's state unknown: that is raised."""
    llm = serving_llm(str(tiny_llama), **TIGHT)

    def dead(plan):
        raise WorkerError("worker 1 died")

    monkeypatch.setattr(llm.engine.executor, "execute_model", dead)
    with pytest.raises(WorkerError):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)


def test_offline_the_error_is_raised_and_the_llm_goes_on(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), debug_invariants=True, **TIGHT)
    inject_sampling_fault(monkeypatch, llm)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=MARK), use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_right(llm, str(tiny_llama))


@pytest.mark.parametrize("at", [1, 2, 5])
def test_an_error_inside_the_model_once_is_retried(tiny_llama, monkeypatch, at):
    """An exception (not Ctrl-C) inside one step, once: the step is undone and its requests
    retried one suspect at a time; each passes alone, so nothing fails and every output
    is what the request gives alone."""
    llm = serving_llm(str(tiny_llama), debug_invariants=True, **TIGHT)
    executor = llm.engine.executor
    monkeypatch.setattr(executor, "execute_model", Interrupt(executor.execute_model, at, RuntimeError))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert executor.execute_model.calls > at
    for prompt, out in zip(PROMPTS, outs):
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == alone(str(tiny_llama), tuple(prompt))
    monkeypatch.undo()
    assert_clean_and_right(llm, str(tiny_llama))
