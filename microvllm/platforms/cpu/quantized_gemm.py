"""The CPU platform's GEMM for quantized ``Linear`` layers (placeholder)."""

from __future__ import annotations


def quantized_linear_version(linear):
    return None
