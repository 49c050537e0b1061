"""Shared pieces for the course tests: the notebooks, their solution code as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def load_solution_module(notebook: Path, folder: Path):
    """The setup and solution cells of a notebook as one importable module (a real file,
    so that ``@triton.jit`` can read its kernel's source)."""
    nb = nbformat.read(notebook, as_version=4)
    cells = [c.source for c in nb.cells if c.metadata.get("microvllm") in ("setup", "solution", "given")]
    code = "\n\n".join(cells).replace("%matplotlib inline\n", "")
    name = "course_" + notebook.stem
    path = folder / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from microvllm.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("course_models") / "llama", "llama", seed=7)
