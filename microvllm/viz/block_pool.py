"""The block pool as a grid: one cell per physical KV-cache block.

    colour   the request(s) holding the block (a shared block is split in stripes,
             one per holder) with its ref count written on it
    hatched  free but still cached: a prefix-cache hit waiting to happen
    grey     free and empty
    dark     block 0, the null block (never allocated; stands in for released blocks)
    black    edge: allocated in this step (fresh, or a cached block revived by a hit)
    red      inner edge: freed in this step (finished, preempted, or left a sliding window);
             a block can have both: freed and handed out again in the same step
    corner   a hybrid model's state page (a dark triangle in the top-right corner): held by a
             request's state group, or free but cached as a state snapshot; the other blocks
             hold keys and values
    KV connector (notebook 19), a triangle in the bottom-left corner: blue, held by a request
             whose KV is loading or loaded and waiting to be admitted; brown, held by a
             finished request until its KV is saved or sent (a delayed free)

Cells of one kind form one collection (fast to draw), with gids `pool-owned`
(one polygon per stripe), `pool-cached`, `pool-free`, `pool-null`, the
outlines `pool-allocated`, `pool-freed`, the state pages' corners `pool-state-pages`, and a KV
connector's `pool-kv-loading`, `pool-kv-sending`; the cell at
column x, row y is block ``y * ncols + x``, with ``ncols = grid_columns(num_blocks, aspect)``
(aspect 2 for a figure of its own; in the explorer, its panel's width / height, so that
square cells fill the panel). The ref counts are
one label collection, gid `pool-ref-counts` (see `cell_labels`). Tests read the
picture back through these.
"""

from __future__ import annotations

import math

from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from microvllm.trace import Trace
from microvllm.viz import colors
from microvllm.viz.canvas import figure_and_axes
from microvllm.viz.cell_labels import add_cell_labels


def grid_columns(num_blocks: int, aspect: float = 2.0) -> int:
    """Columns of a grid of square cells about `aspect` times as wide as tall, at most 32."""
    return max(1, min(32, math.ceil(math.sqrt(aspect * num_blocks))))


def plot_block_pool(trace: Trace, step: int, ax: Axes | None = None, *, legend: bool = True) -> Figure:
    """Draw the pool at the end of step *index* `step` (see module docstring)."""
    s = trace[step]
    n = trace.num_blocks
    if ax is None:
        ncols = grid_columns(n)
        fig, ax = figure_and_axes(ax, (min(12, 1.5 + 0.42 * ncols), 1.2 + 0.42 * math.ceil(n / ncols)))
    else:                                           # the explorer's panel: fill it
        fig = ax.figure
        panel = ax.get_position()
        ncols = grid_columns(n, panel.width * fig.get_figwidth() / (panel.height * fig.get_figheight()))
    nrows = math.ceil(n / ncols)
    bbox = ax.get_position()                        # a cell's side in points sizes the numbers
    side = min(bbox.width * fig.get_figwidth() / ncols, bbox.height * fig.get_figheight() / nrows) * 72
    palette = colors.request_colors(trace)
    owners = s.owners(n)
    owned, owned_colors, cached, free, null = [], [], [], [], []
    refs: tuple[list, list, list] = ([], [], [])    # cell centres, ref counts, ink colours
    ids: tuple[list, list] = ([], [])               # block-id corners, block ids
    for b in range(n):
        x, y = b % ncols, b // ncols
        if b == trace.null_block_id:
            null.append(_cell(x, y))
            ax.text(x + 0.5, y + 0.55, "null", color="white", ha="center", va="center", fontsize=min(side * 0.25, 8))
            continue
        if owners[b] or s.ref_cnts[b] > 0:
            holders = owners[b] or ["?"]
            for k, rid in enumerate(holders):                 # one stripe per holder
                owned.append(_cell(x + k / len(holders), y, 1 / len(holders)))
                owned_colors.append(palette.get(rid, colors.UNKNOWN_COLOR))
            ink = colors.text_color_on(palette.get(holders[0], colors.UNKNOWN_COLOR))
            for part, value in zip(refs, ((x + 0.5, y + 0.55), str(s.ref_cnts[b]), ink)):
                part.append(value)
        elif s.block_hashes[b] is not None:
            cached.append(_cell(x, y))
        else:
            free.append(_cell(x, y))
        if n <= 128:
            ids[0].append((x + 0.2, y + 0.18))
            ids[1].append(str(b))
    _add(ax, owned, owned_colors, "pool-owned", edgecolor="none")
    _add(ax, cached, colors.CACHED_COLOR, "pool-cached", edgecolor="#888888", hatch=colors.CACHED_HATCH)
    _add(ax, free, colors.FREE_COLOR, "pool-free")
    _add(ax, null, colors.NULL_COLOR, "pool-null")
    grid = [_cell(b % ncols, b // ncols) for b in range(n) if b != trace.null_block_id]
    ax.add_collection(PolyCollection(grid, facecolors="none", edgecolors="white", linewidths=1.5,
                                     gid="pool-grid"), autolim=False)
    state_pages = sorted(s.state_pages(trace.kv_cache_groups))
    if state_pages:
        ax.add_collection(PolyCollection([_corner(b % ncols, b // ncols) for b in state_pages],
                                         facecolors=colors.STATE_COLOR, edgecolors="none", gid="pool-state-pages",
                                         zorder=2.4), autolim=False)
    loading = sorted({b for held in (s.kv_loading, s.kv_pinned) for blocks in held.values() for b in blocks if b})
    sending = sorted({b for blocks in s.kv_sending.values() for b in blocks if b})
    for gid, blocks, color in (("pool-kv-loading", loading, colors.LOADING_COLOR),
                               ("pool-kv-sending", sending, colors.SENDING_COLOR)):
        if blocks:
            ax.add_collection(PolyCollection([_low_corner(b % ncols, b // ncols) for b in blocks], facecolors=color,
                                             edgecolors="none", gid=gid, zorder=2.4), autolim=False)
    for gid, blocks, color, inset in (("pool-allocated", s.allocated_blocks, colors.ALLOCATED_COLOR, 0.06),
                                      ("pool-freed", s.freed_blocks, colors.FREED_COLOR, 0.2)):
        outlines = [_cell(b % ncols + inset, b // ncols + inset, 1 - 2 * inset, 1 - 2 * inset) for b in blocks]
        ax.add_collection(PolyCollection(outlines, facecolors="none", edgecolors=color, linewidths=2.5, gid=gid,
                                         zorder=2.5), autolim=False)
    add_cell_labels(ax, refs[0], refs[1], min(side * 0.42, 13), refs[2], "pool-ref-counts", bold=True)
    add_cell_labels(ax, ids[0], ids[1], min(side * 0.17, 6.5), "#444444", "pool-block-ids")
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    ax.set_aspect("equal")
    ax.set_axis_off()
    in_use = len(refs[1])
    ax.set_title(f"Block pool after step {s.step}\n{in_use} in use · {len(cached)} free+cached · "
                 f"{len(free)} free+empty · numbers = ref counts\nthis step: {len(s.allocated_blocks)} allocated "
                 f"(black edge) · {len(s.freed_blocks)} freed (red edge)", fontsize=9)
    if legend:
        _legend(ax, trace, s.block_tables)
    if s.kv_blocks_loaded or s.kv_blocks_saved:
        ax.text(0, nrows + 0.3, f"KV connector this step: {s.kv_blocks_loaded} blocks loaded, "
                f"{s.kv_blocks_saved} saved", fontsize=8, va="top", gid="pool-kv-moved")
    return fig


def _corner(x: float, y: float, size: float = 0.32) -> list[tuple[float, float]]:
    """The top-right triangle of cell (x, y): the mark of a state page."""
    return [(x + 1 - size, y), (x + 1, y), (x + 1, y + size)]


def _low_corner(x: float, y: float, size: float = 0.32) -> list[tuple[float, float]]:
    """The bottom-left triangle of cell (x, y): a KV connector's mark."""
    return [(x, y + 1 - size), (x, y + 1), (x + size, y + 1)]


def _cell(x: float, y: float, width: float = 1.0, height: float = 1.0) -> list[tuple[float, float]]:
    return [(x, y), (x + width, y), (x + width, y + height), (x, y + height)]


def _add(ax: Axes, cells: list, facecolors, gid: str, **style) -> None:
    """One collection per kind of cell: far faster to draw than a patch per block."""
    style.setdefault("edgecolor", "white")
    ax.add_collection(PolyCollection(cells, facecolors=facecolors, linewidths=0.8, gid=gid, **style),
                      autolim=False)


def _legend(ax: Axes, trace: Trace, block_tables: dict) -> None:
    palette = colors.request_colors(trace)
    handles = [Patch(facecolor=palette[rid], label=rid) for rid in block_tables][:12]
    handles += [Patch(facecolor=colors.CACHED_COLOR, edgecolor="#888888", hatch=colors.CACHED_HATCH,
                      label="free, cached"),
                Patch(facecolor=colors.FREE_COLOR, label="free, empty"),
                Patch(facecolor=colors.NULL_COLOR, label="null block"),
                Patch(facecolor="none", edgecolor=colors.ALLOCATED_COLOR, linewidth=2.5, label="allocated this step"),
                Patch(facecolor="none", edgecolor=colors.FREED_COLOR, linewidth=2.5, label="freed this step")]
    if "mamba" in trace.kv_cache_groups:
        handles.append(Patch(facecolor=colors.STATE_COLOR, label="state page (corner)"))
    if any(s.kv_loading or s.kv_pinned or s.kv_sending for s in trace):
        handles += [Patch(facecolor=colors.LOADING_COLOR, label="KV loading / loaded (corner)"),
                    Patch(facecolor=colors.SENDING_COLOR, label="KV being sent: delayed free")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
