"""A hybrid's state pages in the block-pool and block-table views: the pictures, read back,
mark exactly the pages the trace says hold a state, and the snapshot a prefix hit resumes."""

import pytest

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.viz import plot_block_pool, plot_block_tables
from microvllm.viz.block_pool import grid_columns


def collection(fig, gid):
    found = [c for c in fig.axes[0].collections if c.get_gid() == gid]
    return found[0] if found else None


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("q35"), "qwen3_5", seed=3, tokenizer=False)
    llm = LLM(str(folder), trace=True, max_model_len=128, num_kv_blocks=48)
    system = list(range(3, 43))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": system + [100]}], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": system + [200, 201]}], params, use_tqdm=False)
    return llm.trace


def test_the_pool_marks_every_state_page(trace):
    n = trace.num_blocks
    for index, step in enumerate(trace):
        expected = step.state_pages(trace.kv_cache_groups)
        assert expected, "a hybrid holds or caches a state page at every step"
        fig = plot_block_pool(trace, index)
        ncols = grid_columns(n)
        marked = {int(p.vertices[0][1]) * ncols + int(p.vertices[1][0]) - 1
                  for p in collection(fig, "pool-state-pages").get_paths()}
        assert marked == expected


def test_the_tables_mark_state_rows_and_the_snapshot_a_hit_resumes(trace):
    hit_steps = [i for i, s in enumerate(trace) if any(r.prefix_hit_tokens for r in s.scheduled)]
    assert hit_steps, "the second prompt was meant to hit the first one's snapshot"
    step = trace[hit_steps[0]]
    (hit,) = [r for r in step.scheduled if r.prefix_hit_tokens]
    assert hit.prefix_hit_tokens == 32
    fig = plot_block_tables(trace, hit_steps[0])
    hit_cells = collection(fig, "tables-hits").get_paths()
    groups = trace.kv_cache_groups
    # attention rows: both hit blocks; each state row: only its snapshot (entry 1), the rest null
    assert len(hit_cells) == 2 + (len(groups) - 1)
    for g, kind in enumerate(groups):
        table = step.block_tables[hit.request_id][g]
        if kind == "mamba":
            assert table[0] == 0 and table[1] != 0
    corners = collection(fig, "tables-state").get_paths()
    live = sum(1 for tables in step.block_tables.values() for g, t in enumerate(tables)
               if groups[g] == "mamba" for b in t if b != 0)
    assert len(corners) == live
