"""core/ decides, it never computes: no torch (or numpy) import anywhere in it."""

import ast
from pathlib import Path

import microvllm.core

FORBIDDEN = {"torch", "numpy", "triton"}


def core_imports() -> list[tuple[str, int, str]]:
    """(file, line, module) of every import in core/, ``TYPE_CHECKING`` blocks included."""
    found = []
    for path in sorted(Path(microvllm.core.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path.name, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.append((path.name, node.lineno, node.module))
    return found


def test_no_tensor_library_imports_in_core():
    offenders = [f"{name}: import {module}" for name, _, module in core_imports()
                 if module.split(".")[0] in FORBIDDEN]
    assert not offenders, f"microvllm/core must stay pure Python: {offenders}"


def test_core_imports_nothing_from_distributed():
    """The KV connectors live above core; the scheduler sees one only through
    ``core/kv_connector_protocol.py``. Type-only imports count too: a type is a dependency
    a reader must follow."""
    offenders = [f"{name}:{line}: import {module}" for name, line, module in core_imports()
                 if module.startswith("microvllm.distributed")]
    assert not offenders, ("microvllm/core must not import from microvllm.distributed: name what it "
                           f"needs in core/kv_connector_protocol.py instead: {offenders}")
