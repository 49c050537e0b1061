"""The step's token -> adapter-slot mapping, and the batched LoRA update that reads it
(vLLM: ``vllm/lora/punica_wrapper/``: ``PunicaWrapperBase``, ``PunicaWrapperCPU``).

The model runner says, per step, which adapter each token runs with (``LoRAMapping``:
vLLM's ``lora_int_id`` per token, 0 for none); the manager knows which device slot holds
which adapter. ``update_metadata`` turns the one into the other, once per step, for every
wrapped layer to read::

    tokens              a0 a1 a2 | b0 | c0 c1      (requests a: adapter 7, b: none, c: adapter 3)
    index_mapping        7  7  7 |  0 |  3  3      lora_int_id per token
    lora_index_to_id    [3, 7, None]               slot -> adapter id (max_loras slots)
    token_lora_indices   1  1  1 | -1 |  0  0      slot per token, -1: no adapter

``add_lora_linear`` then adds, for each output slice of a layer (q, k, v; gate, up), the
shrink (``x @ A.T``, to the rank) and the expand (``@ B.T``, to the slice) in one batched
gather each (``ops/torch_ops.py``), whatever mix of adapters the step holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from microvllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink


@dataclass(frozen=True)
class LoRAMapping:
    """One step's adapters (vLLM: ``LoRAMapping``): ``index_mapping`` one ``lora_int_id``
    per token of the step (0: the base model); ``prompt_mapping`` one per row of logits
    (kept for a LoRA on the LM head, which is not served here)."""

    index_mapping: tuple[int, ...]
    prompt_mapping: tuple[int, ...] = ()
    is_prefill: bool = False


class PunicaWrapperBase:
    """Holds the step's ``token_lora_indices`` (slot per token, -1: none); the subclass does
    the arithmetic."""

    def __init__(self, max_num_batched_tokens: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._token_lora_indices = torch.full((max_num_batched_tokens,), -1, dtype=torch.long, device=self.device)
        self.num_tokens: int | None = None   # None: no mapping set (the base model alone)

    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id: list[int | None]) -> None:
        """This step's slot per token, from its ``lora_int_id`` per token."""
        num_tokens = len(mapping.index_mapping)
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"a step of {num_tokens} tokens is above max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        slot_of = {lora_id: slot for slot, lora_id in enumerate(lora_index_to_id) if lora_id is not None}
        missing = {i for i in mapping.index_mapping if i > 0 and i not in slot_of}
        if missing:
            raise RuntimeError(f"adapters {sorted(missing)} are scheduled but hold no slot: activate them first")
        slots = [slot_of[i] if i > 0 else -1 for i in mapping.index_mapping]
        self._token_lora_indices[:num_tokens].copy_(torch.tensor(slots, dtype=torch.long))
        self.num_tokens = num_tokens

    def clear(self) -> None:
        """No adapter for anything until the next ``update_metadata``."""
        self.num_tokens = None

    @property
    def token_lora_indices(self) -> torch.Tensor:
        assert self.num_tokens is not None
        return self._token_lora_indices[:self.num_tokens]

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], output_slices: tuple[int, ...]) -> None:
        raise NotImplementedError


class PunicaWrapperCPU(PunicaWrapperBase):
    """The torch reference (``ops/torch_ops.py``): runs anywhere, a gather per op."""

    def add_shrink(self, h: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor) -> None:
        bgmv_shrink(x, lora_a, h, self.token_lora_indices)

    def add_expand(self, y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, offset: int) -> None:
        bgmv_expand_slice(h, lora_b, y, self.token_lora_indices, offset, lora_b.shape[1])

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], output_slices: tuple[int, ...]) -> None:
        """``y [T, sum(output_slices)] += B_slot(t) @ A_slot(t) @ x[t]`` for each slice, in place
        (the scaling is already in B: ``layers.py``). Nothing when no mapping is set."""
        if self.num_tokens is None:
            return
        if x.shape[0] != self.num_tokens:
            raise RuntimeError(f"the LoRA mapping is for {self.num_tokens} tokens but the layer got "
                               f"{x.shape[0]}: set_active_adapters(..., mapping) must run before each forward")
        offset = 0
        for lora_a, lora_b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
            h = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
            self.add_shrink(h, x, lora_a)
            self.add_expand(y, h, lora_b, offset)
            offset += size
