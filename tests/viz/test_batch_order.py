"""The batch plot follows the model runner: its row order, and decode tokens that stay visible."""

import pytest

from microvllm.viz import plot_batch
from microvllm.viz.batch import MIN_BAR_FRACTION, runner_order
from microvllm.viz.demo import Arrival, simulate


def test_rows_are_in_the_model_runners_batch_order(tmp_path, monkeypatch):
    """Record the request order of every flattened batch the real runner builds and
    compare it with the plot's rows, step by step."""
    from microvllm import LLM, SamplingParams
    from microvllm.models.tiny import make_tiny_model
    from microvllm.worker.model_runner import ModelRunner

    seen = []
    prepare = ModelRunner._prepare_inputs

    def spy(self, plan):
        inputs = prepare(self, plan)
        seen.append(list(inputs.req_ids))
        return inputs

    monkeypatch.setattr(ModelRunner, "_prepare_inputs", spy)
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7)
    llm = LLM(str(folder), trace=True, block_size=4, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=96)
    prompts = [{"prompt_token_ids": list(range(start, start + n))}
               for start, n in ((3, 5), (60, 30), (120, 9), (200, 21))]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    trace = llm.trace
    assert len(seen) == len(trace)
    plotted = []
    for i, s in enumerate(trace):
        labels = next(c for c in plot_batch(trace, i).axes[0].collections if c.get_gid() == "batch-labels").labels
        plotted.append([label.split(":")[0] for label in labels[:len(s.scheduled)]])
    assert plotted == seen
    assert [[r.request_id for r in runner_order(s.scheduled)] for s in trace] == seen
    # The test means something: in some step the plan's order is not the runner's.
    assert any([r.request_id for r in s.scheduled] != order for s, order in zip(trace, seen))


@pytest.mark.parametrize("budget", [32, 2048])
def test_decode_tokens_are_visible_on_a_wide_budget(budget):
    """One decode token is 1/2048 of a 2048-token axis: drawn at least MIN_BAR_FRACTION wide."""
    trace = simulate([Arrival("r0", "a b c d e f", 4, 0), Arrival("r1", " ".join(["w"] * 300), 2, 2)],
                     block_size=16, num_blocks=64, max_num_batched_tokens=budget, max_num_seqs=4)
    step = next(i for i, s in enumerate(trace) if {r.kind for r in s.scheduled} == {"prefill", "decode"})
    fig = plot_batch(trace, step)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    axis_px = ax.get_window_extent(renderer).width
    decodes = [p for p in ax.patches if (p.get_gid() or "").endswith("-decode")]
    assert decodes
    for bar in decodes:
        assert bar.num_tokens == 1
        assert bar.get_window_extent(renderer).width >= MIN_BAR_FRACTION * axis_px * 0.99
        assert bar.get_window_extent(renderer).width >= 10      # pixels, at the default size
