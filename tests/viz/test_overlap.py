"""OverlapRecorder and plot_overlap: a real run's calls on a time axis, per thread."""

from types import SimpleNamespace

import pytest
from matplotlib.figure import Figure

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.viz import OverlapRecorder, plot_overlap

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=2))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_recorder_times_what_ran_and_leaves_nothing_behind(tiny, async_scheduling):
    llm = LLM(tiny, max_model_len=128, async_scheduling=async_scheduling)
    core = llm.llm_engine.engine_core.engine_core
    with OverlapRecorder(llm) as recorder:
        llm.generate(["the engine", "a block table"], PARAMS, use_tqdm=False)
    kinds = [s.what for s in recorder.spans]
    assert kinds.count("forward") == kinds.count("update") >= 6   # prefill + 5 decodes at least
    assert all(0 <= s.start <= s.end for s in recorder.spans)
    threads = {s.what: {x.thread for x in recorder.spans if x.what == s.what} for s in recorder.spans}
    if async_scheduling:
        assert threads["forward"] == {"microvllm-execute_0"} and threads["schedule"] == {"MainThread"}
        assert recorder.plans_made_during_a_forward() >= 1
    else:
        assert threads["forward"] == threads["schedule"] == {"MainThread"}
        assert recorder.plans_made_during_a_forward() == 0
    assert "schedule" not in vars(core.scheduler) and "execute_model" not in vars(core.executor)
    assert isinstance(plot_overlap({"run": recorder.spans}), Figure)


def test_the_recorder_needs_the_core_in_this_process():
    across_processes = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=object()))   # a SyncMPClient has no core
    with pytest.raises(ValueError, match="in this process"):
        OverlapRecorder(across_processes)
