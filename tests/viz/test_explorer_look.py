"""The step explorer's picture, checked in display space: what a learner sees, not what was plotted.

Each test is one defect a walk through the explorer found (issue 31, item 5): decode
steps as slivers, the free-blocks line over the budget line, legend swatches in a grey
no bar wears, the prefix-hit star over its bar, an empty third of the projector canvas.
"""

import io
import math

import numpy as np
import PIL.Image
import pytest
from matplotlib.colors import to_hex
from matplotlib.patches import Patch

from microvllm.viz import plot_timeline, request_colors
from microvllm.viz.batch import plot_batch
from microvllm.viz.demo import demo_trace
from microvllm.viz.step_figure import StepFigure, look, plot_step

TRACES = {kind: demo_trace(kind) for kind in ("prefix", "preemption", "chunked")}


def line(ax, gid):
    (found,) = [artist for artist in ax.figure.findobj() if getattr(artist, "get_gid", None) and
                artist.get_gid() == gid and hasattr(artist, "get_xydata")]
    return found


@pytest.mark.parametrize("kind", TRACES)
def test_a_one_token_step_is_seen_on_the_timeline(kind):
    """On an axis as tall as the budget, one token was 1/budget of the height (3% at 32,
    0.1% at 1024): the square-root axis gives it about 1/sqrt(budget)."""
    trace = TRACES[kind]
    ax = plot_timeline(trace).axes[0]
    bottom, top = ax.transAxes.transform([(0, 0), (0, 1)])[:, 1]
    one = ax.transData.transform([(0, 1)])[0, 1]
    assert (one - bottom) / (top - bottom) >= 0.8 / math.sqrt(trace.max_num_batched_tokens * 1.12)
    full = ax.transData.transform([(0, trace.max_num_batched_tokens)])[0, 1]
    assert bottom < one < full <= top                          # still monotone: more tokens, higher


@pytest.mark.parametrize("kind", TRACES)
def test_the_free_blocks_line_stays_under_the_budget_line(kind):
    trace = TRACES[kind]
    fig = plot_timeline(trace)
    free, budget = line(fig, "free-blocks"), line(fig, "budget")
    free_top = free.get_transform().transform(free.get_xydata())[:, 1].max()
    most_free = free.axes.transData.transform([(0, trace.num_blocks)])[0, 1]     # a pool with every block free
    budget_low = budget.get_transform().transform(budget.get_xydata())[:, 1].min()
    assert free_top <= most_free < budget_low - 5                 # pixels apart, even with every block free


def legend_swatches(legend, label):
    handle = legend.legend_handles[[t.get_text() for t in legend.get_texts()].index(label)]
    patches = handle if isinstance(handle, tuple) else [handle]
    return {to_hex(p.get_facecolor()) for p in patches if isinstance(p, Patch)}


@pytest.mark.parametrize("kind", TRACES)
def test_the_legend_shows_the_colours_the_bars_wear(kind):
    trace = TRACES[kind]
    fig = plot_step(trace, 2)
    (legend,) = fig.legends
    worn = set(request_colors(trace).values())
    for label in ("prefill tokens (solid)", "decode tokens (faint)"):
        swatches = legend_swatches(legend, label)
        assert swatches and swatches <= worn, f"{label}: {swatches} is not among the bars' colours {worn}"
    timeline_legend = plot_timeline(trace).axes[0].get_legend()
    assert legend_swatches(timeline_legend, "prefill (solid)") <= worn


def test_the_prefix_hit_star_sits_after_its_bar_not_on_it():
    trace = TRACES["prefix"]
    hit_steps = [i for i, s in enumerate(trace) if any(r.prefix_hit_tokens for r in s.scheduled)]
    assert hit_steps
    for step in hit_steps:
        fig = plot_batch(trace, step)
        ax = fig.axes[0]
        fig.canvas.draw()
        stars = line(fig, "prefix-hits")
        star_x = stars.get_transform().transform(stars.get_xydata())[:, 0]
        hit_rows = [r.request_id for r in trace[step].scheduled if r.prefix_hit_tokens]
        bars = [p for p in ax.patches if any(p.get_gid().startswith(f"batch-{rid}-") for rid in hit_rows)]
        bar_end = max(p.get_window_extent().x1 for p in bars)
        star_radius = stars.get_markersize() / 72 * fig.dpi / 2
        assert star_x.min() - star_radius >= bar_end - 0.5, "the star covers the end of its bar"


@pytest.mark.parametrize("kind", ["preemption", "chunked"])
def test_the_projector_canvas_is_mostly_drawn_on(kind):
    """Blank 100 x 100-pixel tiles above the legend, over the trace's steps: a third of
    the canvas before the pool's grid filled its panel and short tables filled their row
    (0.27 for these traces), a fifth after."""
    trace = TRACES[kind]
    chosen = look("projector")
    figure = StepFigure(trace, figsize=chosen.figsize, dpi=chosen.dpi, min_fontsize=chosen.min_fontsize,
                        layout=chosen.layout)
    blank = []
    for step in range(len(trace)):
        figure.draw(step)
        pixels = np.asarray(PIL.Image.open(io.BytesIO(figure.png())).convert("L"))[:800]
        tiles = pixels.reshape(8, 100, 16, 100).min(axis=(1, 3))
        blank.append(float((tiles > 245).mean()))
    assert np.mean(blank) < 0.23


def test_an_unknown_layout_says_which_exist():
    with pytest.raises(ValueError, match="stacked"):
        StepFigure(TRACES["prefix"], layout="grid")
