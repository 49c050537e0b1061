"""The whole run at a glance: tokens per step by request, prefill vs decode.

    tokens (square-root scale)                     free blocks (grey line, right axis)
      32 - - - - - - - - - - - - - - - - - budget
      16 ██ ▓▓             v (preempted)       ____/‾‾‾‾
       4 ██ ▓▓ ▒ ▒ ▒ ▒ ▒ ▒ ▒ ▒ ...
       1 ██ ▓▓ ▒ ▒ ▒ ▒ ▒ ▒ ▒ ▒ ...
         step 0  1  2  ...

One column per step, stacked by request in the runner's batch order (`batch.runner_order`): solid = prefill
tokens, faint = decode tokens; the colour is the request's. The token axis is a
square-root scale: on a linear axis as tall as the budget (hundreds or thousands of
tokens) a decode step of a few tokens is a sliver nobody sees; on this one a single
token reaches 1/sqrt(budget) of the height (9% for 128). The price: a column's
segments are not in proportion (the batch panel shows one step's true shares).
The free-blocks line has its own axis, scaled so that a pool with every block free
sits at 80% of the height, under the budget line (always above 94%).
When requests arrive over time (a server), △ under the axis marks each arrival and ● its first token.
Gids: collections `timeline-prefill` and `timeline-decode` (one rectangle per request and step),
lines `budget`, `free-blocks`, `preemptions`, `cursor` (the selected step).
"""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, MaxNLocator

from microvllm.trace import Trace
from microvllm.viz import colors
from microvllm.viz.batch import runner_order
from microvllm.viz.canvas import figure_and_axes


def plot_timeline(trace: Trace, step: int | None = None, ax: Axes | None = None, *,
                  legend: bool = True) -> Figure:
    """Draw every step; mark step *index* `step` with a cursor line if given."""
    fig, ax = figure_and_axes(ax, (12, 3.4))
    palette = colors.request_colors(trace)
    xs = [s.step for s in trace]
    bars: dict[str, tuple[list, list]] = {"prefill": ([], []), "decode": ([], [])}
    for s in trace:                       # one rectangle per (step, request), stacked
        bottom = 0
        for r in runner_order(s.scheduled):
            top = bottom + r.num_scheduled_tokens
            x0, x1 = s.step - 0.4, s.step + 0.4
            polygons, faces = bars[r.kind]
            polygons.append([(x0, bottom), (x1, bottom), (x1, top), (x0, top)])
            faces.append(palette.get(r.request_id, colors.UNKNOWN_COLOR))
            bottom = top
    for kind, (polygons, faces) in bars.items():   # two collections: fast to draw for long runs
        ax.add_collection(PolyCollection(polygons, facecolors=faces, edgecolors="none",
                                         alpha=colors.DECODE_ALPHA if kind == "decode" else 1.0,
                                         gid=f"timeline-{kind}"), autolim=False)
    budgets = [s.token_budget for s in trace]
    peak = max([s.num_scheduled_tokens for s in trace] + budgets + [1])
    ax.step(xs, budgets, where="mid", color=colors.BUDGET_COLOR, linestyle="--", linewidth=1.2, gid="budget")
    preempted = [s for s in trace if s.preempted]
    ax.plot([s.step for s in preempted], [peak * 1.06] * len(preempted), linestyle="none", marker="v",
            color=colors.PREEMPT_COLOR, markersize=7, clip_on=False, gid="preemptions")
    arrivals = _arrival_markers(ax, trace, palette)
    free_axis = ax.twinx()
    free_axis.plot(xs, [s.num_free_blocks for s in trace], color="#777777", linewidth=1.2, gid="free-blocks")
    free_axis.set_ylim(0, trace.num_blocks / FREE_LINE_TOP)          # all free: under the budget line
    free_axis.set_yticks(sorted({0, trace.num_blocks // 2, trace.num_blocks}))
    free_axis.set_ylabel("free blocks", fontsize=8, color="#777777")
    free_axis.tick_params(labelsize=7, colors="#777777")
    ax.axvline(xs[step] if step is not None and xs else 0, color="black", linewidth=1.5, alpha=0.8,
               visible=step is not None and bool(xs), gid="cursor")
    ax.set_xlim((xs[0] if xs else 0) - 0.6, (xs[-1] if xs else 0) + 0.6)
    ax.set_yscale("function", functions=(_sqrt, np.square))
    ax.set_ylim(0, peak * 1.12)
    ax.yaxis.set_major_locator(FixedLocator(_token_ticks(peak)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("engine step", fontsize=8)
    ax.set_ylabel("tokens scheduled (√ scale)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(f"Timeline: {len(trace)} steps · {len(preempted)} with preemptions (▼) · "
                 f"budget {trace.max_num_batched_tokens} tokens (dashed) · free blocks (grey, right)"
                 + (" · arrival (△) → first token (●)" if arrivals else ""), fontsize=9)
    if legend:
        _legend(ax, trace, palette)
    return fig


FREE_LINE_TOP = 0.8             # fraction of the height where "every block free" is drawn


def _sqrt(y):
    return np.sqrt(np.maximum(y, 0))


def _token_ticks(peak: float) -> list[int]:
    """0, 1, 4, 16, 64, ... up to `peak`: a tick at every fourfold (twice as high on the √ axis)."""
    ticks, t = [0], 1 if peak <= 32 else 4            # 1 and 4 would crowd the bottom of a tall axis
    while t <= peak:
        ticks.append(t)
        t *= 4
    return ticks


def _arrival_markers(ax: Axes, trace: Trace, palette: dict[str, str]) -> bool:
    """Requests that arrive over time (a server, ``viz.demo``): △ at the step each
    arrived, ● at the step of its first token, in its colour; the gap is its queueing
    plus prefill. Drawn (gids ``arrivals``, ``first-tokens``) only when some request
    arrived after the first step; returns whether they were."""
    first_step = trace.steps[0].step if trace.steps else 0
    arrived = {rid: step for rid, step in trace.arrival_steps.items()}
    if not any(step > first_step for step in arrived.values()):
        return False
    first_tokens = trace.first_token_steps()
    for gid, marker, steps in (("arrivals", "^", arrived), ("first-tokens", "o", first_tokens)):
        ids = [rid for rid in arrived if rid in steps]
        ax.scatter([steps[rid] for rid in ids], [-0.05] * len(ids), marker=marker, s=22, clip_on=False,
                   transform=ax.get_xaxis_transform(),       # x in steps, y just under the axis
                   facecolors="none" if marker == "^" else [palette.get(r, colors.UNKNOWN_COLOR) for r in ids],
                   edgecolors=[palette.get(r, colors.UNKNOWN_COLOR) for r in ids], gid=gid, zorder=3)
    return True


def move_cursor(fig_or_ax, trace: Trace, step: int) -> None:
    """Put the timeline's cursor on step *index* `step` (no redraw of the bars)."""
    axes = fig_or_ax.axes if isinstance(fig_or_ax, Figure) else [fig_or_ax]
    for ax in axes:
        for line in ax.lines:
            if line.get_gid() == "cursor":
                line.set_xdata([trace[step].step] * 2)
                line.set_visible(True)


def _legend(ax: Axes, trace: Trace, palette: dict[str, str]) -> None:
    swatches = list(palette.values())[:3] or colors.PALETTE[:3]      # bars wear their request's colour
    handles: list = [tuple(Patch(facecolor=c) for c in swatches),
                     tuple(Patch(facecolor=c, alpha=colors.DECODE_ALPHA) for c in swatches),
                     Line2D([], [], color=colors.BUDGET_COLOR, linestyle="--"),
                     Line2D([], [], color="#777777")]
    labels = ["prefill (solid)", "decode (faint)", "token budget", "free blocks"]
    requests = trace.request_ids()
    if len(requests) <= 10:
        handles += [Patch(facecolor=palette[rid]) for rid in requests]
        labels += requests
    ax.legend(handles=handles, labels=labels, loc="upper left", bbox_to_anchor=(1.05, 1), fontsize=7,
              frameon=False, handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})
