"""Where a mixture-of-experts layer sent its tokens, step by step.

    plot_expert_load(trace, layer="1", step=3)

                 engine step →                       share of all pairs
      expert 0   ░░▓░░░░░░░░ ...                     ████ |
      expert 1   ██▒░▒░░▒░░░ ...                     ██████|██      <- busiest
      ...                                                  |
      expert E-1 ▒░░░░▒░░░░░ ...                     ██   |
                 ^ cursor (the selected step)              1/E (ideal)

Each cell is the number of (token, expert) pairs the layer's router sent to that expert
in that step (``StepTrace.expert_load[layer]``; a step computes ``top_k`` pairs per
token, so a column sums to ``top_k`` x the step's tokens). The colour scale is a square
root, as on the timeline: a prefill step routes hundreds of pairs, a decode step a few,
and on a linear scale the decode columns would all look empty. The side panel adds up
the run: each expert's share of all pairs, against the ideal 1/E of a perfectly
balanced router. The title gives the imbalance, the busiest expert's pairs over the
mean expert's, over the whole run.

Why it matters: with expert parallelism (``layers/fused_moe/layer.py``: rank r holds
experts ``r*E/N .. (r+1)*E/N - 1``) every rank waits for the slowest one, so a step
costs what its busiest rank costs. ``expert_parallel_imbalance(trace, layer, N)`` gives,
per step, the busiest rank's pairs over the mean rank's: 1.0 is perfect balance; 2.0
means that step ran at half the speed a balanced router would allow.

Gids: image ``expert-load`` (the counts, experts x steps), rectangle ``cursor``, bars
``expert-share`` (one per expert), line ``ideal-share``.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import PowerNorm

from microvllm.trace import Trace
from microvllm.viz import colors
from microvllm.viz.canvas import new_figure

SHARE_COLOR = "#1f77b4"


def moe_layers_of(trace: Trace) -> list[str]:
    """The MoE layers the trace counted, by decoder layer index ("1", "3", ...)."""
    names = {name for s in trace for name in s.expert_load}
    return sorted(names, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n))


def _resolve_layer(trace: Trace, layer: str | int | None) -> str:
    layers = moe_layers_of(trace)
    if not layers:
        raise ValueError("the trace has no expert counts: no step has an expert_load (a dense model, "
                         "or a run without trace=True); record a mixture-of-experts model such as "
                         "make_tiny_model(folder, 'qwen3_moe') with LLM(..., trace=True)")
    if layer is None:
        return layers[0]
    if str(layer) not in layers:
        raise ValueError(f"layer {layer!r} is not a MoE layer of this trace: its MoE layers are "
                         f"{', '.join(layers)} (decoder layer indices)")
    return str(layer)


def expert_counts(trace: Trace, layer: str | int | None = None) -> tuple[str, np.ndarray]:
    """``(layer, counts)``: ``counts[e, i]`` = pairs sent to expert ``e`` in step *index*
    ``i`` (0 in a step that did not count this layer). Default layer: the first MoE layer."""
    layer = _resolve_layer(trace, layer)
    num_experts = max(len(s.expert_load[layer]) for s in trace if layer in s.expert_load)
    counts = np.zeros((num_experts, len(trace)), dtype=np.int64)
    for i, s in enumerate(trace):
        load = s.expert_load.get(layer)
        if load:
            counts[:len(load), i] = load
    return layer, counts


def expert_parallel_imbalance(trace: Trace, layer: str | int | None, num_ranks: int) -> list[float]:
    """Per step: the busiest rank's (token, expert) pairs / the mean rank's, with the
    layer's E experts split contiguously over ``num_ranks`` ranks as ``FusedMoE`` does
    (rank r: experts ``r*E/N .. (r+1)*E/N - 1``). 1.0 = balanced (also a step that routed
    nothing); ``num_ranks`` = the step's pairs all on one rank."""
    layer, counts = expert_counts(trace, layer)
    num_experts = counts.shape[0]
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_ranks={num_ranks} must divide the layer's {num_experts} experts "
                         "(expert parallelism gives each rank the same number of whole experts)")
    per_rank = counts.reshape(num_ranks, num_experts // num_ranks, -1).sum(axis=1)   # [N, steps]
    mean = per_rank.mean(axis=0)
    busiest = per_rank.max(axis=0)
    return [float(b / m) if m > 0 else 1.0 for b, m in zip(busiest, mean)]


def plot_expert_load(trace: Trace, layer: str | int | None = None, step: int | None = None):
    """Heat map of one MoE layer's expert counts, experts x steps (default: the first MoE
    layer), a cursor on step *index* ``step`` if given, and each expert's share of the run."""
    layer, counts = expert_counts(trace, layer)
    num_experts, num_steps = counts.shape
    if step is not None and not -num_steps <= step < num_steps:
        raise ValueError(f"step {step} is out of range: the trace has {num_steps} steps (0..{num_steps - 1})")
    totals = counts.sum(axis=1)
    whole = int(totals.sum())
    shares = totals / whole if whole else np.zeros(num_experts)
    imbalance = totals.max() / totals.mean() if whole else 1.0

    fig = new_figure((12, 0.9 + 0.22 * max(num_experts, 8)))
    grid = fig.add_gridspec(1, 2, width_ratios=(5, 1))
    heat, side = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    image = heat.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis",
                        norm=PowerNorm(0.5, vmin=0, vmax=max(int(counts.max()), 1)),
                        extent=(-0.5, num_steps - 0.5, num_experts - 0.5, -0.5))
    image.set_gid("expert-load")
    colorbar = fig.colorbar(image, ax=heat, pad=0.01, fraction=0.04)
    colorbar.set_label("(token, expert) pairs (√ scale)", fontsize=8)
    colorbar.ax.tick_params(labelsize=7)
    cursor = step % num_steps if step is not None else 0
    heat.add_patch(_column_outline(cursor, num_experts, visible=step is not None))
    step_numbers = [s.step for s in trace]
    ticks = _step_ticks(num_steps)
    heat.set_xticks(ticks, [str(step_numbers[i]) for i in ticks])
    heat.set_yticks(_expert_ticks(num_experts))
    heat.set_xlabel("engine step", fontsize=8)
    heat.set_ylabel("expert", fontsize=8)
    heat.tick_params(labelsize=7)

    bar_colors = [colors.PREEMPT_COLOR if whole and t == totals.max() else SHARE_COLOR for t in totals]
    bars = side.barh(np.arange(num_experts), shares, height=0.8, color=bar_colors)
    for bar in bars:
        bar.set_gid("expert-share")
    side.axvline(1 / num_experts, color="black", linestyle="--", linewidth=1, gid="ideal-share")
    side.set_ylim(num_experts - 0.5, -0.5)          # expert 0 at the top, as in the heat map
    side.set_yticks(_expert_ticks(num_experts))
    side.set_xlim(0, max(float(shares.max()), 1 / num_experts) * 1.15)
    side.set_xlabel(f"share of the run (1/{num_experts} dashed)", fontsize=8)
    side.tick_params(labelsize=7)
    side.xaxis.set_major_formatter(lambda x, _: f"{x:.0%}")
    fig.suptitle(f"Layer {layer}: {num_experts} experts x {num_steps} steps, {whole:,} (token, expert) pairs · "
                 f"imbalance (busiest expert / mean) {imbalance:.2f} over the run (red bar: busiest)",
                 fontsize=9)
    return fig


def _column_outline(index: int, num_experts: int, visible: bool):
    from matplotlib.patches import Rectangle

    return Rectangle((index - 0.5, -0.5), 1, num_experts, fill=False, edgecolor=colors.PREEMPT_COLOR,
                     linewidth=2, visible=visible, gid="cursor", clip_on=False)


def _step_ticks(num_steps: int) -> list[int]:
    every = max(1, int(np.ceil(num_steps / 20)))
    return list(range(0, num_steps, every))


def _expert_ticks(num_experts: int) -> list[int]:
    every = 1 if num_experts <= 16 else max(1, num_experts // 16)
    return list(range(0, num_experts, every))
