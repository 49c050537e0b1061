"""``show_source(obj)``: display the real source of a package function or class in a
notebook, so lectures explain the code the engine runs instead of a pasted copy;
``show_file(path, start, end)``: the same for a file of the package (the C++ kernels)."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

MARK_BEGIN = "### BEGIN SOLUTION"   # as course/build.py (imported lazily there: build imports the specs)


def source_of(obj, *, start: str | None = None, end: str | None = None) -> str:
    """The source of ``obj``; with ``start``/``end``, only the lines from the first line
    containing ``start`` up to and including the first later line containing ``end``."""
    source = textwrap.dedent(inspect.getsource(obj))
    if start is None and end is None:
        return source
    return _snippet(source, start, end, getattr(obj, "__name__", obj))


def _snippet(source: str, start: str | None, end: str | None, name="the source") -> str:
    lines = source.splitlines()
    first = next((i for i, line in enumerate(lines) if start is None or start in line), None)
    if first is None:
        raise ValueError(f"{start!r} does not occur in the source of {name}")
    last = next((i for i in range(first, len(lines)) if end is not None and end in lines[i]),
                len(lines) - 1)
    return textwrap.dedent("\n".join(lines[first:last + 1])) + "\n"


def show_source(obj, *, start: str | None = None, end: str | None = None):
    """Display the source as a highlighted Markdown code block (plain text elsewhere),
    headed by the file and line it lives at.

    An exercise's solution is never shown in plain view: each ``### BEGIN SOLUTION``
    block becomes one line saying which exercise writes it, and the whole source
    follows in a folded ``<details>`` block, to open after the exercise::

        def free_blocks(self, ordered_blocks):       def free_blocks(self, ordered_blocks):
            (docstring)                                 (docstring)
            ### BEGIN SOLUTION              ──>         ...  # exercise 03 writes this: drop one ...
            for block in ordered_blocks:
                ...                                 ▶ After exercise 03: the full source (folded)
            ### END SOLUTION
    """
    from IPython.display import Markdown

    path = inspect.getsourcefile(obj) or "?"
    short = path[path.rfind("microvllm/"):] if "microvllm/" in path else path
    lines, first_line = inspect.getsourcelines(obj)
    first_line = max(first_line, 1)  # a module reports line 0
    code = source_of(obj, start=start, end=end)
    if start is not None:  # point at the snippet, not at the top of the object
        first_line += next(i for i, line in enumerate(lines) if start in line)
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
    head = f"`{short}:{first_line}` — `{name}`\n\n"
    if MARK_BEGIN not in code:
        return Markdown(f"{head}```python\n{code}```")
    folded, exercises = fold_solutions(obj, start=start, end=end)
    which = " and ".join(sorted(exercises))
    return Markdown(f"{head}```python\n{folded}```\n\n<details><summary>After exercise {which}: the full "
                    f"source, solution included</summary>\n\n```python\n{code}```\n\n</details>")


def fold_solutions(obj, *, start: str | None = None, end: str | None = None) -> tuple[str, set[str]]:
    """``obj``'s source (or the ``start``..``end`` snippet of it) with each solution block
    replaced by a line naming the exercise that writes it; and those exercises' numbers."""
    from microvllm.course.build import cut_solutions

    todos, owner = {}, {}
    prefix = getattr(obj, "__qualname__", "").rpartition(".")[0]   # "BlockPool" for a method
    for exercise in _exercises():
        for qualname, todo in exercise.todos.items():
            for key in {qualname, qualname.removeprefix(prefix + ".") if prefix else qualname}:
                todos[key], owner[key] = todo, exercise.number
    seen: set[str] = set()

    def replace(indent: str, qualname: str, todo: str) -> str:
        seen.add(owner[qualname])
        lines = textwrap.wrap(todo, width=max(40, 80 - len(indent)))   # no sideways scrolling
        return "\n".join([f"{indent}...  # exercise {owner[qualname]} writes this:"]
                         + [f"{indent}     # {line}" for line in lines])

    folded, _ = cut_solutions(textwrap.dedent(inspect.getsource(obj)), todos, replace)
    if start is not None or end is not None:
        try:
            folded = _snippet(folded, start, end)
        except ValueError:   # the marker lies inside a solution: show the whole folded source
            pass
    return folded, seen


def _exercises():
    """The exercise specs. They import the objects they cut, the Triton decode kernel among
    them, which on a machine without CUDA loads only in Triton's CPU interpreter, and refuses
    to load once triton was imported without it (``make_tiny_model`` imports triton through
    transformers). Showing source runs no kernel: switch the interpreter on for that import,
    as ``ensure_triton_can_run`` does when it comes first. Without Triton at all (a Mac) the
    decode kernel's exercise is left out: the other lectures still show their code."""
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from microvllm.course.specs import exercise_specs
    return exercise_specs(skip_unavailable=True)


_LANGUAGES = {".cpp": "cpp", ".cc": "cpp", ".h": "cpp", ".hpp": "cpp", ".py": "python"}


def file_excerpt(path, *, start: str | None = None, end: str | None = None) -> tuple[str, int, int]:
    """``(text, first line, last line)`` of a package file (``path`` relative to the
    ``microvllm/`` folder, e.g. ``"csrc/norm_rope.cpp"``, or absolute): the whole file, or
    the lines from the first one containing ``start`` up to and including the first later
    line containing ``end``; a missing marker is an error. Lines are kept as they are, only
    their common indentation removed (preprocessor lines at column 0 do not count and stay
    put), so a ``#ifdef`` / ``#endif`` pair in the excerpt stays intact."""
    path = _package_file(path)
    lines = path.read_text().splitlines()
    first = next((i for i, line in enumerate(lines) if start is None or start in line), None)
    if first is None:
        raise ValueError(f"{start!r} does not occur in {path.name}: choose a start marker from the file")
    if end is None:
        last = len(lines) - 1
    else:
        last = next((i for i in range(first, len(lines)) if end in lines[i]), None)
        if last is None:
            raise ValueError(f"{end!r} does not occur in {path.name} after line {first + 1} "
                             f"({start!r}): choose an end marker from the file")
    return _dedent(lines[first:last + 1]) + "\n", first + 1, last + 1


def _package_file(path) -> Path:
    path = Path(path)
    return path if path.is_absolute() else Path(__file__).parents[1] / path


def _dedent(lines: list[str]) -> str:
    """Remove the indentation the lines share, not counting blank lines or preprocessor
    lines at column 0 (``#ifdef``, ``#endif``), which stay exactly as they are."""
    body = [line for line in lines if line.strip() and not line.startswith("#")]
    margin = min((len(line) - len(line.lstrip()) for line in body), default=0)
    kept = []
    for line in lines:
        if not line.strip():
            kept.append("")
        elif line[:margin].isspace():
            kept.append(line[margin:])
        else:   # nothing to remove, or a preprocessor line at column 0
            kept.append(line)
    return "\n".join(kept)


def show_file(path, start: str | None = None, end: str | None = None):
    """Display a package file, or the excerpt from ``start`` to ``end`` (see
    ``file_excerpt``), as a highlighted Markdown code block headed by its path and lines:
    for the C++ kernels, which ``show_source`` cannot show."""
    from IPython.display import Markdown

    text, first, last = file_excerpt(path, start=start, end=end)
    full = str(_package_file(path))
    short = full[full.rfind("microvllm/"):] if "microvllm/" in full else full
    language = _LANGUAGES.get(Path(path).suffix, "text")
    return Markdown(f"`{short}:{first}-{last}`\n\n```{language}\n{text}```")
