"""The exercise notebooks' text: contract, hints, checks, engine cell; their code comes
from the package (see ``microvllm/course/build.py``). One module per exercise, in the
order of the lectures they follow.

``EXERCISES`` imports them all, when first asked for (``from microvllm.course.specs
import EXERCISES``). Each module imports the code it cuts, so ``decode_kernel`` needs
Triton; ``exercise_specs(skip_unavailable=True)`` leaves out those that cannot be
imported here (a Mac without Triton can still show every other lecture's code).
"""

from __future__ import annotations

import importlib

NAMES = ("detokenizer", "block_pool", "prefix_cache", "scheduler", "decode_kernel", "sampler", "model_runner",
         "rejection_sampler", "token_mask", "q4_1_blocks", "moe_align",
         "gated_delta_step", "kv_connector", "prefix_router", "hermes_parser", "lora_batch")


def exercise_specs(*, skip_unavailable: bool = False) -> list:
    exercises = []
    for name in NAMES:
        try:
            exercises.append(importlib.import_module(f"{__name__}.{name}").EXERCISE)
        except (ImportError, RuntimeError):   # RuntimeError: ensure_triton_can_run says why not
            if not skip_unavailable:
                raise
    return exercises


def __getattr__(name: str):
    if name == "EXERCISES":
        return exercise_specs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
