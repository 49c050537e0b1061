"""``CustomOp``: a layer with a plain torch version and, maybe, a platform's faster one.

    forward_native   plain torch: the math, as the notebooks show it and as
                     ``LLM(enforce_eager=True)`` runs it
    forward          calls whichever version was chosen, once, for this module

Nothing is decided inside ``forward``: after the weights are loaded the platform
(``platforms/``) looks at each ``CustomOp`` and, where it has a faster version of the
same math for it (a C++ kernel on a CPU), hands it over with ``use``. Until then, and
for good with ``enforce_eager=True``, ``forward`` is ``forward_native``::

    RMSNorm.forward(x) ──> self._forward_method(x)
                              ├── forward_native          (default; enforce_eager=True)
                              └── the platform's version  (chosen once, after loading)

vLLM's ``CustomOp`` (``vllm/model_executor/custom_op.py``) does the same, choosing among
``forward_native``, ``forward_cuda``, ``forward_cpu``, ... when the layer is built, from a
global "current platform". microvllm keeps no global state, so the platform binds its
versions explicitly, once the model is loaded.
"""

from __future__ import annotations

from typing import Callable

from torch import nn


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self._forward_method: Callable = self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        """The plain torch version: every subclass writes it."""
        raise NotImplementedError(f"{type(self).__name__} must define forward_native")

    def use(self, implementation: Callable | None) -> None:
        """Run ``implementation`` (same arguments and results as ``forward_native``) from
        now on; None goes back to ``forward_native``."""
        self._forward_method = implementation if implementation is not None else self.forward_native

    @property
    def forward_method(self) -> Callable:
        """The version ``forward`` runs: ``forward_native``, or what the platform bound with
        ``use`` (the CPU's decode fast path reads the packed weights from it)."""
        return self._forward_method

    @property
    def implementation(self) -> str:
        """Which version ``forward`` runs: ``"native"`` or the platform version's name."""
        method = self._forward_method
        if getattr(method, "__self__", None) is self and getattr(method, "__name__", "") == "forward_native":
            return "native"
        method = getattr(method, "func", method)   # a functools.partial(version, self)
        return getattr(method, "__name__", type(method).__name__)
