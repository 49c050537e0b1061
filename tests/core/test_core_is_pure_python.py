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


def test_core_imports_nothing_from_distributed():
    """The KV connectors live above core; the scheduler sees one only through
    ``core/kv_connector_protocol.py``. Type-only imports count too: a type is a dependency
    a reader must follow."""
    core_dir = Path(microvllm.core.__file__).parent
    offenders = []
    for path in sorted(core_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}:{node.lineno}: import {n}" for n in names
                          if n.startswith("microvllm.distributed")]
    assert not offenders, ("microvllm/core must not import from microvllm.distributed: name what it "
                           f"needs in core/kv_connector_protocol.py instead: {offenders}")
