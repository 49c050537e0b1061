"""Helpers for the CPU platform's tests."""

from microvllm.platforms import get_platform


def on_cpu_platform(module, *, enforce_eager: bool = False):
    """``module`` with the CPU platform's versions of its ops bound, as the worker binds
    them after loading (``enforce_eager=True``: every op back on ``forward_native``)."""
    get_platform("cpu", enforce_eager=enforce_eager).process_weights_after_loading(module)
    return module


from tests.engine.conftest import tiny_models  # noqa: E402,F401  (the fixture, for test_cpu_engine.py)
