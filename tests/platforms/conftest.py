"""Helpers for the CPU platform's tests."""

import pytest

from microvllm.platforms import get_platform
from microvllm.platforms.cpu import kernels


def needs_kernel(name: str):
    """A mark for tests of kernel library ``name``: skipped where the CPU (or the chosen
    ``MICROVLLM_CPU_ISA``) lacks its instructions, but a *failed build* is a failure, not
    a skip: a kernel that stops compiling (on AVX2, on arm64) must not pass unnoticed."""
    return pytest.mark.kernel(name)


@pytest.fixture(autouse=True)
def _kernels_marked(request):
    """Acts on ``needs_kernel`` marks (see there)."""
    for mark in request.node.iter_markers("kernel"):
        name = mark.args[0]
        try:
            kernels.load(name)
        except kernels.KernelUnavailable as error:
            if error.expected:
                pytest.skip(f"{name}: {error}")
            pytest.fail(f"the {name} kernel does not build here: {error}")


def on_cpu_platform(module, *, enforce_eager: bool = False):
    """``module`` with the CPU platform's versions of its ops bound, as the worker binds
    them after loading (``enforce_eager=True``: every op back on ``forward_native``)."""
    get_platform("cpu", enforce_eager=enforce_eager).process_weights_after_loading(module)
    return module


from tests.engine.conftest import tiny_models  # noqa: E402,F401  (the fixture, for test_cpu_engine.py)
