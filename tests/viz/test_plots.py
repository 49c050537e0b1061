"""Each plot shows what the trace says: the picture is read back and compared with the trace."""

import math
from collections import defaultdict

import pytest
from matplotlib.colors import to_hex

from microvllm.viz import plot_batch, plot_block_pool, plot_block_tables, plot_step, plot_timeline, request_colors
from microvllm.viz.batch import MIN_BAR_FRACTION, runner_order
from microvllm.viz.block_pool import grid_columns
from microvllm.viz.canvas import figure_to_png
from microvllm.viz.colors import CACHED_HATCH, DECODE_ALPHA
from microvllm.viz.demo import KINDS, demo_trace

TRACES = {kind: demo_trace(kind) for kind in KINDS}
TRACES["hybrid"] = demo_trace("sliding_window", hybrid=True)


def telling_steps(trace):
    """First, middle, last, and every step with a preemption, a cache hit or a finish."""
    steps = {0, len(trace) // 2, len(trace) - 1}
    steps |= {i for i, s in enumerate(trace)
              if s.preempted or s.finished or any(r.prefix_hit_tokens for r in s.scheduled)}
    return sorted(steps)


CASES = [(kind, i) for kind, trace in TRACES.items() for i in telling_steps(trace)]


def only(artists, gid):
    found = [a for a in artists if a.get_gid() == gid]
    assert len(found) == 1, f"expected one artist with gid {gid!r}, found {len(found)}"
    return found[0]


def boxes(collection):
    """(x0, y0, x1, y1) of each polygon of a collection, in data coordinates."""
    return [tuple(p.get_extents().bounds[:2]) + (p.get_extents().x1, p.get_extents().y1)
            for p in collection.get_paths()]


def hexes(collection, count):
    faces = [to_hex(c) for c in collection.get_facecolors()]
    return faces * count if len(faces) == 1 else faces


@pytest.mark.parametrize("kind, step", CASES)
def test_block_pool_cells_match_the_trace(kind, step):
    trace = TRACES[kind]
    s = trace[step]
    fig = plot_block_pool(trace, step)
    ax = fig.axes[0]
    ncols = grid_columns(trace.num_blocks)

    def blocks_of(gid):
        return [round(y0) * ncols + math.floor(x0 + 1e-9) for x0, y0, _, _ in boxes(only(ax.collections, gid))]

    in_use = {b for b in range(trace.num_blocks) if s.ref_cnts[b] > 0}
    cached_free = {b for b in range(trace.num_blocks) if s.free[b] and s.block_hashes[b]}
    empty_free = {b for b in range(trace.num_blocks) if s.free[b] and not s.block_hashes[b]}
    owned = blocks_of("pool-owned")
    assert set(owned) == in_use                                   # coloured cells = blocks in use
    assert blocks_of("pool-cached") == sorted(cached_free)        # hatched cells = free cached blocks
    assert only(ax.collections, "pool-cached").get_hatch() == CACHED_HATCH
    assert blocks_of("pool-free") == sorted(empty_free)
    assert blocks_of("pool-null") == [trace.null_block_id]
    assert blocks_of("pool-allocated") == s.allocated_blocks     # black edge: allocated in this step
    assert blocks_of("pool-freed") == s.freed_blocks             # red edge: freed in this step
    owners = s.owners(trace.num_blocks)
    palette = request_colors(trace)
    stripes = hexes(only(ax.collections, "pool-owned"), len(owned))
    expected = [palette[rid] for b in sorted(in_use) for rid in owners[b]]
    assert stripes == expected                                    # one stripe per holder, in its colour
    refs = only(ax.collections, "pool-ref-counts")
    assert refs.labels == [str(s.ref_cnts[b]) for b in sorted(in_use)]
    centres = [round(y - 0.55) * ncols + math.floor(x) for x, y in refs.get_offsets()]
    assert centres == sorted(in_use)
    assert f"{len(in_use)} in use · {len(cached_free)} free+cached" in ax.get_title()


@pytest.mark.parametrize("kind, step", CASES)
def test_block_tables_show_every_logical_block(kind, step):
    trace = TRACES[kind]
    s = trace[step]
    ax = plot_block_tables(trace, step).axes[0]
    groups = trace.kv_cache_groups
    rows = [(rid, g) for rid in s.block_tables for g in range(len(groups))]
    labels = only(ax.collections, "tables-rows").labels
    assert labels == [rid if len(groups) == 1 else f"{rid} · {groups[g]}" for rid, g in rows]
    expected_cells, expected_nulls, expected_ids = [], [], []
    for y, (rid, g) in enumerate(rows):
        for j, block in enumerate(s.block_tables[rid][g]):
            (expected_nulls if block == 0 else expected_cells).append((j, y, rid, block))
            expected_ids.append("∅" if block == 0 else str(block))
    cells = only(ax.collections, "tables-cells")
    assert [(math.floor(x0), math.floor(y0)) for x0, y0, _, _ in boxes(cells)] == [c[:2] for c in expected_cells]
    palette = request_colors(trace)
    assert hexes(cells, len(expected_cells)) == [palette[c[2]] for c in expected_cells]
    widths = list(cells.get_linewidths()) * (len(expected_cells) if len(cells.get_linewidths()) == 1 else 1)
    assert [w > 2 for w in widths] == [s.ref_cnts[c[3]] > 1 for c in expected_cells]   # shared: thick edge
    nulls = only(ax.collections, "tables-null")
    assert [(round(x0), round(y0)) for x0, y0, _, _ in boxes(nulls)] == [c[:2] for c in expected_nulls]
    assert only(ax.collections, "tables-ids").labels == expected_ids


def test_block_tables_cap_their_rows():
    trace = TRACES["hybrid"]
    step = max(range(len(trace)), key=lambda i: len(trace[i].block_tables))
    ax = plot_block_tables(trace, step, max_rows=3).axes[0]
    assert len(only(ax.collections, "tables-rows").labels) == 3
    assert f"{2 * len(trace[step].block_tables) - 3} more rows not shown" in ax.get_title()


def test_sliding_window_tables_show_released_blocks():
    trace = TRACES["sliding_window"]
    ax = plot_block_tables(trace, len(trace) // 2).axes[0]
    assert len(only(ax.collections, "tables-null").get_paths()) >= 2
    assert "window" in ax.get_title()


@pytest.mark.parametrize("kind, step", CASES)
def test_batch_bars_add_up_to_the_scheduled_tokens(kind, step):
    trace = TRACES[kind]
    s = trace[step]
    batch = runner_order(s.scheduled)
    ax = plot_batch(trace, step).axes[0]
    bars = [p for p in ax.patches if (p.get_gid() or "").startswith("batch-")]
    assert [p.get_gid() for p in bars] == [f"batch-{r.request_id}-{r.kind}" for r in batch]
    assert [p.num_tokens for p in bars] == [r.num_scheduled_tokens for r in batch]
    assert sum(p.num_tokens for p in bars) == s.num_scheduled_tokens
    minimum = MIN_BAR_FRACTION * ax.get_xlim()[1]
    assert [p.get_width() for p in bars] == [max(r.num_scheduled_tokens, minimum) for r in batch]
    starts = [p.get_x() for p in bars]
    assert starts == [sum(r.num_scheduled_tokens for r in batch[:k]) for k in range(len(bars))]  # stacked
    assert [p.get_facecolor()[3] == DECODE_ALPHA for p in bars] == [r.kind == "decode" for r in batch]
    palette = request_colors(trace)
    assert [to_hex(p.get_facecolor(), keep_alpha=False) for p in bars] == [palette[r.request_id] for r in batch]
    budget = only(ax.lines, "budget")
    assert list(budget.get_xdata()) == [s.token_budget] * 2 and budget.get_linestyle() == "--"
    rows_preempted = list(only(ax.lines, "preempted").get_ydata())
    assert rows_preempted == list(range(len(batch), len(batch) + len(s.preempted)))
    hits = list(only(ax.lines, "prefix-hits").get_ydata())
    assert hits == [y for y, r in enumerate(batch) if r.prefix_hit_tokens]
    labels = only(ax.collections, "batch-labels").labels
    assert [label.split(":")[0] for label in labels] == [r.request_id for r in batch] + s.preempted


def test_batch_labels_say_prefill_decode_hits_and_preemption():
    def labels(trace, step):
        return only(plot_batch(trace, step).axes[0].collections, "batch-labels").labels

    def first_step(trace, test, after=-1):
        return next(i for i in range(after + 1, len(trace)) if test(trace[i]))

    prefix = TRACES["prefix"]                                  # r1: 12 + 10 prompt tokens, 12 of them cached
    r1_admitted = first_step(prefix, lambda s: any(r.request_id == "r1" for r in s.scheduled))
    assert labels(prefix, r1_admitted) == ["r0: decode 1", "r1: prefill 10 (new, +12 cached)"]  # runner order
    trace = TRACES["preemption"]
    preempted_at = trace.preemption_steps()[0]
    rid = trace[preempted_at].preempted[0]
    assert labels(trace, preempted_at)[-1] == f"{rid}: preempted"
    resumed_at = first_step(trace, lambda s: any(r.request_id == rid for r in s.scheduled), after=preempted_at)
    r = next(r for r in trace[resumed_at].scheduled if r.request_id == rid)
    assert r.prefix_hit_tokens > 0
    resumed = f"{rid}: prefill {r.num_scheduled_tokens} (resumed, +{r.prefix_hit_tokens} cached)"
    assert resumed in labels(trace, resumed_at)
    chunked = TRACES["chunked"]                                # r1: 31 prompt tokens, 9 per chunk beside r0's decode
    second_chunk = [i for i, s in enumerate(chunked) if any(r.request_id == "r1" for r in s.scheduled)][1]
    assert "r1: prefill 9 (next chunk, 18/31 of prompt)" in labels(chunked, second_chunk)


@pytest.mark.parametrize("kind", list(TRACES))
def test_timeline_columns_add_up_and_mark_budget_free_blocks_and_preemptions(kind):
    trace = TRACES[kind]
    cursor_at = len(trace) // 2
    fig = plot_timeline(trace, cursor_at)
    ax, free_axis = fig.axes
    palette = request_colors(trace)
    per_step = defaultdict(list)
    for kind_ in ("prefill", "decode"):
        collection = only(ax.collections, f"timeline-{kind_}")
        assert collection.get_alpha() == (DECODE_ALPHA if kind_ == "decode" else 1.0)
        faces = hexes(collection, len(collection.get_paths()))
        for (x0, y0, x1, y1), face in zip(boxes(collection), faces):
            per_step[round((x0 + x1) / 2)].append((y0, y1 - y0, face, kind_))
    for s in trace:
        column = sorted(per_step[s.step])
        assert sum(height for _, height, _, _ in column) == s.num_scheduled_tokens
        assert [(face, k) for _, _, face, k in column] == [(palette[r.request_id], r.kind)
                                                           for r in runner_order(s.scheduled)]
    assert set(only(ax.lines, "budget").get_ydata()) == {trace.max_num_batched_tokens}
    assert list(only(free_axis.lines, "free-blocks").get_ydata()) == [s.num_free_blocks for s in trace]
    assert list(only(ax.lines, "preemptions").get_xdata()) == [trace[i].step for i in trace.preemption_steps()]
    assert list(only(ax.lines, "cursor").get_xdata()) == [trace[cursor_at].step] * 2


@pytest.mark.parametrize("kind", ["preemption", "hybrid"])
def test_every_plot_renders_to_png(kind):
    trace = TRACES[kind]
    step = len(trace) // 3
    for fig in (plot_block_pool(trace, step), plot_block_tables(trace, step), plot_batch(trace, step),
                plot_timeline(trace), plot_step(trace, step)):
        png = figure_to_png(fig, dpi=40)
        assert png.startswith(b"\x89PNG") and len(png) > 2000


def test_plots_leave_no_pyplot_figures_behind():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plot_step(TRACES["prefix"], 3)
    plot_block_pool(TRACES["prefix"], 3)
    assert plt.get_fignums() == before


def test_request_colours_are_stable_and_distinct():
    trace = TRACES["preemption"]
    colours = request_colors(trace)
    assert list(colours) == trace.request_ids() and len(set(colours.values())) == len(colours)
    assert request_colors(demo_trace("preemption")) == colours
