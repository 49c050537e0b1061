"""No lecture gives an exercise away: no solution body in plain view.

A solution is every ``### BEGIN SOLUTION`` … ``### END SOLUTION`` block of the package
(``course build`` cuts exactly those out of the exercises). What a learner sees of a
lecture without opening anything: markdown and code cells, and the stored outputs,
less ``<details>`` blocks (folded until clicked) and cells whose source or outputs
are collapsed (``metadata.jupyter.source_hidden`` / ``outputs_hidden``).

A block counts as shown when half or more of its distinctive lines (not blank, not a comment,
long enough not to occur by chance, like ``return out``) appear in that visible text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from microvllm.course.build import MARK_BEGIN, MARK_END
from microvllm.course.show import show_source

ROOT = Path(__file__).resolve().parents[2]
LECTURES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DETAILS = re.compile(r"<details\b.*?</details>", re.DOTALL | re.IGNORECASE)
MIN_LENGTH = 20   # shorter lines ("return out", "else:") occur everywhere


def solution_blocks() -> list[tuple[str, list[str]]]:
    """``(where, distinctive lines)`` of every solution block in the package."""
    blocks = []
    for path in sorted((ROOT / "microvllm").rglob("*.py")):
        if path.parts[-3:-1] == ("microvllm", "course"):
            continue   # the course tools name the markers; they hold no solution
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == MARK_BEGIN:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == MARK_END)
                body = [s.strip() for s in lines[i + 1:end]]
                distinctive = [s for s in body if len(s) >= MIN_LENGTH and not s.startswith("#")]
                blocks.append((f"{path.relative_to(ROOT)}:{i + 1}", distinctive))
    return blocks


def visible_text(cell: dict) -> str:
    hidden = cell.get("metadata", {}).get("jupyter", {})
    parts = [] if hidden.get("source_hidden") else ["".join(cell["source"])]
    if cell["cell_type"] == "code" and not hidden.get("outputs_hidden"):
        for output in cell.get("outputs", []):
            if "text" in output:
                parts.append("".join(output["text"]))
            for mime in ("text/markdown", "text/html", "text/plain"):
                if mime in output.get("data", {}):
                    parts.append("".join(output["data"][mime]))
    return DETAILS.sub("", "\n".join(parts))


def shown(distinctive: list[str], text: str) -> bool:
    lines = {line.strip() for line in text.splitlines()}
    found = sum(line in lines for line in distinctive)
    return found >= max(1, (len(distinctive) + 1) // 2)


BLOCKS = solution_blocks()


def test_the_package_has_solution_blocks():
    # every exercise's todo has a block; a block too short to check would be a blind spot
    assert len(BLOCKS) >= 18
    assert all(distinctive for _, distinctive in BLOCKS), [where for where, d in BLOCKS if not d]


@pytest.mark.parametrize("lecture", LECTURES, ids=lambda p: p.name)
def test_no_lecture_shows_a_solution_body(lecture):
    # the whole lecture at once: a body shown a few lines per cell is shown all the same
    text = "\n".join(visible_text(cell) for cell in json.loads(lecture.read_text())["cells"])
    spoilers = [where for where, distinctive in BLOCKS if shown(distinctive, text)]
    assert not spoilers, (f"{lecture.name} shows these exercise solutions in plain view; fold them "
                          "(show_source folds solution blocks by itself; a hand-written listing goes "
                          "in a <details> block): " + ", ".join(spoilers))


def test_the_check_sees_a_solution_shown_in_full():
    """The detector is live: an unfolded listing of an exercised method is caught,
    show_source's folded view of the same method is not."""
    from microvllm.core.block_pool import BlockPool

    where, distinctive = next(b for b in BLOCKS if "block_pool.py" in b[0])
    raw = Path(ROOT / where.split(":")[0]).read_text()
    unfolded = {"cell_type": "code", "source": [raw], "outputs": [], "metadata": {}}
    assert shown(distinctive, visible_text(unfolded))
    markdown = show_source(BlockPool).data
    folded = {"cell_type": "code", "source": ["show_source(BlockPool)"], "metadata": {},
              "outputs": [{"output_type": "display_data", "data": {"text/markdown": markdown}}]}
    assert not any(shown(d, visible_text(folded)) for _, d in BLOCKS)
    assert MARK_BEGIN in markdown   # ... while the full source is still there, folded


def test_show_source_folds_without_triton():
    """A Mac has no Triton: lectures other than 06 must still show (and fold) their code."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"   # import triton now raises ImportError
            "from microvllm.course.show import show_source\n"
            "from microvllm.core.block_pool import BlockPool\n"
            "md = show_source(BlockPool.free_blocks).data\n"
            "assert 'exercise 03 writes this' in md and '<details>' in md, md\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
