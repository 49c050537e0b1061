"""Figures drawn without pyplot: nothing global, nothing leaked, works headless.

A `Figure` made here is not registered with pyplot, so it is freed like any
object; Jupyter (with `%matplotlib inline`) still displays it as a PNG.
"""

from __future__ import annotations

import io

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text


def new_figure(figsize: tuple[float, float], dpi: int = 100, layout: str | None = "constrained") -> Figure:
    fig = Figure(figsize=figsize, dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def figure_and_axes(ax: Axes | None, figsize: tuple[float, float],
                    layout: str | None = "constrained") -> tuple[Figure, Axes]:
    """Draw into `ax` if given (the explorer reuses its axes), else into a new figure."""
    if ax is not None:
        return ax.figure, ax
    fig = new_figure(figsize, layout=layout)
    return fig, fig.add_subplot()


def figure_to_png(fig: Figure, dpi: int | None = None) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def reset_axes(ax: Axes) -> None:
    """Remove what a plot drew into `ax` but keep the axes (cheaper than `ax.clear()`,
    which rebuilds every tick)."""
    for artist in [*ax.collections, *ax.patches, *ax.lines, *ax.texts, *ax.images]:
        artist.remove()
    if ax.get_legend() is not None:
        ax.get_legend().remove()


def enlarge_small_text(artist: Artist, min_fontsize: float) -> None:
    """Raise every text under `artist` (a figure or axes) to at least `min_fontsize` points:
    titles, legends, tick labels, and label collections (`cell_labels`, sized fontsize**2).

    Label collections were sized to fit their cells or rows; one under half the minimum
    would overlap its neighbours once enlarged, so it is hidden instead (a big trace on a
    projector keeps its colours, and loses the numbers that cannot be read anyway).
    """
    for ax in [artist] if isinstance(artist, Axes) else getattr(artist, "axes", []):
        ticks = ax.xaxis.get_ticklabels() + ax.yaxis.get_ticklabels()
        if any(t.get_fontsize() < min_fontsize for t in ticks):
            ax.tick_params(labelsize=max(min_fontsize, *(t.get_fontsize() for t in ticks)))
    for text in artist.findobj(Text):
        if text.get_fontsize() < min_fontsize:
            text.set_fontsize(min_fontsize)
    for labels in artist.findobj(lambda a: hasattr(a, "labels") and hasattr(a, "set_sizes")):
        sizes = labels.get_sizes()
        if len(sizes) and sizes.max() < (min_fontsize / 2) ** 2:
            labels.set_visible(False)
        labels.set_sizes(np.maximum(sizes, min_fontsize**2))
