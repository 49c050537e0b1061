"""A KV connector in the step trace and the block-pool view: the blocks held for a load,
after a load until admission, and for a delayed free are recorded per request, and the
picture, read back, marks exactly those blocks (the in-process tier, OffloadingConnector)."""

import pytest

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.viz import plot_block_pool
from microvllm.viz.block_pool import grid_columns


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3, tokenizer=False)
    llm = LLM(str(folder), block_size=8, num_kv_blocks=20, max_num_seqs=2, trace=True, debug_invariants=True,
              kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prefixes = [[(31 * p + 7 * i) % 500 + 3 for i in range(48)] for p in range(4)]
    for p, prompt in enumerate(prefixes + prefixes[:1]):   # the last one's prefix was evicted: the tier has it
        llm.generate([{"prompt_token_ids": prompt + [400 + p, 401, 402]}], params, use_tqdm=False)
    return llm


def test_the_trace_records_what_the_connector_holds_and_moves(run):
    trace, connector = run.trace, run.llm_engine.scheduler.connector
    assert any(s.kv_sending for s in trace), "finished requests hold their blocks while they are saved"
    assert any(s.kv_loading or s.kv_pinned for s in trace), "the last request loads its prefix from the tier"
    assert sum(s.kv_blocks_loaded for s in trace) == connector.num_blocks_loaded > 0
    assert sum(s.kv_blocks_saved for s in trace) == connector.num_blocks_saved > 0
    for s in trace:   # the connector's holders own their blocks in the trace, as the pool counts them
        owners = s.owners(trace.num_blocks)
        for held in (s.kv_loading, s.kv_pinned, s.kv_sending):
            for rid, blocks in held.items():
                assert all(rid in owners[b] and s.ref_cnts[b] > 0 for b in blocks if b)


def test_the_pool_marks_exactly_the_connectors_blocks(run):
    trace = run.trace
    ncols = grid_columns(trace.num_blocks)
    checked = 0
    for index, s in enumerate(trace):
        loading = {b for held in (s.kv_loading, s.kv_pinned) for blocks in held.values() for b in blocks if b}
        sending = {b for blocks in s.kv_sending.values() for b in blocks if b}
        if not (loading or sending):
            continue
        fig = plot_block_pool(trace, index)
        for gid, expected in (("pool-kv-loading", loading), ("pool-kv-sending", sending)):
            found = [c for c in fig.axes[0].collections if c.get_gid() == gid]
            cells = set()
            for path in (found[0].get_paths() if found else []):
                x, y_bottom = path.vertices[0][0], path.vertices[1][1]
                cells.add((int(round(y_bottom)) - 1) * ncols + int(round(x)))   # row y's bottom is y + 1
            assert cells == expected, (index, gid)
        checked += 1
    assert checked
