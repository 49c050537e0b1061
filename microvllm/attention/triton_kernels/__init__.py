"""Triton kernels for paged attention, and the check that Triton can run here.

Three kernels, each in its own file, in the order notebook 06 builds them:

    write_kv.py   store this step's keys/values into the paged cache (slot_mapping)
    decode.py     the teaching first step: one query token per request
    unified.py    the real thing: prefill chunks and decodes in one launch

On a CUDA GPU Triton compiles the kernels to machine code. On a CPU it can only
run them in its *interpreter* (numpy, one program at a time), which is switched on
by the environment variable ``TRITON_INTERPRET=1``. Triton reads that variable when
a ``@triton.jit`` function is defined, so it must be set before the kernel modules
(and, to be safe across Triton versions, triton itself) are imported.

Importing this package does not import triton. It does run
:func:`ensure_triton_can_run`, so that ``import microvllm.attention.triton_kernels.decode``
either works or fails with an error that says what to do.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from microvllm import envs

_HOW_TO_ENABLE = (
    "Set the environment variable TRITON_INTERPRET=1 before triton is first imported: "
    "in a notebook, make `import os; os.environ['TRITON_INTERPRET'] = '1'` the first "
    "cell and restart the kernel; in a shell, run `TRITON_INTERPRET=1 python ...`. "
    "Or choose attention_backend='torch'.")


def triton_unavailable_reason(*, triton_installed: bool, cuda_available: bool,
                              triton_imported: bool, interpreter_on: bool) -> str | None:
    """Why the Triton kernels cannot run, in words a learner can act on; None if they can.

    installed?  CUDA GPU?  TRITON_INTERPRET=1?  triton imported?   result
    no          -          -                    -                  error: install triton
    yes         yes        -                    -                  compiled GPU kernels
    yes         no         yes                  -                  CPU interpreter
    yes         no         no                   no                 None: the caller may
                                                                   switch the interpreter on
    yes         no         no                   yes                error: too late, restart
    """
    if not triton_installed:
        return ("The Triton attention backend needs the `triton` package, which is not "
                "installed: `pip install 'triton>=3.2,<3.8'` (Linux), or choose "
                "attention_backend='torch'.")
    if cuda_available or interpreter_on:
        return None
    if triton_imported:
        return ("The Triton attention backend cannot run here: there is no CUDA GPU, and "
                "triton was imported before Triton's CPU interpreter was switched on. "
                + _HOW_TO_ENABLE)
    return None


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_imported() -> bool:
    return "triton" in sys.modules


def _interpreter_on() -> bool:
    return envs.triton_interpret()


def ensure_triton_can_run() -> None:
    """Raise a RuntimeError that says what to change if the kernels cannot run.

    Friendly default for learners: on a machine without CUDA where nothing has
    imported triton yet, switch the interpreter on here (``TRITON_INTERPRET=1``) so
    the kernels just run, slowly, on the CPU."""
    cuda_available = torch.cuda.is_available()
    reason = triton_unavailable_reason(
        triton_installed=_triton_installed(), cuda_available=cuda_available,
        triton_imported=_triton_imported(), interpreter_on=_interpreter_on())
    if reason is not None:
        raise RuntimeError(reason)
    if not cuda_available and not _interpreter_on():
        os.environ["TRITON_INTERPRET"] = "1"


def is_interpreted(kernel) -> bool:
    """True if ``kernel`` (a ``@triton.jit`` function) runs in Triton's CPU interpreter:
    ``@triton.jit`` returns an ``InterpretedFunction`` when TRITON_INTERPRET=1 was set
    at the moment the kernel was defined."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_kernel_can_run(kernel) -> None:
    """Raise if ``kernel`` was compiled for a GPU but there is none (its module was
    imported before TRITON_INTERPRET=1 was set)."""
    if not torch.cuda.is_available() and not is_interpreted(kernel):
        raise RuntimeError(
            "The Triton attention kernels were loaded without Triton's CPU interpreter, "
            "and there is no CUDA GPU to compile them for. " + _HOW_TO_ENABLE)


ensure_triton_can_run()
