"""Each running request's block table: logical block index -> physical block id.

    logical block   0    1    2    3
    r0            [ 1 ][ 2 ][ 7 ][ 9 ]     cell colour = the request, number = physical block
    r1            [ 1 ][ 2 ][ 4 ]          blocks 1, 2 shared with r0 (prefix hit): thick edge
    r2 · sliding  [nul][nul][ 5 ][ 6 ]     outside the window: released, now the null block 0

One row per request, and per cache group when the model has several. Cells form
two collections, gids `tables-cells` and `tables-null` (row y, column j = logical
block j of the y-th (request, group) row); the physical ids are one label
collection, gid `tables-ids`; the row names `tables-rows` (see `cell_labels`).

Speculative decoding: the KV of every draft the target checked was written into the
request's slots. A rejected draft's slots stay allocated to the request (its blocks
are not freed); ``num_computed_tokens`` stops before them, so the next step's tokens
are written over them::

    r0 (block_size 4)  [ 1 ][ 2 ][ 7 |xx]    tokens 0..9 computed, drafts at 10 and 11
                                    ^^       rejected: slots 10-11 of block 7 hatched,
                                             rewritten by the next step's tokens

A hybrid model's state rows (``· mamba``) hold one page per block of tokens: only the
last one or two are live, the ones before are null (released; their snapshots stay
cached in the pool). Their cells carry a dark corner, gid `tables-state`. Blocks a
request got from the prefix cache in this step have a gold edge, gid `tables-hits`: in a
state row, the one snapshot its state resumes from.

Those slots are one collection, gid `tables-rejected` (one box per rejected slot, x =
logical block + slot / block_size), drawn only for requests with rejected drafts.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.transforms import offset_copy

from microvllm.trace import Trace
from microvllm.viz import colors
from microvllm.viz.canvas import figure_and_axes
from microvllm.viz.cell_labels import add_cell_labels, label_width_points


def plot_block_tables(trace: Trace, step: int, ax: Axes | None = None, *, max_rows: int = 24,
                      min_columns: int = 12) -> Figure:
    """Draw every running request's block table(s) at the end of step *index* `step`.

    At most `max_rows` rows are drawn (the title says how many were left out). The
    axes' width is shared by at least `min_columns` columns, so short tables keep
    readable, not huge, cells; `min_columns=1` lets a short table fill a wide panel
    (the projector's), its cells at most twice as wide as tall.
    """
    s = trace[step]
    groups = trace.kv_cache_groups
    all_rows = [(rid, g) for rid in s.block_tables for g in range(len(groups))]
    rows = all_rows[:max_rows]
    width = max((len(s.block_tables[rid][g]) for rid, g in rows), default=1) or 1
    columns = max(width, min_columns)
    fig, ax = figure_and_axes(ax, (min(14, 2.5 + 0.5 * columns), 1.0 + 0.4 * max(1, len(rows))))
    palette = colors.request_colors(trace)
    bbox = ax.get_position()
    height_pt = bbox.height * fig.get_figheight() * 72
    cell_h = height_pt / max(1, len(rows))                                  # in points
    name = (lambda rid, g: rid) if len(groups) == 1 else (lambda rid, g: f"{rid} · {groups[g]}")
    row_names, name_size = [name(rid, g) for rid, g in rows], min(8.5, 0.7 * cell_h)
    names_pt = label_width_points(row_names, name_size) + 8                  # room left of the cells
    room_pt = bbox.width * fig.get_figwidth() * 72 - names_pt
    cell_w = min(room_pt / columns, 2 * cell_h)
    cell_h = min(cell_h, cell_w)            # a few rows: square cells from the top, not tall slabs
    fontsize = min(10, 0.5 * cell_h, cell_w / (0.7 * len(str(trace.num_blocks - 1))))
    cells, faces, edges, widths, nulls, corners, hits = [], [], [], [], [], [], []
    centres, labels, inks = [], [], []
    hit_blocks = {r.request_id: r.prefix_hit_tokens // trace.block_size
                  for r in s.scheduled if r.prefix_hit_tokens}
    for y, (rid, g) in enumerate(rows):
        for j, block in enumerate(s.block_tables[rid][g]):
            if j < hit_blocks.get(rid, 0) and block != trace.null_block_id:
                hits.append(_cell(j, y, 0.12))
            if groups[g] == "mamba" and block != trace.null_block_id:
                corners.append([(j + 0.68, y + 0.05), (j + 0.95, y + 0.05), (j + 0.95, y + 0.32)])
            if block == trace.null_block_id:
                nulls.append(_cell(j, y, 0))
                centres.append((j + 0.5, y + 0.5))
                labels.append("∅")
                inks.append("white")
                continue
            shared = s.ref_cnts[block] > 1
            face = palette.get(rid, colors.UNKNOWN_COLOR)
            cells.append(_cell(j, y, 0.05))
            faces.append(face)
            edges.append("black" if shared else "white")
            widths.append(2.2 if shared else 0.5)
            centres.append((j + 0.5, y + 0.5))
            labels.append(str(block))
            inks.append(colors.text_color_on(face))
    ax.add_collection(PolyCollection(cells, facecolors=faces, edgecolors=edges, linewidths=widths,
                                     gid="tables-cells"), autolim=False)
    ax.add_collection(PolyCollection(nulls, facecolors=colors.NULL_COLOR, edgecolors="white",
                                     gid="tables-null"), autolim=False)
    if corners:
        ax.add_collection(PolyCollection(corners, facecolors=colors.STATE_COLOR, edgecolors="none",
                                         gid="tables-state"), autolim=False)
    if hits:
        ax.add_collection(PolyCollection(hits, facecolors="none", edgecolors=colors.PREFIX_HIT_COLOR,
                                         linewidths=2.5, gid="tables-hits"), autolim=False)
    rejected = rejected_slots(trace, step, rows)
    if rejected:
        ax.add_collection(PolyCollection(rejected, facecolors="white", edgecolors=colors.REJECTED_COLOR,
                                         hatch=colors.REJECTED_HATCH, linewidths=0.5, gid="tables-rejected"),
                          autolim=False)
    add_cell_labels(ax, centres, labels, fontsize, inks, "tables-ids")
    if not rows:
        ax.text(0.5, 0.5, "no running requests", ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_xlim(-names_pt / cell_w, room_pt / cell_w)
    ax.set_ylim(max(1, len(rows), height_pt / cell_h), 0)
    ax.set_axis_off()
    add_cell_labels(ax, [(-4 / cell_w, y + 0.5) for y in range(len(rows))], row_names, name_size, "black",
                    "tables-rows", align="right", clip=False)
    every = max(1, width // 16)
    above = offset_copy(ax.get_xaxis_transform(), fig=fig, y=7, units="points")  # x: data, y: just above
    add_cell_labels(ax, [(j + 0.5, 1.0) for j in range(0, width, every)], [str(j) for j in range(0, width, every)],
                    7, "#444444", "tables-columns", transform=above, clip=False)
    window = f" · ∅ = left the {trace.sliding_window}-token window (null block)" if trace.sliding_window else ""
    hidden = f" · {len(all_rows) - len(rows)} more rows not shown" if len(all_rows) > len(rows) else ""
    drafts = " · hatched = slots of rejected drafts (still held, rewritten next step)" if rejected else ""
    state = " · corner = state page" if "mamba" in groups else ""
    hit = " · gold edge = prefix-cache hit" if hits else ""
    ax.set_title(f"Block tables after step {s.step}{hidden}\nlogical block → physical block · "
                 f"thick edge = shared{window}{drafts}{state}{hit}", fontsize=9, pad=16)
    return fig


def rejected_slots(trace: Trace, step: int, rows: list[tuple[str, int]]) -> list[list[tuple[float, float]]]:
    """One box per KV slot written by a draft the target rejected in step *index* `step`.

    The step computed positions ``before .. before + scheduled - 1``; the request's own
    token and its accepted drafts are kept, so the rejected drafts sat at positions
    ``before + scheduled - rejected .. before + scheduled - 1``."""
    s, size = trace[step], trace.block_size
    boxes = []
    for r in s.scheduled:
        if not r.num_draft_tokens or r.num_accepted_tokens is None:
            continue
        end = r.num_computed_tokens_before + r.num_scheduled_tokens
        for y, (rid, g) in enumerate(rows):
            if rid != r.request_id:
                continue
            for position in range(end - (r.num_draft_tokens - r.num_accepted_tokens), end):
                j, slot = divmod(position, size)
                if j < len(s.block_tables[rid][g]):
                    x0, x1 = j + 0.05 + 0.9 * slot / size, j + 0.05 + 0.9 * (slot + 1) / size
                    boxes.append([(x0, y + 0.55), (x1, y + 0.55), (x1, y + 0.95), (x0, y + 0.95)])
    return boxes


def _cell(j: int, y: int, inset: float) -> list[tuple[float, float]]:
    return [(j + inset, y + inset), (j + 1 - inset, y + inset), (j + 1 - inset, y + 1 - inset),
            (j + inset, y + 1 - inset)]
