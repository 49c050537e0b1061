"""A sentence that quotes a measured figure must be computed from the measurement.

In the optional chapters (14-22), a markdown cell that says "1.2x" or
"24-30 ms" next to an output that printed 1.44x teaches the wrong thing on the next
machine. So: every *figure* in a markdown cell of those notebooks must appear in the
source or the stored output of a code cell near it (the two code cells before it and
the two after). Prose that needs a measured number gets it from a cell that formats the
number into Markdown (``Markdown(f"... {speedup:.2f}x ...")``), which is an output; a
range that the cell asserts (``assert 1.0 < speedup``) is in that cell's source.

A figure here: a decimal number (``1.2``, ``0.85``), or a number with a unit of time,
speed, size or ratio (``24 ms``, ``3x``, ``1.5×``, ``40%``, ``35 tok/s``, ``425 MB``).
Plain integers (k = 4, 32 prompts, layer 12) are facts of the setup, not measurements.
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted(path for path in (Path(__file__).parents[2] / "notebooks").glob("[12][0-9]_*.ipynb")
                   if 14 <= int(path.name[:2]) <= 22)
UNIT = r"(?:x|×|ms|us|µs|s|%|tok/s|tokens/s|MB|GB|MiB|GiB|KiB|GB/s)"
FIGURE = re.compile(rf"(?<![\w.§])(\d+(?:[.,]\d+)?)\s?{UNIT}(?![\w/])|(?<![\w.§])(\d+\.\d+)(?![\w.])")
NEAR = 2   # code cells on each side


def _text(cell: dict) -> str:
    parts = ["".join(cell.get("source", []))]
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", [])))
        for value in output.get("data", {}).values():
            parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def _without_code(markdown: str) -> str:
    """Prose only: fenced blocks and inline code name values, they do not report them."""
    markdown = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    markdown = re.sub(r"`[^`]*`", " ", markdown)
    markdown = re.sub(r"\b(?:vLLM|vllm|SGLang|version|v)\s?\d+(?:\.\d+)+", " ", markdown)   # a release, not a figure
    return re.sub(r"\$[^$]*\$", " ", markdown)   # formulas


def unsupported_figures(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    code = [i for i, cell in enumerate(cells) if cell["cell_type"] == "code"]
    problems = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        before = [j for j in code if j < i][-NEAR:]
        after = [j for j in code if j > i][:NEAR]
        nearby = "\n".join(_text(cells[j]) for j in before + after)
        for match in FIGURE.finditer(_without_code("".join(cell["source"]))):
            number = (match.group(1) or match.group(2)).replace(",", "")
            if not re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", nearby):
                problems.append(f"{notebook.name} cell {i}: {match.group(0).strip()!r} is not in the code "
                                f"cells around it (cells {before + after})")
    return problems


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_in_prose_comes_from_a_cell_beside_it(notebook):
    problems = unsupported_figures(notebook)
    assert not problems, ("a markdown cell quotes a figure that no nearby cell computes or asserts; format it "
                          "into the output (Markdown(f'...')) or assert the range it states:\n  "
                          + "\n  ".join(problems))
