"""One decoder layer's data flow, with the shapes of a real model (notebook 02).

    residual ─────────────┬─────────────────────────────────────────────┬──────> residual
    hidden ─> RMSNorm (+) ┴> qkv_proj ─> RoPE ─> attention ─> o_proj ─> RMSNorm (+) ┴>
              gate_up ─> SiLU·mul ─> down_proj ─> hidden

drawn top to bottom: one box per module, the tensor that leaves it written beside the arrow
(``[T, ...]``: T tokens of this step, whatever requests they belong to), and the residual
stream as the line on the left that each norm adds into. The shapes are read from the
model's own modules, so a Qwen3 or a SmolLM2 draws its own numbers.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from microvllm.viz.canvas import figure_and_axes


def decoder_layer_steps(model, num_tokens: str = "T") -> list[tuple[str, str, str]]:
    """(module, what it does, the shape of what leaves it), in order, for ``model.layers[0]``."""
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    hidden = attn.qkv_proj.in_features
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    intermediate = mlp.down_proj.in_features
    t = num_tokens
    return [
        ("input_layernorm", "RMSNorm; first adds the last branch into residual", f"[{t}, {hidden}]"),
        ("qkv_proj", "one matmul: queries, keys and values side by side",
         f"[{t}, ({heads} + {kv_heads} + {kv_heads}) x {d} = {(heads + 2 * kv_heads) * d}]"),
        ("rotary_emb", "rotate q and k by their positions", f"q [{t}, {heads}, {d}], k, v [{t}, {kv_heads}, {d}]"),
        ("attn", f"paged attention (notebook 06): {heads // kv_heads} query heads share each KV head; "
                 "k, v written to the KV cache first", f"[{t}, {heads} x {d} = {heads * d}]"),
        ("o_proj", "mix the heads back", f"[{t}, {hidden}]"),
        ("post_attention_layernorm", "RMSNorm; first adds attention's output into residual", f"[{t}, {hidden}]"),
        ("gate_up_proj", "one matmul: gate and up side by side", f"[{t}, 2 x {intermediate} = {2 * intermediate}]"),
        ("act_fn", "SiluAndMul: silu(gate) * up", f"[{t}, {intermediate}]"),
        ("down_proj", "back to the hidden size", f"[{t}, {hidden}]"),
    ]


def plot_decoder_layer(model, num_tokens: str = "T") -> Figure:
    """The data flow of ``model.layers[0]`` (every layer is the same) with its shapes."""
    steps = decoder_layer_steps(model, num_tokens)
    fig, ax = figure_and_axes(None, (11, 0.62 * (len(steps) + 2)))
    n = len(steps)
    top = n + 1
    ax.set_xlim(0, 11)
    ax.set_ylim(-0.8, top + 0.6)
    ax.axis("off")
    hidden = steps[0][2]
    ax.text(3.0, top, f"hidden {hidden}  (and residual {hidden}) from the previous layer",
            ha="center", va="center", fontsize=9)
    branch_colors = {"attn": "#dbe8f5", "mlp": "#f7e3cf", "norm": "#e8e8e8"}
    for i, (name, what, shape) in enumerate(steps):
        y = n - i
        kind = "norm" if "layernorm" in name else ("mlp" if i > 5 else "attn")
        ax.add_patch(FancyBboxPatch((1.6, y - 0.27), 2.8, 0.54, boxstyle="round,pad=0.02",
                                    facecolor=branch_colors[kind], edgecolor="#555555", linewidth=0.8,
                                    gid=f"decoder-layer-{name}"))
        ax.text(3.0, y, name, ha="center", va="center", fontsize=9, family="monospace")
        ax.text(4.65, y + 0.1, shape, ha="left", va="center", fontsize=9, family="monospace")
        ax.text(4.65, y - 0.17, what, ha="left", va="center", fontsize=7.5, color="#555555")
        ax.add_patch(FancyArrowPatch((3.0, y + 0.73), (3.0, y + 0.29), arrowstyle="-|>", mutation_scale=9,
                                     color="#333333", linewidth=0.8))
    ax.add_patch(FancyArrowPatch((3.0, 0.73), (3.0, 0.27), arrowstyle="-|>", mutation_scale=9,
                                 color="#333333", linewidth=0.8))
    ax.text(1.6, -0.1, f"hidden {hidden}, residual {hidden} to the next layer (after the last one: the final "
                       "norm, then compute_logits)", ha="left", va="center", fontsize=9)
    # The residual stream: beside the branch, joined in by the two norms.
    norms = [n - i for i, (name, _, _) in enumerate(steps) if "layernorm" in name]
    ax.plot([0.7, 0.7], [top - 0.3, 0.45], color="#999999", linewidth=2, gid="decoder-layer-residual")
    for y in norms:
        ax.add_patch(FancyArrowPatch((0.7, y), (1.6, y), arrowstyle="<|-|>", mutation_scale=8,
                                     color="#999999", linewidth=1.2))
    ax.text(0.55, (top + 0.3) / 2, "residual stream", rotation=90, ha="center", va="center", fontsize=8,
            color="#777777")
    ax.set_title(f"One decoder layer, {num_tokens} tokens of a step (attention branch blue, MLP branch orange)",
                 fontsize=10)
    return fig
