"""The short causal convolution before a Gated DeltaNet layer's q, k, v (vLLM:
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``, ``causal_conv1d_fn`` and
``causal_conv1d_update``).

Each channel c mixes its last K inputs with its own K weights (depthwise, kernel K = 4
in Qwen3.5), then SiLU::

    y_t[c] = silu( sum_{i<K} w[c, i] * x_{t-K+1+i}[c] )

The **conv state** is the last K-1 inputs of the sequence so far, [channels, K-1]: with it
the next chunk (chunked prefill) or the next token (decode) continues as if the whole
sequence had been convolved at once. A new sequence starts from zeros. Layouts (one
sequence)::

    x       [T, channels]       weight  [channels, K]
    state   [channels, K-1]     returns (y [T, channels], the new state [channels, K-1])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None):
    """Convolve ``x`` after ``state`` (zeros if None); return y and the new state. One
    token (decode) and a whole prompt (prefill) are the same call."""
    channels, kernel = weight.shape
    if state is None:
        state = x.new_zeros(channels, kernel - 1)
    padded = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)           # [channels, K-1+T]
    y = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=channels)[0]   # [channels, T]
    new_state = padded[:, padded.shape[1] - (kernel - 1):].clone()
    return F.silu(y).transpose(0, 1), new_state
