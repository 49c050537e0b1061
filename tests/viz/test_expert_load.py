"""plot_expert_load shows what a real MoE run's trace counted; the imbalance helper on known counts."""

import numpy as np
import pytest
from matplotlib.colors import to_hex

from microvllm.trace import StepTrace, Trace
from microvllm.viz import expert_parallel_imbalance, plot_expert_load
from microvllm.viz.canvas import figure_to_png
from microvllm.viz.demo import demo_trace
from microvllm.viz.expert_load import expert_counts, moe_layers_of


@pytest.fixture(scope="module")
def moe_trace(tmp_path_factory):
    """A real engine run: tiny Qwen3-MoE, 3 layers (layer 0 dense, 1 and 2 with 8 experts, top-2)."""
    from microvllm import LLM, SamplingParams
    from microvllm.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", num_hidden_layers=3)
    llm = LLM(str(folder), trace=True, max_num_batched_tokens=32)
    prompts = [{"prompt_token_ids": list(range(40, 40 + n))} for n in (20, 9, 30)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return llm.trace


def only(artists, gid):
    found = [a for a in artists if a.get_gid() == gid]
    assert len(found) == 1, f"expected one artist with gid {gid!r}, found {len(found)}"
    return found[0]


def hand_made(counts_by_step: list[list[int]], layer: str = "3") -> Trace:
    trace = Trace(block_size=16, num_blocks=8, max_num_batched_tokens=64, max_num_seqs=4)
    trace.steps = [StepTrace(step=i, token_budget=64, max_num_seqs=4, expert_load={layer: counts})
                   for i, counts in enumerate(counts_by_step)]
    return trace


def test_the_run_counted_top_k_pairs_per_token(moe_trace):
    assert moe_layers_of(moe_trace) == ["1", "2"]
    for s in moe_trace:
        for layer in ("1", "2"):
            assert len(s.expert_load[layer]) == 8
            assert sum(s.expert_load[layer]) == 2 * s.num_scheduled_tokens   # top-2


@pytest.mark.parametrize("layer", [None, "1", 2])
def test_heat_map_is_the_traces_counts(moe_trace, layer):
    fig = plot_expert_load(moe_trace, layer=layer)
    heat, side = fig.axes[0], fig.axes[1]
    shown = np.asarray(only(heat.images, "expert-load").get_array())
    name = "1" if layer is None else str(layer)
    expected = np.array([s.expert_load[name] for s in moe_trace]).T        # experts x steps
    assert shown.shape == (8, len(moe_trace))
    assert (shown == expected).all()
    assert fig._suptitle.get_text().startswith(f"Layer {name}: 8 experts x {len(moe_trace)} steps")
    # The side panel: each expert's share of the run, the ideal 1/E, the busiest in red.
    totals = expected.sum(axis=1)
    bars = [p for p in side.patches if p.get_gid() == "expert-share"]
    assert [b.get_width() for b in bars] == pytest.approx(list(totals / totals.sum()))
    assert only(side.lines, "ideal-share").get_xdata()[0] == pytest.approx(1 / 8)
    reds = [i for i, b in enumerate(bars) if to_hex(b.get_facecolor()) == "#d62728"]
    assert reds and all(totals[i] == totals.max() for i in reds)
    imbalance = totals.max() / totals.mean()
    assert f"imbalance (busiest expert / mean) {imbalance:.2f}" in fig._suptitle.get_text()
    assert not only(heat.patches, "cursor").get_visible()
    assert figure_to_png(fig).startswith(b"\x89PNG")


def test_cursor_marks_the_step(moe_trace):
    fig = plot_expert_load(moe_trace, step=2)
    cursor = only(fig.axes[0].patches, "cursor")
    assert cursor.get_visible() and cursor.get_x() == pytest.approx(1.5) and cursor.get_width() == 1


def test_errors_name_what_there_is(moe_trace):
    with pytest.raises(ValueError, match=r"layer '0' is not a MoE layer of this trace: its MoE layers are 1, 2"):
        plot_expert_load(moe_trace, layer="0")
    with pytest.raises(ValueError, match=r"step 99 is out of range: the trace has \d+ steps"):
        plot_expert_load(moe_trace, step=99)
    with pytest.raises(ValueError, match="the trace has no expert counts"):
        plot_expert_load(demo_trace("prefix"))           # a dense model's trace
    with pytest.raises(ValueError, match="the trace has no expert counts"):
        expert_parallel_imbalance(Trace(block_size=16, num_blocks=8, max_num_batched_tokens=64,
                                        max_num_seqs=4), None, 2)


def test_expert_parallel_imbalance_on_hand_made_counts():
    trace = hand_made([[4, 4, 4, 4],      # balanced
                       [8, 0, 0, 0],      # all on rank 0 (experts 0-1)
                       [1, 1, 5, 1],      # ranks (2, 6): 6 / 4
                       [0, 0, 0, 0]])     # nothing routed
    assert expert_parallel_imbalance(trace, "3", 2) == pytest.approx([1.0, 2.0, 1.5, 1.0])
    assert expert_parallel_imbalance(trace, 3, 4) == pytest.approx([1.0, 4.0, 2.5, 1.0])
    assert expert_parallel_imbalance(trace, None, 1) == pytest.approx([1.0] * 4)
    with pytest.raises(ValueError, match="num_ranks=3 must divide the layer's 4 experts"):
        expert_parallel_imbalance(trace, "3", 3)
    layer, counts = expert_counts(trace)
    assert layer == "3" and counts[:, 2].tolist() == [1, 1, 5, 1]


def test_a_real_run_is_never_better_than_balanced(moe_trace):
    for ranks in (1, 2, 4, 8):
        values = expert_parallel_imbalance(moe_trace, "2", ranks)
        assert len(values) == len(moe_trace)
        assert all(1.0 <= v <= ranks + 1e-9 for v in values)
