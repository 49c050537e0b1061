"""``show_source(obj)``: display the real source of a package function or class in a
notebook, so lectures explain the code the engine runs instead of a pasted copy;
``show_file(path, start, end)``: the same for a file of the package (the C++ kernels)."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path


def source_of(obj, *, start: str | None = None, end: str | None = None) -> str:
    """The source of ``obj``; with ``start``/``end``, only the lines from the first line
    containing ``start`` up to and including the first later line containing ``end``."""
    source = textwrap.dedent(inspect.getsource(obj))
    if start is None and end is None:
        return source
    lines = source.splitlines()
    first = next((i for i, line in enumerate(lines) if start is None or start in line), None)
    if first is None:
        raise ValueError(f"{start!r} does not occur in the source of {getattr(obj, '__name__', obj)}")
    last = next((i for i in range(first, len(lines)) if end is not None and end in lines[i]),
                len(lines) - 1)
    return textwrap.dedent("\n".join(lines[first:last + 1])) + "\n"


def show_source(obj, *, start: str | None = None, end: str | None = None):
    """Display the source as a highlighted Markdown code block (plain text elsewhere),
    headed by the file and line it lives at."""
    from IPython.display import Markdown

    path = inspect.getsourcefile(obj) or "?"
    short = path[path.rfind("microvllm/"):] if "microvllm/" in path else path
    lines, first_line = inspect.getsourcelines(obj)
    first_line = max(first_line, 1)  # a module reports line 0
    code = source_of(obj, start=start, end=end)
    if start is not None:  # point at the snippet, not at the top of the object
        first_line += next(i for i, line in enumerate(lines) if start in line)
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
    return Markdown(f"`{short}:{first_line}` — `{name}`\n\n```python\n{code}```")


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
