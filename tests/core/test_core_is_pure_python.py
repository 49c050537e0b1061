"""core/ decides, it never computes: no torch (or numpy) import anywhere in it."""

import ast
from pathlib import Path

import microvllm.core

FORBIDDEN = {"torch", "numpy", "triton"}


def test_no_tensor_library_imports_in_core():
    core_dir = Path(microvllm.core.__file__).parent
    offenders = []
    for path in sorted(core_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: import {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, f"microvllm/core must stay pure Python: {offenders}"
