"""Figures drawn without pyplot: nothing global, nothing leaked, works headless.

A `Figure` made here is not registered with pyplot, so it is freed like any
object; Jupyter (with `%matplotlib inline`) still displays it as a PNG.
"""

from __future__ import annotations

import io

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


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
