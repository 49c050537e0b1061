"""Each step's allocated and freed blocks, as recorded in the trace, are what the block pool did.

A spy wraps the pool's three methods that move blocks in and out of the free queue
and collects, between two trace records, the blocks that left it (get_new_blocks,
touch of a free cached block) and joined it (free_blocks down to ref count 0).
"""

import pytest

from microvllm.core.block_pool import BlockPool
from microvllm.engine.step_tracer import StepTracer
from microvllm.viz.demo import KINDS, demo_trace


@pytest.fixture
def pool_spy(monkeypatch):
    """Per recorded step: (allocated, freed) block ids as the pool saw them."""
    current = (set(), set())
    per_step = []
    get_new_blocks, free_blocks, touch = BlockPool.get_new_blocks, BlockPool.free_blocks, BlockPool.touch
    record = StepTracer.record

    def spy_get_new_blocks(self, num_blocks):
        blocks = get_new_blocks(self, num_blocks)
        current[0].update(b.block_id for b in blocks)
        return blocks

    def spy_touch(self, blocks):
        blocks = list(blocks)
        current[0].update(b.block_id for b in blocks if b.ref_cnt == 0)
        touch(self, blocks)

    def spy_free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        free_blocks(self, blocks)
        current[1].update(b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null)

    def spy_record(self, *args, **kwargs):
        record(self, *args, **kwargs)
        per_step.append((sorted(current[0]), sorted(current[1])))
        current[0].clear()
        current[1].clear()

    monkeypatch.setattr(BlockPool, "get_new_blocks", spy_get_new_blocks)
    monkeypatch.setattr(BlockPool, "touch", spy_touch)
    monkeypatch.setattr(BlockPool, "free_blocks", spy_free_blocks)
    monkeypatch.setattr(StepTracer, "record", spy_record)
    return per_step


def recorded(trace):
    return [(s.allocated_blocks, s.freed_blocks) for s in trace]


@pytest.mark.parametrize("kind", KINDS)
def test_demo_traces_record_what_the_pool_did(kind, pool_spy):
    trace = demo_trace(kind)
    assert recorded(trace) == pool_spy
    assert any(allocated for allocated, _ in pool_spy) and any(freed for _, freed in pool_spy)


def test_hybrid_and_large_traces_record_what_the_pool_did(pool_spy):
    from microvllm.viz.demo import large_demo_trace

    trace = demo_trace("sliding_window", hybrid=True)
    assert recorded(trace) == pool_spy
    pool_spy.clear()
    trace = large_demo_trace(num_requests=40, num_blocks=40)     # a tight pool: preemptions
    assert recorded(trace) == pool_spy
    assert trace.preemption_steps()
    assert any(set(allocated) & set(freed) for allocated, freed in pool_spy)   # freed and reused in one step


def test_sliding_window_model_frees_blocks_that_left_the_window(tmp_path, pool_spy):
    """The tiny Mistral model (window of 8 tokens, blocks of 4): while a request decodes,
    its oldest blocks are freed step after step, before it finishes."""
    from microvllm import LLM, SamplingParams
    from microvllm.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "mistral", "mistral", seed=7, sliding_window=8)
    llm = LLM(str(folder), trace=True, block_size=4, num_kv_blocks=24, max_num_batched_tokens=32,
              max_model_len=64, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 20))}, {"prompt_token_ids": list(range(40, 50))}],
                 params, use_tqdm=False)
    trace = llm.trace
    trace.check_consistency()
    assert recorded(trace) == pool_spy
    assert trace.sliding_window == 8
    window_frees = [i for i, s in enumerate(trace) if s.freed_blocks and not s.finished]
    assert window_frees, "the window should free blocks while both requests still run"
    s = trace[window_frees[0]]
    released = {b for tables in trace[window_frees[0] - 1].block_tables.values() for t in tables for b in t}
    assert set(s.freed_blocks) <= released

    # What the lecture shows: the explorer on this LLM marks those blocks freed and says why.
    from pathlib import Path

    from microvllm.viz import StepExplorer

    explorer = StepExplorer(llm, preset="projector", step=window_frees[0])
    (outlines,) = [c for c in explorer.figure.pool_ax.collections if c.get_gid() == "pool-freed"]
    assert len(outlines.get_paths()) == len(s.freed_blocks)
    assert "(left the 8-token sliding window)" in explorer.caption.value
    artifacts = Path(__file__).resolve().parents[1] / "artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / "step_explorer_projector_mistral_window.png").write_bytes(explorer.image.value)


def test_a_trace_recorded_before_these_fields_still_loads():
    from microvllm.trace import Trace
    from microvllm.viz import plot_block_pool

    data = demo_trace("prefix").to_dict()
    for s in data["steps"]:
        del s["allocated_blocks"], s["freed_blocks"]
    trace = Trace.from_dict(data)
    assert trace[5].freed_blocks == [] and trace[5].allocated_blocks == []
    ax = plot_block_pool(trace, 5).axes[0]
    assert [len(c.get_paths()) for c in ax.collections if c.get_gid() in ("pool-allocated", "pool-freed")] == [0, 0]
