"""``show_source(obj)``: display the real source of a package function or class in a
notebook, so lectures explain the code the engine runs instead of a pasted copy."""

from __future__ import annotations

import inspect
import textwrap


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
