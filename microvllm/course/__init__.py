"""Helpers for the course notebooks: show the package's own code (code exists once)."""

from microvllm.course.show import show_source

__all__ = ["show_source"]
