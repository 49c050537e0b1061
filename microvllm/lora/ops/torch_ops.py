"""The batched LoRA update in plain torch: each token gathers its own adapter's matrices
(vLLM: ``vllm/lora/ops/torch_ops/lora_ops.py``, Punica's BGMV: batched gather
matrix-vector)::

    x [T, in]      token_lora_indices [T]: the adapter slot of each token, -1: none
                   lora_a [max_loras, rank, in]     lora_b [max_loras, out, rank]
    shrink:  h[t] = scaling * lora_a[slot[t]] @ x[t]       h [T, rank]   (0 where slot is -1)
    expand:  y[t] += lora_b[slot[t]] @ h[t]                  y [T, out]   (a slice of y: a merged layer)

One gather and one batched matmul per op, whatever mix of adapters the batch holds: no
Python loop over tokens or adapters.
"""

from __future__ import annotations

import torch


def bgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    """``output_tensor[t] = scaling * lora_a_weights[idx[t]] @ inputs[t]`` (0 where idx is -1)::

        inputs [T, in]   lora_a_weights [max_loras, rank, in]   idx [T]   ->   output_tensor [T, rank]
    """
    ### BEGIN SOLUTION
    slots = lora_indices_tensor.clamp(min=0)                          # -1 would pick the last slot
    selected = lora_a_weights[slots].to(inputs.dtype)                # [T, rank, in]: each token's own A
    out = torch.bmm(selected, inputs.unsqueeze(-1)).squeeze(-1)        # [T, rank]
    output_tensor.copy_((out * scaling).masked_fill(lora_indices_tensor.unsqueeze(-1) < 0, 0))
    ### END SOLUTION


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    """``output_tensor[t, slice] (+)= lora_b_weights[idx[t]] @ inputs[t]``: with ``add_inputs``
    nothing is added where idx is -1; without, the slice is overwritten (zeros where idx is
    -1)::

        inputs [T, rank]   lora_b_weights [max_loras, slice_size, rank]   idx [T]
        output_tensor [T, out]: columns slice_offset .. slice_offset + slice_size - 1 are written
    """
    ### BEGIN SOLUTION
    slots = lora_indices_tensor.clamp(min=0)
    selected = lora_b_weights[slots].to(inputs.dtype)                 # [T, slice_size, rank]
    out = torch.bmm(selected, inputs.unsqueeze(-1)).squeeze(-1)        # [T, slice_size]
    out = out.masked_fill(lora_indices_tensor.unsqueeze(-1) < 0, 0).to(output_tensor.dtype)
    target = output_tensor[:, slice_offset:slice_offset + slice_size]   # a view: writes land in y
    if add_inputs:
        target += out
    else:
        target.copy_(out)
    ### END SOLUTION


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    """``bgmv_expand_slice`` over the whole of ``output_tensor``."""
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, output_tensor.shape[1],
                      add_inputs)
