"""The requests of one step, by queue: the colour legend of the step's other plots.

    running    [r1] [r0]                  hold blocks after the step (the scheduler's running list)
    waiting    [r3] → [r4] → [r5]         the waiting queue, next to be admitted first
    finished   [r2]                       finished in this step: their blocks were freed
    preempted  [r5]                       preempted in this step (now waiting again)

Every request the step mentions appears, as a chip in its colour with its id, so
this panel is the legend from colour to request. Lanes longer than
`max_chips` end with "+N more". Per lane, the chips are one collection with gid
`queue-<lane>-chips` and the ids one label collection with gid `queue-<lane>`
(`.labels`: the request ids, in the lane's order; see `cell_labels`).
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from microvllm.trace import Trace
from microvllm.viz import colors
from microvllm.viz.canvas import figure_and_axes
from microvllm.viz.cell_labels import add_cell_labels, label_width_points

LANES = ("running", "waiting", "finished", "preempted")


def step_queues(trace: Trace, step: int) -> dict[str, list[str]]:
    """Request ids per lane at the end of step *index* `step`, in queue order."""
    s = trace[step]
    return {"running": list(s.block_tables), "waiting": list(s.waiting), "finished": list(s.finished),
            "preempted": list(s.preempted)}


def plot_queues(trace: Trace, step: int, ax: Axes | None = None, *, max_chips: int = 12) -> Figure:
    """Draw step *index* `step`'s requests as coloured chips, one lane per queue."""
    standalone = ax is None
    fig, ax = figure_and_axes(ax, (8, 2.2), layout=None)
    if standalone:                                       # room on the left for the lane names
        fig.subplots_adjust(left=0.13, right=0.98, top=0.86, bottom=0.02)
    palette = colors.request_colors(trace)
    lanes = step_queues(trace, step)
    pitch = 1.35                                         # x units from one chip to the next (a chip is 1 wide)
    x_max = max_chips * pitch + 1.5
    bbox = ax.get_position()
    lane_h = bbox.height * fig.get_figheight() * 72 / len(LANES)             # points
    unit = bbox.width * fig.get_figwidth() * 72 / x_max                      # points per x unit
    widest = max(label_width_points(trace.request_ids(), 1), 0.6)            # an id's width per point of font
    fontsize = min(8.5, 0.55 * lane_h, 0.85 * unit / widest)
    for y, lane in enumerate(LANES):
        ids = lanes[lane]
        shown = ids[:max_chips]
        xs = [k * pitch for k in range(len(shown))]
        chips = [[(x, y + 0.12), (x + 1, y + 0.12), (x + 1, y + 0.88), (x, y + 0.88)] for x in xs]
        faces = [palette.get(rid, colors.UNKNOWN_COLOR) for rid in shown]
        ax.add_collection(PolyCollection(chips, facecolors=faces, edgecolors="white", gid=f"queue-{lane}-chips"),
                          autolim=False)
        add_cell_labels(ax, [(x + 0.5, y + 0.5) for x in xs], shown, fontsize,
                        [colors.text_color_on(face) for face in faces], f"queue-{lane}")
        if lane == "waiting":                            # the queue's order: next to run on the left
            add_cell_labels(ax, [(x - (pitch - 1) / 2, y + 0.5) for x in xs[1:]], ["→"] * len(xs[1:]),
                            fontsize, "#444444", "queue-waiting-arrows")
        note = f"+{len(ids) - len(shown)} more" if len(ids) > len(shown) else "" if ids else "none"
        add_cell_labels(ax, [(len(shown) * pitch, y + 0.5)], [note], fontsize, "#444444", f"queue-{lane}-note",
                        align="left", clip=False)
    add_cell_labels(ax, [(-0.3, y + 0.5) for y in range(len(LANES))], list(LANES), fontsize, "black",
                    "queue-lanes", align="right", clip=False)
    ax.set_xlim(0, x_max)
    ax.set_ylim(len(LANES), 0)
    ax.set_axis_off()
    ax.set_title("Requests after this step (colour = request)", fontsize=9)
    return fig
