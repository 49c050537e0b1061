"""Where a router sent each request, and what the chosen replica's prefix cache gave it.

    plot_routing(report, block_size=4)            one RouteReport (microvllm/router/)
    plot_routing(comparison)                      a PolicyComparison: one panel per policy

                        prompt blocks →
      request 0  S3    ░░░░░░░░░░░░░░░░░░░           all computed (replica 0's colour, hatched)
      request 1  S1    ████░░░░░░░░░░░░░░░           1 block from replica 1's cache, 4 computed
      request 2  S3    ███████████████░░░░           4 blocks from replica 0's cache
      ...
                 ^ the system prompt it starts with (a PolicyComparison's workload knows it)

One row per request, in arrival order (request 0 at the top). A row is the request's prompt
in KV blocks, ``ceil(prompt tokens / block_size)``; the first ``hit tokens / block_size`` of
them came from the chosen replica's prefix cache (``Decision.hit_tokens``, the engine's
``RequestOutput.num_cached_tokens``: filled), the rest were computed (hatched). The colour is
the replica the policy chose. Round robin's rows alternate colours and keep recomputing each
system prompt; a prefix-aware policy gives each system prompt one colour, and its rows fill.

Gids: bars ``hit-blocks`` and ``computed-blocks`` (one of each per request, in arrival order,
even when a width is 0).
"""

from __future__ import annotations

from matplotlib.patches import Patch

from microvllm.viz.canvas import new_figure
from microvllm.viz.colors import PALETTE

HIT_ALPHA = 1.0
COMPUTED_HATCH = "////"


def replica_color(replica: int) -> str:
    """One colour per replica, the same in every panel."""
    return PALETTE[replica % len(PALETTE)]


def routing_rows(report, block_size: int) -> list[tuple[int, int, int]]:
    """Per decision, in arrival order: ``(replica, hit blocks, prompt blocks)``. A prefix-cache
    hit is whole blocks, so ``hit_tokens`` is a multiple of ``block_size``."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: give the replicas' block size (a positive number of tokens)")
    rows = []
    for d in report.decisions:
        if d.hit_tokens % block_size:
            raise ValueError(f"request {d.request_id} has {d.hit_tokens} hit tokens, not a multiple of "
                             f"block_size={block_size}: pass the replicas' block size")
        rows.append((d.replica, d.hit_tokens // block_size, -(-d.prompt_tokens // block_size)))
    return rows


def plot_routing(result, block_size: int | None = None, *, prefix_of=None):
    """Each request's replica and its prompt's blocks, hit or computed (see the module docstring).

    ``result``: a ``RouteReport`` (then ``block_size`` is required; ``prefix_of``, optional, labels
    each row with its system prompt) or a ``PolicyComparison`` (block size and system prompts come
    from its workload; one panel per policy, side by side)."""
    reports = getattr(result, "reports", None)
    if reports is not None:                      # a PolicyComparison
        workload = result.workload
        block_size = workload.block_size if block_size is None else block_size
        prefix_of = workload.prefix_of if prefix_of is None else prefix_of
        panels = list(reports.values())
    else:
        if block_size is None:
            raise ValueError("plot_routing(report) needs block_size=: a RouteReport does not record it "
                             "(pass the replicas' block_size, or a PolicyComparison)")
        panels = [result]
    if not panels or not panels[0].decisions:
        raise ValueError("nothing to draw: the report has no decisions (route some prompts first)")
    num_requests = len(panels[0].decisions)
    fig = new_figure((0.6 + 3.1 * len(panels), 1.3 + 0.13 * num_requests))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    replicas_seen: set[int] = set()
    for ax, report in zip(axes, panels):
        rows = routing_rows(report, block_size)
        widest = max(total for _, _, total in rows)
        for y, (replica, hit, total) in enumerate(rows):
            color = replica_color(replica)
            replicas_seen.add(replica)
            ax.barh(y, hit, left=0, height=0.8, color=color, alpha=HIT_ALPHA, gid="hit-blocks")
            ax.barh(y, total - hit, left=hit, height=0.8, facecolor="white", edgecolor=color, hatch=COMPUTED_HATCH,
                    linewidth=0.6, gid="computed-blocks")
        for x in range(1, widest):
            ax.axvline(x, color="white", linewidth=0.5)
        ax.set_xlim(0, widest)
        ax.set_xticks(range(0, widest + 1))
        ax.set_xlabel("prompt blocks", fontsize=8)
        ax.set_title(f"{report.policy}: {report.hit_rate:.0%} of prompt tokens\nfrom the prefix cache", fontsize=9)
        ax.tick_params(labelsize=7)
    first = axes[0]
    first.set_ylim(num_requests - 0.5, -0.5)     # request 0 at the top
    if prefix_of is not None:
        first.set_yticks(range(num_requests), [f"S{k}" for k in prefix_of[:num_requests]], fontsize=6)
        first.set_ylabel("request (arrival order), its system prompt", fontsize=8)
    else:
        every = max(1, num_requests // 24)
        first.set_yticks(range(0, num_requests, every))
        first.set_ylabel("request (arrival order)", fontsize=8)
    handles = [Patch(color=replica_color(r), label=f"replica {r}") for r in sorted(replicas_seen)]
    handles += [Patch(facecolor="#777777", label="block from the cache"),
                Patch(facecolor="white", edgecolor="#777777", hatch=COMPUTED_HATCH, label="block computed")]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return fig
