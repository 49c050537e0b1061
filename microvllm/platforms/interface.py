"""``Platform``: the one place that knows the hardware (vLLM: ``vllm/platforms/interface.py``).

The engine picks a platform once (``get_platform``) and asks it four things; the model,
its layers and the sampler are plain, device-agnostic torch and never ask::

    device                           where weights, KV cache and inputs live
    default_dtype                    what dtype="auto" becomes
    default_attention_backend()      what attention_backend="auto" becomes
    process_weights_after_loading()  hand each CustomOp the platform's version, once
    decode_step_runner(model)        what runs a decode-only step instead of the model
                                     (a CPU fast path; CUDA graphs on a GPU), or None

``enforce_eager=True`` makes every answer the plain one: ``forward_native`` everywhere,
no decode-step runner, and an attention backend written in torch.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from microvllm.layers.custom_op import CustomOp

logger = logging.getLogger(__name__)


class Platform:
    name = "generic"
    device = torch.device("cpu")
    default_dtype = "float32"
    """What ``dtype="auto"`` becomes here."""

    def __init__(self, enforce_eager: bool = False):
        self.enforce_eager = enforce_eager

    def default_attention_backend(self) -> str:
        """The backend ``attention_backend="auto"`` runs here."""
        return "torch"

    def check_attention_backend(self, name: str) -> None:
        """Raise, saying what to change, if backend ``name`` cannot run here."""

    def resolve_attention_backend(self, name: str) -> str:
        """``"auto"`` -> this platform's default; any other name is checked and returned."""
        if name == "auto":
            return self.default_attention_backend()
        self.check_attention_backend(name)
        return name

    def resolve_dtype(self, dtype: str) -> str:
        """``"auto"`` -> this platform's ``default_dtype``; any other name is returned."""
        return self.default_dtype if dtype == "auto" else dtype

    def op_version(self, op: CustomOp) -> Callable | None:
        """This platform's version of ``op`` (same arguments and results as its
        ``forward_native``), or None to run ``forward_native``."""
        return None

    def process_weights_after_loading(self, module: nn.Module) -> None:
        """Give every ``CustomOp`` in ``module`` this platform's version of it (with
        ``enforce_eager``, none: each runs ``forward_native``). Called once the weights are
        loaded and cast, since a version may depend on them (packed weights, the dtype)."""
        chosen: dict[str, int] = {}
        for op in module.modules():
            if isinstance(op, CustomOp):
                op.use(None if self.enforce_eager else self.op_version(op))
                chosen[op.implementation] = chosen.get(op.implementation, 0) + 1
        if chosen:
            logger.debug("%s platform: ops run %s", self.name, chosen)

    def decode_step_runner(self, model: nn.Module, *, max_num_seqs: int = 1,
                           max_model_len: int | None = None) -> Callable | None:
        """What runs a decode-only step in the model's place (same arguments and result as
        ``model.forward``, with an ``applies(num_tokens, attn_metadata)`` test), or None.
        ``max_num_seqs``, ``max_model_len``: the largest decode batch and sequence it will see."""
        return None

    def describe(self) -> str:
        return f"{self.name}{' (enforce_eager: the plain torch code)' if self.enforce_eager else ''}"
