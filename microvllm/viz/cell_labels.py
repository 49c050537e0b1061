"""Many small labels (block ids, ref counts, row names) drawn as ONE collection of glyph outlines.

A matplotlib `Text` (or a tick label) costs about a millisecond to lay out and
draw; a grid of a few hundred block ids would make every redraw of the step
explorer slow. Instead each distinct label is turned into a glyph outline once
(`TextPath`, cached), and all labels of a plot go into one `PathCollection`
placed at the given points, sized in points like a scatter plot's markers. It
reads the same and draws in about a millisecond. The labels stay readable from
code: the collection's `labels` attribute.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PathCollection
from matplotlib.font_manager import FontProperties
from matplotlib.path import Path
from matplotlib.textpath import TextPath
from matplotlib.transforms import IdentityTransform, Transform


@lru_cache(maxsize=4096)
def _glyphs(label: str, bold: bool, align: str) -> Path:
    """`label`'s outline, 1 unit = 1 font size, anchored at (0, 0) by `align`, centred vertically."""
    if not label.strip():
        return Path(np.zeros((1, 2)))                        # nothing to draw
    path = TextPath((0, 0), label, size=1, prop=FontProperties(weight="bold" if bold else "normal"))
    points = path.vertices[path.codes != Path.CLOSEPOLY]    # control points: bounds close enough, and fast
    (x0, y0), (x1, y1) = points.min(axis=0), points.max(axis=0)
    x = {"center": (x0 + x1) / 2, "right": x1, "left": x0}[align]
    return Path(path.vertices - (x, (y0 + y1) / 2), path.codes)


def add_cell_labels(ax: Axes, points: list[tuple[float, float]], labels: list[str], fontsize: float,
                    colors: str | list[str], gid: str, *, bold: bool = False, align: str = "center",
                    transform: Transform | None = None, clip: bool = True) -> PathCollection:
    """Write labels[i] at points[i] (data coordinates unless `transform`), `fontsize` points high."""
    paths = [_glyphs(label, bold, align) for label in labels]
    collection = PathCollection(paths, sizes=[fontsize**2] * len(paths),
                                offsets=np.asarray(points, dtype=float).reshape(-1, 2),
                                offset_transform=transform or ax.transData, transform=IdentityTransform(),
                                facecolors=colors, edgecolors="none", linewidths=0, zorder=3, gid=gid)
    collection.labels = list(labels)
    collection.set_clip_on(clip)
    ax.add_collection(collection, autolim=False)
    return collection


def label_width_points(labels: list[str], fontsize: float) -> float:
    """The widest label's width in points (to make room for labels outside the cells)."""
    def width(path: Path) -> float:
        return float(np.ptp(path.vertices[path.codes != Path.CLOSEPOLY, 0])) if path.codes is not None else 0.0

    return max((width(_glyphs(label, False, "left")) * fontsize for label in labels), default=0.0)
