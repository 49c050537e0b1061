"""Rotary position embedding (RoPE), "rotate half" convention as in Llama.

Each pair of channels ``(i, i + head_dim/2)`` of a query or key at position ``p`` is
rotated by the angle ``p * inv_freq[i]``::

    x1, x2 = x[..., :d/2], x[..., d/2:]
    out    = cat(x1*cos - x2*sin,  x2*cos + x1*sin)

Because the model runner passes explicit ``positions`` (not "0..T-1"), a decode
token of a long request and a prefill chunk of a new one can share one batch.
The cos/sin table is computed once for every position up to ``max_position``.
"""

from __future__ import annotations

import torch
from torch import nn

from microvllm.layers.custom_op import CustomOp


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``inv_freq[i] = 1 / theta**(2i/d)`` for plain RoPE; scaled variants (llama3,
    linear, yarn, ...) are computed by transformers' own table of rope functions so
    that they match it exactly. Returns (inv_freq, attention_scaling)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        # device="cpu": under the loader's torch.device("meta") this would run torch's slow meta kernels
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (theta ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} in config.json is not supported; "
                         f"supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__()
        self.config, self.head_dim, self.max_position = config, head_dim, max_position
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_table()

    def build_table(self, device=None) -> None:
        """(Re)compute the ``[max_position, head_dim/2]`` cos/sin tables in float32; they
        are cast with the model, as Hugging Face casts them to the query's dtype. The
        loader calls this again after materialising a model built on the meta device
        (buffers are not in the checkpoint)."""
        inv_freq, scaling = inverse_frequencies(self.config, self.head_dim)
        angles = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device="cpu"), inv_freq)
        self.cos = (angles.cos() * scaling).to(device)
        self.sin = (angles.sin() * scaling).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, d/2]`` for these positions. Every layer of a step rotates by
        the same angles, so the model looks them up once per step and passes them down."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """Rotate ``query [T, num_heads, d]`` and ``key [T, num_kv_heads, d]`` at these
        positions (for one-off use: the model looks ``cos_sin`` up once per step)."""
        cos, sin = self.cos_sin(positions)
        return rotate(query, cos, sin), rotate(key, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of ``x [T, heads, d]`` by the angles of its token (``cos, sin
    [T, 1, d/2]``): channel pair ``(i, i + d/2)`` turns by ``position * inv_freq[i]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class ApplyRotaryEmb(CustomOp):
    """``rotate`` as a layer. Heads are independent, so one call can rotate a token's
    query and key heads together. A ``CustomOp``: a platform may do it in one pass (the
    CPU platform's kernel rounds where ``rotate`` rounds)."""

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(x, cos, sin)
