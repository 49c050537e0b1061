"""All the plots of one step in one figure, built once and redrawn per step.

    +----------------------+------------------+
    |  block pool          |  batch of step   |
    |                      +------------------+
    |                      |  requests/queues |
    +----------------------+------------------+
    |  block tables                           |
    +-----------------------------------------+
    |  timeline (cursor on this step)         |
    +-----------------------------------------+

Its look comes from a preset, scaled (`look`): "notebook" (the default) or
"projector" (for the back of a room: no text under 14 pixels when the PNG is
shown at its own size, and 1600 x 900 pixels, to fit a 1080p screen).
The pool's grid takes as many columns as fill its panel with square cells. On a
16:9 canvas the tables' row is very wide: the notebook's rule (at least 12 columns,
so a short table keeps modest cells) left a third of it empty, so the projector's
"wide" layout lets a short table's cells grow to fill the row instead.

The timeline is rendered once and kept as a background image (Agg "blitting");
moving to another step clears and redraws only the other three axes and the
timeline's cursor on top of that background, then encodes the PNG.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import PIL.Image
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from microvllm.trace import Trace
from microvllm.viz import colors
from microvllm.viz.batch import plot_batch
from microvllm.viz.block_pool import plot_block_pool
from microvllm.viz.block_table import plot_block_tables
from microvllm.viz.canvas import enlarge_small_text, new_figure, reset_axes
from microvllm.viz.queues import plot_queues
from microvllm.viz.timeline import move_cursor, plot_timeline


@dataclass(frozen=True)
class Look:
    """Size of the step figure: inches, pixels per inch, and the smallest text in pixels."""

    figsize: tuple[float, float]
    dpi: float
    min_text_px: float | None = None      # None: the plots' own sizes (down to ~6 points)
    layout: str = "stacked"               # "stacked" or "wide": short block tables fill the row

    @property
    def min_fontsize(self) -> float | None:
        """The smallest text in points (1 point = dpi / 72 pixels)."""
        return None if self.min_text_px is None else self.min_text_px * 72 / self.dpi


PRESETS = {"notebook": Look((13, 10.5), 72),
           "projector": Look((16, 9), 100, min_text_px=14, layout="wide")}
LAYOUTS = ("stacked", "wide")


def look(preset: str = "notebook", scale: float = 1.0, figsize: tuple[float, float] | None = None,
         dpi: float | None = None) -> Look:
    """A preset's look, `scale` times bigger on screen (more pixels per inch, same layout)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {list(PRESETS)}")
    if scale <= 0:
        raise ValueError(f"scale is {scale}: it multiplies the picture's size, use a number > 0 (e.g. 1.5)")
    base = PRESETS[preset]
    return Look(figsize or base.figsize, (dpi or base.dpi) * scale,
                None if base.min_text_px is None else base.min_text_px * scale, base.layout)


class StepFigure:
    def __init__(self, trace: Trace, *, figsize: tuple[float, float] = (13, 10.5), dpi: float = 72,
                 min_fontsize: float | None = None, layout: str = "stacked") -> None:
        if len(trace) == 0:
            raise ValueError("the trace has no steps: record a run with trace=True first")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}")
        self.trace = trace
        self.min_fontsize = min_fontsize
        self.figure = new_figure(figsize, dpi=dpi, layout=None)   # fixed layout: no re-layout per step
        grid = self.figure.add_gridspec(4, 2, height_ratios=[1.9, 1.2, 2.0, 1.6], width_ratios=[1.0, 1.0],
                                        left=0.055, right=0.94, top=0.93, bottom=0.11, hspace=0.6, wspace=0.42)
        pool, batch, queues, tables, timeline = grid[0:2, 0], grid[0, 1], grid[1, 1], grid[2, :], grid[3, :]
        self.min_table_columns = 12 if layout == "stacked" else 1
        self.pool_ax = self.figure.add_subplot(pool)
        self.batch_ax = self.figure.add_subplot(batch)
        self.queues_ax = self.figure.add_subplot(queues)
        self.tables_ax = self.figure.add_subplot(tables)
        self.timeline_ax = self.figure.add_subplot(timeline)
        self.dynamic_axes = (self.pool_ax, self.batch_ax, self.queues_ax, self.tables_ax)
        plot_timeline(trace, 0, ax=self.timeline_ax, legend=False)
        self._legend()
        if min_fontsize:
            enlarge_small_text(self.figure, min_fontsize)
        self.step: int | None = None
        self._background = None          # pixels of the static part (timeline, legend)

    def draw(self, step: int) -> Figure:
        """Show step *index* `step`; returns the (same) figure."""
        for ax in self.dynamic_axes:
            reset_axes(ax)
        plot_block_pool(self.trace, step, ax=self.pool_ax, legend=False)
        plot_batch(self.trace, step, ax=self.batch_ax)
        plot_queues(self.trace, step, ax=self.queues_ax)
        plot_block_tables(self.trace, step, ax=self.tables_ax, min_columns=self.min_table_columns)
        move_cursor(self.timeline_ax, self.trace, step)
        if self.min_fontsize:
            for ax in self.dynamic_axes:
                enlarge_small_text(ax, self.min_fontsize)
        self.step = step
        return self.figure

    def png(self) -> bytes:
        """The figure as PNG bytes; after the first call only the per-step axes are redrawn."""
        canvas = self.figure.canvas
        dynamic = self.dynamic_axes
        cursor = next(line for line in self.timeline_ax.lines if line.get_gid() == "cursor")
        if self._background is None:
            for artist in (*dynamic, cursor):
                artist.set_visible(False)
            canvas.draw()
            self._background = canvas.copy_from_bbox(self.figure.bbox)
            for artist in (*dynamic, cursor):
                artist.set_visible(True)
        canvas.restore_region(self._background)
        renderer = canvas.get_renderer()
        for ax in dynamic:
            ax.draw(renderer)
        self.timeline_ax.draw_artist(cursor)
        width, height = canvas.get_width_height()
        image = PIL.Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        buffer = io.BytesIO()
        image.save(buffer, format="png", compress_level=1)
        return buffer.getvalue()

    def _legend(self) -> None:
        # Bars take their request's colour, so a bar's swatch shows a few request colours
        # side by side (the first requests of this trace) in that kind's style.
        swatches = list(colors.request_colors(self.trace).values())[:3] or colors.PALETTE[:3]

        def kind(label: str, **style) -> tuple[tuple[Patch, ...], str]:
            return tuple(Patch(facecolor=c, **style) for c in swatches), label

        entries = [(Patch(facecolor=colors.CACHED_COLOR, edgecolor="#888888", hatch=colors.CACHED_HATCH),
                    "free, still cached"),
                   (Patch(facecolor=colors.FREE_COLOR), "free, empty"),
                   (Patch(facecolor=colors.NULL_COLOR), "null block 0"),
                   kind("prefill tokens (solid)"),
                   kind("decode tokens (faint)", alpha=colors.DECODE_ALPHA, edgecolor="black", linewidth=0.5),
                   (Line2D([], [], color=colors.BUDGET_COLOR, linestyle="--"), "token budget"),
                   (Line2D([], [], marker="*", color=colors.PREFIX_HIT_COLOR, markeredgecolor="black",
                           linestyle="none"), "prefix-cache hit"),
                   (Line2D([], [], marker="X", color=colors.PREEMPT_COLOR, linestyle="none"), "preempted"),
                   (Patch(facecolor="none", edgecolor=colors.ALLOCATED_COLOR, linewidth=2.5), "allocated this step"),
                   (Patch(facecolor="none", edgecolor=colors.FREED_COLOR, linewidth=2.5), "freed this step")]
        if any(r.num_draft_tokens for s in self.trace for r in s.scheduled):     # speculative decoding
            entries += [kind("accepted drafts", hatch=colors.DRAFT_HATCH, edgecolor="black", linewidth=0.5),
                        (Patch(facecolor="white", hatch=colors.REJECTED_HATCH, edgecolor=colors.REJECTED_COLOR),
                         "rejected drafts (their slots)")]
        handles, labels = zip(*entries)
        self.figure.legend(handles=handles, labels=labels, loc="lower center", ncols=(len(entries) + 1) // 2,
                           fontsize=8, frameon=False, handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})


def plot_step(trace: Trace, step: int, *, figsize: tuple[float, float] | None = None, preset: str = "notebook",
              scale: float = 1.0, dpi: float | None = None) -> Figure:
    """A new figure with every plot of step *index* `step` (for static notebooks).

    `preset` and `scale` as for `StepExplorer`; a static figure defaults to 100 dpi.
    """
    chosen = look(preset, scale, figsize, dpi or max(100, PRESETS[preset].dpi))
    return StepFigure(trace, figsize=chosen.figsize, dpi=chosen.dpi, min_fontsize=chosen.min_fontsize,
                      layout=chosen.layout).draw(step)
