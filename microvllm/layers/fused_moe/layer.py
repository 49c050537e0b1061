"""``FusedMoE``: all of one layer's experts as two stacked weights, and the choice of
how to run them (vLLM: ``layers/fused_moe/layer.py``, same name and parameter names)::

    w13_weight [E_local, 2 * I_shard, H]    each expert's gate (rows 0..I) and up (I..2I)
    w2_weight  [E_local, H, I_shard]        each expert's down projection

    forward(hidden [T, H], router_logits [T, E]) -> [T, H]
        select_experts (router.py)           topk_weights, topk_ids [T, k]
        run the experts, one of three ways:
          "iterative"   (a) moe_torch_iterative.py   loop over experts
          "sorted"      (b) moe_sorted.py             sort pairs by expert, one matmul each
          "triton"      (c) fused_moe.py              all experts in one Triton kernel
        (default: "triton" on a GPU, "sorted" on a CPU; ``impl=`` or
        ``MICROVLLM_MOE_IMPL`` choose; chosen once, never in the forward)

Hugging Face checkpoints keep one tensor per expert and projection
(``experts.3.gate_proj.weight``); the loader hands each to ``weight_loader`` with a shard
id ``(3, "w1")`` ("w1" gate, "w3" up, "w2" down: Mixtral's names, which vLLM uses for all),
and it lands in expert 3's slice of the stacked weight.

Across N ranks, two ways to split (vLLM's ``enable_expert_parallel``)::

    tensor parallel (default)       every rank holds all E experts, each cut to I/N
                                    columns (like LlamaMLP); partial sums, all-reduced
    expert parallel                 rank r holds E/N whole experts; tokens are sent to
                                    them and back (expert_parallel.py)

``expert_map`` (vLLM's name) turns a global expert id into this rank's local index, or -1
for an expert another rank holds.

It also counts, per expert, how many (token, expert) pairs it routed (``expert_load``):
the model runner reads and clears the counts after each step, for the step trace and
``LLM.get_metrics()``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from microvllm import envs
from microvllm.distributed import get_ep_group, get_tp_group, tensor_model_parallel_all_reduce
from microvllm.layers.custom_op import CustomOp
from microvllm.layers.fused_moe.expert_parallel import dispatch_combine
from microvllm.layers.fused_moe.moe_sorted import fused_moe_sorted
from microvllm.layers.fused_moe.moe_torch_iterative import fused_moe_iterative
from microvllm.layers.fused_moe.router import select_experts
from microvllm.layers.linear import check_shape, divide


def _fused_experts_triton(*args):
    from microvllm.layers.fused_moe.fused_moe import fused_experts  # imports triton
    return fused_experts(*args)


# impl name -> f(hidden, w13, w2, topk_weights, local topk_ids) -> out, all with one signature
EXPERT_FUNCTIONS = {"iterative": fused_moe_iterative, "sorted": fused_moe_sorted,
                    "triton": _fused_experts_triton}
MOE_IMPLS = tuple(EXPERT_FUNCTIONS)


def check_moe_impl(impl: str | None) -> str | None:
    if impl is not None and impl not in MOE_IMPLS:
        raise ValueError(f"MoE implementation {impl!r} is not one of {', '.join(MOE_IMPLS)}")
    return impl


class FusedMoE(CustomOp):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, impl: str | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.global_num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        # How the experts run: impl=, else $MICROVLLM_MOE_IMPL, read once, here; None: the device's default.
        self.requested_impl = check_moe_impl(impl) or check_moe_impl(envs.moe_impl())
        self.ep_group = get_ep_group()
        if self.ep_group.world_size > 1:      # whole experts, split over the ranks
            self.num_local_experts = divide(num_experts, self.ep_group.world_size, "num_experts")
            self.first_expert = self.ep_group.rank_in_group * self.num_local_experts
            self.tp_size, self.tp_rank = 1, 0
        else:                                 # every expert, each one's columns split
            self.num_local_experts, self.first_expert = num_experts, 0
            self.tp_size = get_tp_group().world_size
            self.tp_rank = get_tp_group().rank_in_group
        self.intermediate_per_partition = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        local, shard = self.num_local_experts, self.intermediate_per_partition
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * shard, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, shard))
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
        self.expert_load: torch.Tensor | None = None   # [E] pairs routed since the last read
        # For the device the weights are made on; load_model, which makes them on "meta", asks again.
        self.choose_impl()

    # ------------------------------------------------------------------ loading
    def expert_map(self) -> torch.Tensor:
        """``[E]``: global expert id -> this rank's local index, or -1 (held elsewhere)."""
        ids = torch.arange(self.global_num_experts) - self.first_expert
        return torch.where((ids >= 0) & (ids < self.num_local_experts), ids, -1)

    def checkpoint_shards(self, param_name: str) -> set:
        """The shard ids the loader must fill ``param_name`` with: every expert's."""
        kinds = ("w1", "w3") if param_name == "w13_weight" else ("w2",)
        return {(e, kind) for e in range(self.global_num_experts) for kind in kinds}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id) -> None:
        """Copy one expert's checkpoint matrix into its place; an expert another rank
        holds is skipped (every rank reads every tensor, keeps its own)."""
        expert, kind = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        shard, rank = self.intermediate_per_partition, self.tp_rank
        if kind in ("w1", "w3"):   # [I, H]: this rank's rows, into the gate or the up half
            check_shape(loaded_weight, (self.intermediate_size, self.hidden_size))
            half = 0 if kind == "w1" else shard
            param.data[local, half:half + shard].copy_(loaded_weight[rank * shard:(rank + 1) * shard])
        else:                      # w2 [H, I]: this rank's columns
            check_shape(loaded_weight, (self.hidden_size, self.intermediate_size))
            param.data[local].copy_(loaded_weight[:, rank * shard:(rank + 1) * shard])

    # ------------------------------------------------------------------ forward
    def run_experts(self, hidden, topk_weights, local_ids) -> torch.Tensor:
        """This rank's experts on ``hidden`` (``local_ids`` -1: not here, contributes 0), run
        the way ``choose_impl`` chose: nothing is decided here, on every layer's every step."""
        run = EXPERT_FUNCTIONS[self.impl]
        return run(hidden, self.w13_weight, self.w2_weight, topk_weights, local_ids)

    def forward_native(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        self._count(topk_ids)
        if self.ep_group.world_size > 1:
            return dispatch_combine(hidden, topk_weights, topk_ids, self.num_local_experts,
                                    self.run_experts, self.ep_group)
        out = self.run_experts(hidden, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    def _count(self, topk_ids: torch.Tensor) -> None:
        flat = topk_ids.flatten()
        if self.expert_load is None:
            self.expert_load = torch.zeros(self.global_num_experts, dtype=torch.long, device=flat.device)
        self.expert_load.index_add_(0, flat, torch.ones_like(flat))

    def choose_impl(self) -> None:
        """Settle ``self.impl``, how the experts run, once the weights are on their device:
        ``impl=``, else ``$MICROVLLM_MOE_IMPL`` (both read when the layer was built), else the
        device's default, the Triton kernel on a GPU and the sorted experts elsewhere (vLLM
        chooses its fused-MoE kernel once too, when the layer is built on its platform)."""
        self.impl = self.requested_impl or ("triton" if self.w13_weight.device.type == "cuda" else "sorted")

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.global_num_experts} (first {self.first_expert}), "
                f"top_k={self.top_k}, hidden={self.hidden_size}, intermediate={self.intermediate_per_partition}"
                f"/{self.intermediate_size}, renormalize={self.renormalize}")


# ---------------------------------------------------------------------- checkpoints
# Hugging Face names of one expert's matrices -> vLLM's shard names.
EXPERT_CHECKPOINT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",   # Qwen3-MoE, OLMoE
                           "w1": "w1", "w3": "w3", "w2": "w2"}                       # Mixtral
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def expert_param_name(name: str) -> tuple[str, tuple[int, str]] | None:
    """``layers.1.mlp.experts.3.gate_proj.weight`` -> (``layers.1.mlp.experts.w13_weight``,
    ``(3, "w1")``); None for a name that is not one expert's matrix."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in EXPERT_CHECKPOINT_NAMES:
        return None
    kind = EXPERT_CHECKPOINT_NAMES[match["proj"]]
    param = "w2_weight" if kind == "w2" else "w13_weight"
    return f"{match['prefix']}.{param}", (int(match["expert"]), kind)


def moe_layers(model: nn.Module) -> dict[str, FusedMoE]:
    """The model's ``FusedMoE`` layers by decoder layer index (a string, as in the JSON
    trace): ``{"1": layers.1.mlp.experts, ...}``; empty for a dense model (or a stand-in
    that is no ``nn.Module``, as the course's fakes are)."""
    if not isinstance(model, nn.Module):
        return {}
    return {_layer_index(name): module for name, module in model.named_modules()
            if isinstance(module, FusedMoE)}


def take_expert_load(layers: dict[str, FusedMoE]) -> dict[str, list[int]]:
    """``{layer: pairs routed to each expert}`` since the last call (then forgotten: the
    next forward starts a fresh count). The layers' counts reach the host in one copy (one
    wait for a GPU per step, not one per layer)."""
    counted = {index: module for index, module in layers.items() if module.expert_load is not None}
    rows = torch.stack([m.expert_load for m in counted.values()]).tolist() if counted else []
    for module in counted.values():
        module.expert_load = None
    loads = dict(zip(counted, rows))
    return {index: loads.get(index, [0] * module.global_num_experts) for index, module in layers.items()}


def _layer_index(module_name: str) -> str:
    """``layers.5.mlp.experts`` -> ``"5"`` (the module's name if it is not in ``layers``)."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", module_name)
    return match[1] if match else module_name
