"""``python -m microvllm course build | check``: the exercise notebooks, generated from the package.

Code exists once. The package is the source; the notebooks are derived from it:

    package source                 solutions/NN_x.ipynb            exercises/NN_x.ipynb
    def touch(self, blocks):       the same lines, via             the same lines, with each
        \"\"\"docstring\"\"\"            inspect.getsource            marked block replaced:
        ### BEGIN SOLUTION   ──────>   (markers kept, so   ──────>     raise NotImplementedError(
        for block in blocks:           the learner sees what           "BlockPool.touch: ...")
            ...                        was cut)
        ### END SOLUTION

- ``build`` writes both folders (and ``exercises/README.md``), then executes every
  solution notebook so its stored outputs are fresh (nbval compares them in CI).
- ``check`` regenerates the sources in memory and exits 1, listing the files, when the
  committed notebooks differ from them (sources only: outputs are nbval's business).
  Run it in CI: editing the package without rebuilding, or hand-editing a notebook, fails.

Each notebook's text (contract, hints, checks) lives in ``microvllm/course/specs/``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from microvllm.course.exercise import Exercise

MARK_BEGIN = "### BEGIN SOLUTION"
MARK_END = "### END SOLUTION"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}
# Cell metadata key: {"microvllm": role}; role is "text", "setup", "solution" (a part with blanks;
# "your-code" in the exercise), "given" (a part without blanks), "check" or "engine".
TAG = "microvllm"


# ----------------------------------------------------------------------- the cut


def _raise_todo(indent: str, qualname: str, todo: str) -> str:
    """The line a blank leaves: it says where the contract is, never what to write (a
    learner sees this text in every check's output before opening any hint; the steps in
    words, ``todo``, wait in the last hint)."""
    return (f'{indent}raise NotImplementedError("{qualname}: not written yet (the contract: its docstring '
            f'and The contract above; stuck: the hints)")')


def cut_solutions(source: str, todos: dict, replace=_raise_todo) -> tuple[str, list[str]]:
    """Replace every marked block with ``raise NotImplementedError("<qualname>: not written
    yet ...")`` (or with the line ``replace(indent, qualname, todo)`` returns).

    Returns the exercise source and the qualnames whose blocks were cut. A block's
    qualname is its enclosing ``Class.function`` (or ``function``); ``todos[qualname]``
    says what to write there (a list when a function has several blocks)."""
    lines = source.splitlines()
    out: list[str] = []
    seen: dict[str, int] = {}
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.strip() != MARK_BEGIN:
            if line.strip() == MARK_END:
                raise ValueError(f"{MARK_END!r} without {MARK_BEGIN!r} at line {index + 1}")
            out.append(line)
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].strip() in (MARK_BEGIN, MARK_END)), None)
        if end is None or lines[end].strip() != MARK_END:
            raise ValueError(f"{MARK_BEGIN!r} at line {index + 1} has no {MARK_END!r} before the next block")
        indent = line[:len(line) - len(line.lstrip())]
        qualname = _enclosing_qualname(lines, index, indent)
        todo = todos.get(qualname)
        if todo is None:
            raise ValueError(f"a solution block in {qualname} has no entry in the exercise's todos")
        number = seen.get(qualname, 0)
        seen[qualname] = number + 1
        if isinstance(todo, (list, tuple)):
            if number >= len(todo):
                raise ValueError(f"{qualname} has more solution blocks than todos")
            todo = todo[number]
        out.append(replace(indent, qualname, todo))
        index = end + 1
    return "\n".join(out) + "\n", list(seen)


_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)")
_CLASS = re.compile(r"^(\s*)class\s+(\w+)")


def _enclosing_qualname(lines: list[str], index: int, indent: str) -> str:
    names, limit = [], len(indent)
    for line in reversed(lines[:index]):
        match = _DEF.match(line) or _CLASS.match(line)
        if match and len(match.group(1)) < limit:
            names.append(match.group(2))
            limit = len(match.group(1))
            if limit == 0:
                break
    if not names:
        raise ValueError(f"a solution block at line {index + 1} is not inside a function")
    return ".".join(reversed(names[:2] if len(names) > 1 else names))


# -------------------------------------------------------------------- notebooks

HOW_TO = (
    "**How to work.** Fill in every `raise NotImplementedError(...)` in the cells marked "
    "*your code*: the docstrings above them are the contract. Then run the check cells: they run "
    "the engine's own tests, property tests included, against your code and say what is wrong, "
    "on which input, and what to change. The hints open one at a time. When the checks pass, the "
    "last cell plugs your code into the real engine.")


def notebook_cells(exercise: Exercise, *, solution: bool) -> list[tuple[str, str, str]]:
    """The cells as (kind, role, source): kind is "markdown" or "code"."""
    other = "exercises" if solution else "solutions"
    head = (f"# Exercise {exercise.number} · {exercise.title}\n\n"
            f"Follows lecture **{exercise.lecture}**. {exercise.intro.strip()}\n\n"
            + (f"This is the **solution**: every cell holds the engine's own code, generated from the "
               f"package by `python -m microvllm course build` (the exercise is `{other}/{exercise.filename}`)."
               if solution else HOW_TO + f" (The filled-in version is `{other}/{exercise.filename}`.)"))
    cells = [("markdown", "text", head)]
    # `from __future__ import annotations` (the package's modules all have it) carries over to
    # every later cell: annotations naming TYPE_CHECKING-only classes stay unevaluated.
    setup = "%matplotlib inline\nfrom __future__ import annotations\n\n"
    if exercise.extra_setup_first:
        setup += exercise.extra_setup_first.strip() + "\n\n"
    cells.append(("code", "setup", setup + exercise.setup.strip()))
    cells.append(("markdown", "text", "## The contract\n\n" + exercise.contract.strip()))
    cut_seen: list[str] = []
    for part in exercise.parts:
        source = part.source()
        yours = MARK_BEGIN in source
        title = (f"### Your code: `{part.name}`" + (" (the methods you write)" if part.methods else "")
                 if yours else f"### Given: `{part.name}` (the engine's code, run it as it is)")
        cells.append(("markdown", "text", title + ("\n\n" + part.intro.strip() if part.intro else "")))
        if yours and not solution:
            source, cut = cut_solutions(source, exercise.todos)
            cut_seen += cut
        cells.append(("code", "solution" if yours else "given", source.rstrip()))
    if not solution:
        unused = sorted(set(exercise.todos) - set(cut_seen))
        if unused:
            raise ValueError(f"exercise {exercise.filename}: todos {unused} match no solution block")
    all_hints = (*exercise.hints, steps_in_words(exercise.todos))
    hints = "\n\n".join(f"<details><summary>Hint {i}</summary>\n\n{h.strip()}\n\n</details>"
                        for i, h in enumerate(all_hints, 1))
    cells.append(("markdown", "text", f"## Hints\n\nOpen one at a time. Hint {len(exercise.hints)} is a test case "
                  "to run (predict its answers first), not the answer; the last one gives the steps in words, "
                  "for when the others were not enough.\n\n" + hints))
    cells.append(("markdown", "text", "## Check your code\n\nEach check prints ✓ lines, or ✗ with the failing "
                  "input, what was expected, what came back and a hint."))
    cells += [("code", "check", c.strip()) for c in exercise.checks]
    cells.append(("markdown", "text", "## Run the engine on your code\n\n" + exercise.engine_intro.strip()))
    cells.append(("code", "engine", exercise.engine.strip()))
    for note in exercise.notes:
        cells.append(("markdown", "text", note.strip()))
    return cells


def steps_in_words(todos: dict) -> str:
    """The last hint: what each blank does, in words (a list: one line per block, in order)."""
    lines = []
    for qualname, todo in todos.items():
        blocks = [todo] if isinstance(todo, str) else list(todo)
        numbered = len(blocks) > 1
        for number, text in enumerate(blocks, 1):
            lines.append(f"- `{qualname}`" + (f", block {number}" if numbered else "") + f": {text}")
    return "The steps in words, not the code:\n\n" + "\n".join(lines)


def make_notebook(exercise: Exercise, *, solution: bool):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": dict(KERNEL), "language_info": {"name": "python"}}
    kind_prefix = "sol" if solution else "ex"
    for number, (kind, role, source) in enumerate(notebook_cells(exercise, solution=solution)):
        make = nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell
        cell = make(source)
        cell.id = f"{kind_prefix}{exercise.number}-{number:02d}"
        cell.metadata = {TAG: role}
        if role == "solution" and not solution:
            cell.metadata[TAG] = "your-code"
        nb.cells.append(cell)
    return nb


def readme(exercises) -> str:
    rows = "\n".join(f"| {e.number} | [{e.title}]({e.filename}) | {e.lecture} |" for e in exercises)
    return f"""# Exercises

Each notebook follows a lecture: implement the missing pieces (every
`raise NotImplementedError`) in your copy of the notebook, run the checker, then watch the
real engine run on your code. To start one again: `git checkout -- exercises/<name>.ipynb`.

For the course's maintainers: these files are generated by `python -m microvllm course build`
from the package; change the package, not the committed notebooks (`python -m microvllm
course check` fails when they differ from what it generates, and so reports a learner's
edited copy as different too).
The same notebooks, filled in with the engine's own code, are in `solutions/`.

| # | Exercise | After lecture |
|---|----------|---------------|
{rows}
"""


# ------------------------------------------------------------------ build / check


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def expected_files(root: Path) -> dict[Path, object]:
    """Every generated file and its content (a notebook, or text)."""
    from microvllm.course.specs import EXERCISES

    files: dict[Path, object] = {root / "exercises" / "README.md": readme(EXERCISES)}
    for exercise in EXERCISES:
        files[root / "exercises" / exercise.filename] = make_notebook(exercise, solution=False)
        files[root / "solutions" / exercise.filename] = make_notebook(exercise, solution=True)
    return files


def _cell_sources(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, "".join(cell.source)) for cell in nb.cells]


def check(root: Path | None = None) -> list[str]:
    """The generated files that are missing or differ from what the build would write."""
    import nbformat

    root = root or repo_root()
    problems = []
    expected = expected_files(root)
    for path, content in expected.items():
        rel = path.relative_to(root)
        if not path.exists():
            problems.append(f"{rel}: missing")
        elif isinstance(content, str):
            if path.read_text() != content:
                problems.append(f"{rel}: differs")
        else:
            committed = nbformat.read(path, as_version=4)
            if _cell_sources(committed) != _cell_sources(content):
                problems.append(f"{rel}: cell sources differ from the package")
    for folder in ("exercises", "solutions"):
        for path in sorted((root / folder).glob("*.ipynb")):
            if path not in expected:
                problems.append(f"{path.relative_to(root)}: not generated by the build (remove it)")
    return problems


def execute(nb, folder: Path, timeout: int = 600):
    """Run a notebook in ``folder`` with a fresh kernel; keep its metadata stable."""
    from nbclient import NotebookClient

    metadata = dict(nb.metadata)
    NotebookClient(nb, timeout=timeout, kernel_name=KERNEL["name"], record_timing=False,
                   resources={"metadata": {"path": str(folder)}}).execute()
    nb.metadata = metadata
    return nb


def build(root: Path | None = None, *, names: list[str] | None = None, run: bool = True) -> list[Path]:
    import nbformat

    root = root or repo_root()
    written = []
    for path, content in expected_files(root).items():
        if names and not any(n in path.name for n in names) and path.suffix == ".ipynb":
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            if run and path.parent.name == "solutions":
                print(f"executing {path.relative_to(root)} ...", flush=True)
                execute(content, path.parent)
            nbformat.write(content, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microvllm course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write exercises/ and solutions/, execute the solutions")
    b.add_argument("names", nargs="*", help="only notebooks whose file name contains one of these")
    b.add_argument("--no-execute", action="store_true", help="write the solutions without running them")
    sub.add_parser("check", help="fail if exercises/ or solutions/ differ from what build would write")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "build":
        for path in build(names=args.names or None, run=not args.no_execute):
            print(f"wrote {path.relative_to(repo_root())}")
        return 0
    problems = check()
    if problems:
        print("These course files differ from what `python -m microvllm course build` generates:")
        for problem in problems:
            print(f"  {problem}")
        print("Rebuild them with `python -m microvllm course build` (never edit them by hand).")
        return 1
    print("exercises/ and solutions/ match the package.")
    return 0
