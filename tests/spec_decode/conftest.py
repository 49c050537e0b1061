"""Fixtures shared with the engine tests."""

from tests.engine.conftest import tiny_models  # noqa: F401
