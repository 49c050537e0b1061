"""All four plots of one step in one figure, built once and redrawn per step.

    +----------------------+------------------+
    |  block pool          |  batch of step   |
    +----------------------+------------------+
    |  block tables                           |
    +-----------------------------------------+
    |  timeline (cursor on this step)         |
    +-----------------------------------------+

The timeline is rendered once and kept as a background image (Agg "blitting");
moving to another step clears and redraws only the other three axes and the
timeline's cursor on top of that background, then encodes the PNG.
"""

from __future__ import annotations

import io

import PIL.Image
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from microvllm.trace import Trace
from microvllm.viz import colors
from microvllm.viz.batch import plot_batch
from microvllm.viz.block_pool import plot_block_pool
from microvllm.viz.block_table import plot_block_tables
from microvllm.viz.canvas import new_figure, reset_axes
from microvllm.viz.timeline import move_cursor, plot_timeline


class StepFigure:
    def __init__(self, trace: Trace, *, figsize: tuple[float, float] = (13, 10), dpi: int = 72) -> None:
        if len(trace) == 0:
            raise ValueError("the trace has no steps: record a run with trace=True first")
        self.trace = trace
        self.figure = new_figure(figsize, dpi=dpi, layout=None)   # fixed layout: no re-layout per step
        grid = self.figure.add_gridspec(3, 2, height_ratios=[3.0, 2.0, 1.6], width_ratios=[1.0, 1.0],
                                        left=0.07, right=0.94, top=0.94, bottom=0.08, hspace=0.42, wspace=0.42)
        self.pool_ax = self.figure.add_subplot(grid[0, 0])
        self.batch_ax = self.figure.add_subplot(grid[0, 1])
        self.tables_ax = self.figure.add_subplot(grid[1, :])
        self.timeline_ax = self.figure.add_subplot(grid[2, :])
        plot_timeline(trace, 0, ax=self.timeline_ax, legend=False)
        self._legend()
        self.step: int | None = None
        self._background = None          # pixels of the static part (timeline, legend)

    def draw(self, step: int) -> Figure:
        """Show step *index* `step`; returns the (same) figure."""
        for ax in (self.pool_ax, self.batch_ax, self.tables_ax):
            reset_axes(ax)
        plot_block_pool(self.trace, step, ax=self.pool_ax, legend=False)
        plot_batch(self.trace, step, ax=self.batch_ax)
        plot_block_tables(self.trace, step, ax=self.tables_ax)
        move_cursor(self.timeline_ax, self.trace, step)
        self.step = step
        return self.figure

    def png(self) -> bytes:
        """The figure as PNG bytes; after the first call only the per-step axes are redrawn."""
        canvas = self.figure.canvas
        dynamic = (self.pool_ax, self.batch_ax, self.tables_ax)
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
        handles = [Patch(facecolor=colors.CACHED_COLOR, edgecolor="#888888", hatch=colors.CACHED_HATCH,
                         label="free, still cached"),
                   Patch(facecolor=colors.FREE_COLOR, label="free, empty"),
                   Patch(facecolor=colors.NULL_COLOR, label="null block 0"),
                   Patch(facecolor="#888888", label="prefill tokens"),
                   Patch(facecolor="#888888", alpha=colors.DECODE_ALPHA, edgecolor="black",
                         label="decode tokens"),
                   Line2D([], [], color=colors.BUDGET_COLOR, linestyle="--", label="token budget"),
                   Line2D([], [], marker="*", color="#f5b800", markeredgecolor="black", linestyle="none",
                          label="prefix-cache hit"),
                   Line2D([], [], marker="X", color=colors.PREEMPT_COLOR, linestyle="none", label="preempted")]
        self.figure.legend(handles=handles, loc="lower center", ncols=len(handles), fontsize=8,
                           frameon=False)


def plot_step(trace: Trace, step: int, *, figsize: tuple[float, float] = (13, 10)) -> Figure:
    """A new figure with every plot of step *index* `step` (for static notebooks)."""
    return StepFigure(trace, figsize=figsize, dpi=100).draw(step)
