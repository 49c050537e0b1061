"""The batch of one step: who got how many of the step's token budget.

    tokens  0        10        20        30 |budget 32
    r1      [▒]                             decode 1
    r4         [▒///xxx]                    decode 1 + 6 drafts, 3 accepted
    r0                [##########]*         prefill 10 (new, +8 cached)
    r2                           [#########] prefill 9 (chunk)
    r3      ✕ preempted

Rows are in the model runner's order (`runner_order`): the order of the requests'
tokens in the flattened input batch (`input_ids`, `query_start_loc`), which is
the order notebook 07 prints. The bars are stacked end to end, so a bar starts
at its request's first row in `input_ids`, their total length is the step's
scheduled tokens and the red line is the budget (max_num_batched_tokens).
Prefill chunks are solid, decode tokens faint with a black outline. A bar is
drawn at least `MIN_BAR_FRACTION` of the axis wide, so that one decode token
stays visible on a budget of thousands (the label says the true count).
A request that found blocks in the prefix cache gets a ★ just after its bar.
Bars carry gids `batch-<request>-<kind>`; the budget line is `budget`; markers
`prefix-hits` and `preempted`; row labels `batch-labels`.

Speculative decoding: a request's draft tokens (checked in the same forward, after its
newest token) continue its bar, hatched: accepted drafts ``///`` in the request's
colour (gid `batch-<request>-accepted`), rejected ones ``xxx`` in red on white (gid
`batch-<request>-rejected`; their KV slots stay the request's and are rewritten next
step, see `block_table`). The request's own bar (`batch-<request>-<kind>`) then counts
only its non-draft tokens; every bar's true token count is its ``num_tokens``.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.transforms import offset_copy

from microvllm.trace import RequestStep, Trace
from microvllm.viz import colors
from microvllm.viz.canvas import figure_and_axes
from microvllm.viz.cell_labels import add_cell_labels, label_width_points
from microvllm.viz.summary import scheduled_before

MIN_BAR_FRACTION = 0.02          # of the x axis: the narrowest bar drawn


def runner_order(scheduled: list[RequestStep]) -> list[RequestStep]:
    """The step's requests in the model runner's batch order (`ModelRunner._prepare_inputs`).

    The plan lists newly scheduled requests, then running ones (the trace keeps
    that order in `StepTrace.scheduled`); the runner then moves the one-token
    requests (decodes) to the front, keeping the plan's order within each group,
    as vLLM's `reorder_batch` does.
    """
    return sorted(scheduled, key=lambda r: r.num_scheduled_tokens != 1)


def describe_request_step(r: RequestStep, resumed: bool = False) -> str:
    """'prefill 9 (new, +8 cached)' / 'decode 1' / 'decode 1 + 3 drafts, 2 accepted' — the row label."""
    notes = []
    if r.is_new:
        notes.append("resumed" if resumed else "new")
    if r.prefix_hit_tokens:
        notes.append(f"+{r.prefix_hit_tokens} cached")
    total = r.num_computed_tokens_before + r.num_scheduled_tokens
    if r.kind == "prefill" and not r.is_new and r.num_computed_tokens_before > 0:
        notes.append("next chunk")
    if r.kind == "prefill" and total < r.num_prompt_tokens:
        notes.append(f"{total}/{r.num_prompt_tokens} of prompt")
    own = r.num_scheduled_tokens - r.num_draft_tokens
    drafts = ""
    if r.num_draft_tokens:
        drafts = f" + {r.num_draft_tokens} draft{'s' if r.num_draft_tokens > 1 else ''}"
        if r.num_accepted_tokens is not None:
            drafts += f", {r.num_accepted_tokens} accepted"
    return f"{r.kind} {own}{drafts}" + (f" ({', '.join(notes)})" if notes else "")


def draft_split(r: RequestStep) -> tuple[int, int, int]:
    """(own tokens, accepted drafts, rejected drafts) of one request's share of a step.
    Drafts whose fate is unknown (``num_accepted_tokens`` None) count as rejected."""
    accepted = r.num_accepted_tokens or 0
    return r.num_scheduled_tokens - r.num_draft_tokens, accepted, r.num_draft_tokens - accepted


def plot_batch(trace: Trace, step: int, ax: Axes | None = None) -> Figure:
    """Draw step *index* `step`'s batch against its token budget."""
    s = trace[step]
    batch = runner_order(s.scheduled)
    rows = len(batch) + len(s.preempted)
    standalone = ax is None
    fig, ax = figure_and_axes(ax, (8, 1.6 + 0.35 * max(1, rows)), layout=None)
    palette = colors.request_colors(trace)
    seen_before = scheduled_before(trace, step)
    tokens = [r.num_scheduled_tokens for r in batch]
    lefts = [sum(tokens[:k]) for k in range(len(tokens))]
    x_max = max(s.token_budget, sum(tokens)) * 1.04
    own = [draft_split(r)[0] for r in batch]
    widths = [max(n, MIN_BAR_FRACTION * x_max) for n in own]
    faces = [to_rgba(palette.get(r.request_id, colors.UNKNOWN_COLOR), colors.DECODE_ALPHA if r.kind == "decode"
                     else 1.0) for r in batch]
    bars = ax.barh(range(len(widths)), widths, left=lefts, height=0.7, color=faces, linewidth=0.5,
                   edgecolor=["black" if r.kind == "decode" else face for r, face in zip(batch, faces)])
    for bar, r, n in zip(bars, batch, own):
        bar.set_gid(f"batch-{r.request_id}-{r.kind}")
        bar.num_tokens = n                               # the true width (a bar is drawn at least MIN_BAR_FRACTION)
    ends = _draw_drafts(ax, batch, lefts, widths, faces, MIN_BAR_FRACTION * x_max)
    hits = [(end, y) for y, (end, r) in enumerate(zip(ends, batch)) if r.prefix_hit_tokens]
    after_bar = offset_copy(ax.transData, fig=fig, x=9, units="points")     # beside the bar's end, hiding none of it
    ax.plot([x for x, _ in hits], [y for _, y in hits], marker="*", markersize=12, color=colors.PREFIX_HIT_COLOR,
            markeredgecolor="black", linestyle="none", clip_on=False, gid="prefix-hits", transform=after_bar)
    first = len(batch)
    ax.plot([0] * len(s.preempted), range(first, first + len(s.preempted)), marker="X", markersize=10,
            color=colors.PREEMPT_COLOR, linestyle="none", clip_on=False, gid="preempted")
    labels = [f"{r.request_id}: {describe_request_step(r, r.request_id in seen_before)}" for r in batch]
    labels += [f"{rid}: preempted" for rid in s.preempted]   # short: it sits beside the block pool panel
    if standalone:                                  # leave room on the left for the labels
        width, height = fig.get_size_inches()
        names = (label_width_points(labels, 8) + 12) / 72
        fig.subplots_adjust(left=min(0.6, names / width), right=0.96, top=1 - 0.55 / height, bottom=0.55 / height)
    row_height = ax.get_position().height * fig.get_figheight() * 72 / (max(rows, 1) + 0.4)   # in points
    left_of_axes = offset_copy(ax.get_yaxis_transform(), fig=fig, x=-9, units="points")
    add_cell_labels(ax, [(0, y) for y in range(rows)], labels, min(8, 0.75 * row_height), "black",
                    "batch-labels", align="right", transform=left_of_axes, clip=False)
    start = sum(tokens)
    ax.axvline(s.token_budget, color=colors.BUDGET_COLOR, linestyle="--", linewidth=1.5, gid="budget")
    ax.text(s.token_budget, 1.0, f"budget {s.token_budget}", color=colors.BUDGET_COLOR, fontsize=8,
            va="bottom", ha="right", transform=ax.get_xaxis_transform())
    ax.set_yticks([])
    ax.set_ylim(max(rows, 1) - 0.4, -0.8)
    ax.set_xlim(0, x_max)
    ax.set_xlabel("tokens in this step (runner's batch order)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    ax.set_title(f"Batch of step {s.step}: {start}/{s.token_budget} tokens · "
                 f"{len(s.scheduled)}/{s.max_num_seqs} seqs · {len(s.waiting)} waiting", fontsize=9, pad=14)
    if not rows:
        ax.text(0.5, 0.5, "nothing scheduled", ha="center", va="center", transform=ax.transAxes, color="#666666")
    return fig


def _draw_drafts(ax: Axes, batch: list[RequestStep], lefts: list[int], widths: list[float], faces,
                 min_width: float) -> list[float]:
    """Each request's drafts after its own bar: accepted ``///``, rejected ``xxx`` (module
    docstring); each part at least ``min_width`` wide, like the other bars. Returns where
    each request's drawn bar (drafts included) ends."""
    ends = []
    for y, (r, left, width, face) in enumerate(zip(batch, lefts, widths, faces)):
        ends.append(left + width)
        if not r.num_draft_tokens:
            continue
        _, accepted, rejected = draft_split(r)
        x = left + width
        for n, gid, style in ((accepted, "accepted", dict(color=face, hatch=colors.DRAFT_HATCH, edgecolor="black")),
                              (rejected, "rejected", dict(color="white", hatch=colors.REJECTED_HATCH,
                                                          edgecolor=colors.REJECTED_COLOR))):
            if n:
                (bar,) = ax.barh([y], [max(n, min_width)], left=x, height=0.7, linewidth=0.5,
                                 gid=f"batch-{r.request_id}-{gid}", **style)
                bar.num_tokens = n
                x += max(n, min_width)
        ends[-1] = x
    return ends
