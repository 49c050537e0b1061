"""Every notebook's map to vLLM names files and symbols that exist in vLLM 0.34.0.

The maps say "this lives in `vllm/v1/core/sched/scheduler.py` `Scheduler.schedule`". vLLM moves
files between releases, so a map typed once goes stale in silence. This test reads every map and
checks each vLLM path against ``data/vllm_0_34_files.txt``: the ``.py`` files of the vLLM 0.34.0
wheel from PyPI, sorted, one a line; for the files the maps name, the line also lists the names the
file defines (``path: Name Class(member member) ...``). No network and no vLLM installed: the record is
the data. To regenerate it after a map names a new file, unzip the wheel and run
``python tests/course/test_vllm_maps.py PATH/TO/UNZIPPED/vllm``.

How a map is read (the convention the notebooks follow):

* A **map section** is a markdown section whose heading says where the chapter lives in vLLM
  (``## In vLLM``, ``## Where this lives in vLLM``, ``## 7 · The map to vLLM``, ``## Where to read
  next in vLLM``, ``## 4. What vLLM adds``, ``## Reading vLLM next``); it runs to the next heading of
  its level or above, or to the end of its cell. Notebook 10's file-by-file map is its ``MAP`` and
  ``NEXT`` lists (code cells), read as data: their vLLM field names files, unquoted.
* A **path** is backticked and ends in ``.py`` (a file) or ``/`` (a folder). Written in full it
  starts with ``vllm/``. A short one is written relative to the folder of a vLLM path named before
  it in the row (or in the section), or to any folder above that one:
  ``vllm/lora/punica_wrapper/punica_cpu.py``, ``punica_base.py``; ``layers/quantization/gguf.py``
  under ``vllm/model_executor/``; ``v1/request.py`` under ``vllm/``. A bare file name with no vLLM
  path before it in its section is another project's, and is not checked.
* In a **table**, every path in a column whose heading says vLLM is checked; in the other columns
  (microvllm's, remarks) only full ``vllm/`` paths are, since their short paths are microvllm's.
  In prose every path is checked: a microvllm file there is written ``microvllm/...``.
* Paths outside the wheel are not checked: vLLM's ``csrc/``, ``tests/``, ``docs/``, ``benchmarks/``,
  ``cmake/``, SGLang's ``python/``, the vLLM Router's ``src/``, llama.cpp's and the GGUF plugin's,
  and the short paths that follow one of them in its table cell or paragraph, up to the next full
  ``vllm/`` path.
* A **symbol** is a backticked name right after a path, separated from it by spaces only
  (`` `file.py` `Name` ``), and each backticked name listed after that one with commas
  (`` `Name.method`, `other` ``). It must be
  defined in that file (under that folder, for a folder): a top-level class, function or
  assignment, a name in ``__all__``, or a member of a class (``Class.member``; a bare name may be a
  member of any class of the file, as in ``GPUModelRunner._prepare_inputs``, ``execute_model``).
  In ``MAP`` and ``NEXT`` the names field is checked against all the files of its row.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RECORD = Path(__file__).parent / "data" / "vllm_0_34_files.txt"
WHEEL = "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"

MAP_HEADING = re.compile(r"^(#{2,3}) (?:In vLLM|.*Where this lives in vLLM|.*[Mm]ap to vLLM|"
                         r"Where to read next in vLLM|.*What vLLM adds|Reading vLLM next)\b")
HEADING = re.compile(r"^(#{1,6}) ")
# a path: folders and a file name with an extension, or folders ending in "/"
PATH = re.compile(r"^(?:[\w.+-]+/)+(?:[\w.+-]+\.\w+)?$|^[\w.+-]+\.(?:py|cpp|cu|cuh|h|hpp|rs|md|cmake|txt|json)$")
NAME = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
# first folders of paths that are not in the wheel (vLLM's repository, SGLang, the router, llama.cpp)
OUTSIDE = {"csrc", "tests", "docs", "benchmarks", "cmake", "examples", "tools", "requirements", "python",
           "src", "ggml", "gguf-py", "vllm_gguf_plugin", "sgl-kernel", "microvllm", "notebooks"}


# -- the record ----------------------------------------------------------------------------------

@dataclass
class Record:
    files: set[str]
    names: dict[str, set[str]]          # file -> what it defines, for the files the maps name

    def is_folder(self, folder: str) -> bool:
        return any(path.startswith(folder) for path in self.files)

    def exists(self, path: str) -> bool:
        return self.is_folder(path) if path.endswith("/") else path in self.files


def load_record(text: str | None = None) -> Record:
    files: set[str] = set()
    names: dict[str, set[str]] = {}
    for line in (RECORD.read_text() if text is None else text).splitlines():
        if not line or line.startswith("#"):
            continue
        path, colon, defined = line.partition(":")
        files.add(path)
        if colon:                       # "Name Class(member member) ..." -> Name, Class, Class.member, ...
            names[path] = set()
            for name, members in re.findall(r"(\w+)(?:\(([^)]*)\))?", defined):
                names[path].add(name)
                names[path].update(f"{name}.{member}" for member in members.split())
    return Record(files, names)


# -- reading the maps ------------------------------------------------------------------------------

@dataclass
class Mention:
    """A vLLM path one map row names, with the symbols written after it."""
    where: str                          # "21_agents.ipynb cell 40, row `tool_parsers/...`"
    written: str                        # as the row writes it
    resolved: str | None                # the recorded path it means, None if there is none
    symbols: list[str] = field(default_factory=list)


@dataclass
class Fragment:
    """One table cell or paragraph: the unit in which a short path follows the path before it."""
    text: str
    vllm_side: bool                     # a vLLM column, or prose: short paths are vLLM's
    quoted: bool = True                 # paths are backticked (markdown) or bare (notebook 10's MAP)


def _split_row(line: str) -> list[str]:
    """``| a | `x|y` | b |`` -> ["a", "`x|y`", "b"]: a pipe inside backticks is not a column."""
    cells, current, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    return cells + [current.strip()]


def markdown_sections(source: str) -> list[tuple[str, list[str]]]:
    """The map sections of one markdown cell: (heading, lines)."""
    sections: list[tuple[str, list[str]]] = []
    current: tuple[str, list[str]] | None = None
    level = 0
    for line in source.splitlines():
        heading = HEADING.match(line)
        if heading and current is not None and len(heading.group(1)) <= level:
            current = None
        match = MAP_HEADING.match(line)
        if match:
            level = len(match.group(1))
            current = (line.lstrip("# ").strip(), [])
            sections.append(current)
        elif current is not None:
            current[1].append(line)
    return sections


def markdown_rows(lines: list[str]) -> list[tuple[str, list[Fragment]]]:
    """A section's rows: each table row (labelled by its first cell) and each paragraph or list item."""
    rows: list[tuple[str, list[Fragment]]] = []
    header: list[str] | None = None
    paragraph: list[str] = []

    def end_paragraph() -> None:
        if paragraph:
            text = " ".join(paragraph)
            rows.append((text[:60], [Fragment(text, vllm_side=True)]))
            paragraph.clear()

    for line in lines + [""]:
        if line.startswith("|"):
            end_paragraph()
            cells = _split_row(line)
            if header is None:
                header = cells
            elif not all(set(cell) <= set("-: ") for cell in cells):
                sides = [bool(re.search(r"\bvLLM\b", title)) for title in header]
                rows.append((cells[0], [Fragment(cell, side) for cell, side in zip(cells, sides)]))
            continue
        header = None
        if not line.strip() or line.lstrip().startswith(("- ", "* ")) or re.match(r"\s*\d+\. ", line):
            end_paragraph()
        if line.strip():
            paragraph.append(line.strip())
    return rows


def notebook10_rows(cells: list[dict]) -> list[tuple[str, str, list[Fragment]]]:
    """Notebook 10's ``MAP`` and ``NEXT`` lists, as rows: (list name, label, fragments). The last
    fragment of each row is its names field, checked against every file of the row."""
    rows = []
    for index, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or not re.search(r"^(?:MAP|NEXT) = \[", source, re.M):
            continue
        for node in ast.parse(source).body:
            if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Name):
                continue
            name = node.targets[0].id
            if name in ("MAP", "NEXT"):
                for row in ast.literal_eval(node.value):
                    path, names, rest = (row[2], row[3], row[4:]) if name == "MAP" else (row[1], row[2], row[3:])
                    fragments = [Fragment(path, vllm_side=True, quoted=False)]
                    fragments += [Fragment(str(text), vllm_side=False, quoted=False) for text in rest]
                    fragments.append(Fragment(names, vllm_side=False, quoted=False))
                    rows.append((f"cell {index} {name}", row[0], fragments))
    return rows


def _tokens(fragment: Fragment) -> Iterator[tuple[str, str]]:
    """The paths of a fragment, in order, each with the text that follows it."""
    if fragment.quoted:
        for match in re.finditer(r"`([^`\s]+)`", fragment.text):
            if PATH.match(match.group(1)) and "://" not in match.group(1):
                yield match.group(1), fragment.text[match.end():]
    else:
        for match in re.finditer(r"[\w.+/-]+", fragment.text):
            token = match.group(0).rstrip(".")
            if "/" in token and PATH.match(token) or token.endswith(".py") and PATH.match(token):
                yield token, fragment.text[match.end():]


def _symbols_after(rest: str) -> list[str]:
    """The names after a path: `` `Name`, `Class.method`, `other` `` (spaces only before the first)."""
    symbols: list[str] = []
    separator = r"\s+"
    while True:
        match = re.match(separator + r"`([^`]+)`", rest)
        if not match or not NAME.match(match.group(1)) or PATH.match(match.group(1)):
            return symbols
        symbols.append(match.group(1))
        rest, separator = rest[match.end():], r"\s*,\s*"


def _resolve(short: str, anchors: list[str], record: Record) -> str | None:
    """The recorded path a short path means: under the folder of an anchor, or a folder above it."""
    for anchor in anchors + ["vllm/"]:
        folder = anchor if anchor.endswith("/") else anchor.rsplit("/", 1)[0] + "/"
        while folder:
            if record.exists(folder + short):
                return folder + short
            folder = folder[:-1].rpartition("/")[0] + "/" if folder.count("/") > 1 else ""
    return None


def mentions_in_rows(notebook: str, rows: list[tuple[str, list[Fragment]]], record: Record) -> list[Mention]:
    """Every checked path of a section's rows. Anchors for short paths: the full ``vllm/`` paths named
    before, in this row first (most recent first), then in the section."""
    found: list[Mention] = []
    section_anchors: list[str] = []
    for label, fragments in rows:
        row_anchors: list[str] = []
        where = f"{notebook}, row {label.strip()[:70]!r}"
        for fragment in fragments:
            outside = False                  # the last path of this fragment is not in the wheel
            for written, rest in _tokens(fragment):
                full = written.startswith("vllm/")
                first = written.split("/", 1)[0]
                if full:
                    outside = False
                    mention = Mention(where, written, written if record.exists(written) else None)
                elif first in OUTSIDE or outside or not fragment.vllm_side:
                    outside = outside or first in OUTSIDE
                    continue
                elif "/" not in written and not row_anchors + section_anchors:
                    continue                 # a bare file name with no vLLM folder before it: another project's
                else:
                    mention = Mention(where, written, _resolve(written, row_anchors + section_anchors, record))
                if mention.resolved:
                    row_anchors.insert(0, mention.resolved)
                if not written.endswith((".py", "/")):
                    continue                 # a .cpp, .rs, ... file: not in the wheel's record
                if fragment.quoted:
                    mention.symbols = _symbols_after(rest)
                found.append(mention)
        section_anchors = row_anchors + section_anchors
    return found


def map_mentions(notebook: Path, record: Record) -> tuple[list[Mention], list[tuple[str, list[str], list[str]]]]:
    """All the paths a notebook's map names, and notebook 10's rows as (where, files, names)."""
    cells = json.loads(notebook.read_text())["cells"]
    mentions: list[Mention] = []
    table_rows: list[tuple[str, list[str], list[str]]] = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            for heading, lines in markdown_sections("".join(cell["source"])):
                rows = markdown_rows(lines)
                mentions += mentions_in_rows(f"{notebook.name} cell {index} ({heading})", rows, record)
    for list_name, label, fragments in notebook10_rows(cells):
        row = mentions_in_rows(f"{notebook.name} {list_name}", [(label, fragments)], record)
        mentions += row
        names = re.sub(r"\([^()]*\)|`[^`]* [^`]*`", "", fragments[-1].text)
        paths = [m.resolved for m in row if m.resolved]
        # "vllm/tool_parsers/ (hermes_tool_parser.py, ...)": the names are in the files listed
        paths = [p for p in paths if not (p.endswith("/") and any(q != p and q.startswith(p) for q in paths))]
        table_rows.append((f"{notebook.name} {list_name}, row {label!r}", paths,
                           [n.strip() for n in re.split(r"[,/+;]", names.replace("`", "")) if NAME.match(n.strip())]))
    return mentions, table_rows


# -- what a file defines ----------------------------------------------------------------------------

def defined_names(source: str) -> set[str]:
    """Top-level classes, functions and assignments (inside ``if``/``try`` too), ``__all__``, and
    ``Class.member`` for each class's methods, class attributes and the attributes its methods set
    on ``self``."""
    names: set[str] = set()

    def targets(node) -> list[str]:
        if isinstance(node, ast.Assign):
            return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    def body(nodes, prefix=""):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef) and not prefix:
                    body(node.body, node.name + ".")
                elif prefix:                 # a method: the attributes it sets on self
                    names.update(prefix + t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                 if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                 and t.value.id == "self")
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for part in ("body", "orelse", "finalbody"):
                    body(getattr(node, part, []), prefix)
                for handler in getattr(node, "handlers", []):
                    body(handler.body, prefix)
            for name in targets(node):
                names.add(prefix + name)
                if name == "__all__" and not prefix and isinstance(node.value, (ast.List, ast.Tuple)):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))

    body(ast.parse(source).body)
    return names


def is_defined(symbol: str, defined: set[str]) -> bool:
    """``Class.member`` exactly; a bare name at the top level or as a member of any class."""
    return symbol in defined or "." not in symbol and any(name.endswith("." + symbol) for name in defined)


def files_for(resolved: str, record: Record) -> list[str]:
    return sorted(p for p in record.files if p.startswith(resolved)) if resolved.endswith("/") else [resolved]


# -- the tests -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def record() -> Record:
    return load_record()


def test_the_record_is_vllm_0_34s_file_list(record):
    text = RECORD.read_text()
    assert WHEEL in text and WHEEL_SHA256 in text, "the record must say which wheel it was read from"
    paths = [line.partition(":")[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert paths == sorted(paths) and len(paths) == len(set(paths)), "keep the record sorted, one path a line"
    assert all(p.startswith("vllm/") and p.endswith(".py") for p in paths)
    assert len(paths) > 3000 and "vllm/v1/core/sched/scheduler.py" in record.files
    assert len(text.encode()) < 1_000_000, "the record must stay small: record names only for mapped files"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_map_path_exists_in_vllm_0_34(notebook, record):
    mentions, _ = map_mentions(notebook, record)
    assert mentions, f"{notebook.name}: no map section found (a heading such as '## Where this lives in vLLM')"
    missing = [f"{m.where}: `{m.written}`" for m in mentions if m.resolved is None]
    assert not missing, ("a map row names a vLLM file or folder that vLLM 0.34.0 does not have; find the "
                         "class or function in 0.34 and name its file:\n  " + "\n  ".join(missing))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_map_symbol_is_defined_where_its_row_says(notebook, record):
    mentions, table_rows = map_mentions(notebook, record)
    unrecorded, wrong = set(), []
    for m in mentions:
        if m.resolved and m.symbols:
            files = files_for(m.resolved, record)
            unrecorded.update(f for f in files if f not in record.names)
            for symbol in m.symbols:
                if not any(is_defined(symbol, record.names.get(f, set())) for f in files):
                    wrong.append(f"{m.where}: `{m.written}` `{symbol}`")
    for where, paths, names in table_rows:
        files = [f for path in paths for f in files_for(path, record)] if names else []
        unrecorded.update(f for f in files if f not in record.names)
        if files:
            wrong += [f"{where}: {name} in none of {paths}" for name in names
                      if not any(is_defined(name, record.names.get(f, set())) for f in files)]
    assert not unrecorded, ("the record has no names for these files; regenerate it (see this module's "
                            f"docstring): {sorted(unrecorded)}")
    assert not wrong, ("a map row names a symbol that its vLLM 0.34.0 file does not define; name the file "
                       "that defines it:\n  " + "\n  ".join(wrong))


def test_a_wrong_row_is_caught():
    """The reader itself: a moved file, a symbol in the wrong file, a short path, a path outside."""
    record = load_record("vllm/a/b.py: Foo Foo.bar\nvllm/a/c.py: baz\nvllm/x/y.py:\n")
    rows = markdown_rows([
        "| microvllm | vLLM | remark |", "|---|---|---|",
        "| `core/b.py` | `vllm/a/b.py` `Foo.bar`, `bar`, `baz`; `c.py` `baz`, `gone.py` | `core/gone.py` |",
        "| x | `csrc/k.cpp`, `z.py` | `vllm/q.py` |",
        "| y | `a/` `baz` | |",
    ])
    found = mentions_in_rows("nb", rows, record)
    assert [(m.written, m.resolved, m.symbols) for m in found] == [
        ("vllm/a/b.py", "vllm/a/b.py", ["Foo.bar", "bar", "baz"]), ("c.py", "vllm/a/c.py", ["baz"]),
        ("gone.py", None, []), ("vllm/q.py", None, []), ("a/", "vllm/a/", ["baz"])]
    assert not is_defined("baz", record.names["vllm/a/b.py"]) and is_defined("bar", record.names["vllm/a/b.py"])


# -- regenerating the record ------------------------------------------------------------------------

def write_record(package: Path) -> None:
    """Record the .py files of an unzipped vLLM 0.34.0 wheel (``package`` is its ``vllm/`` folder),
    with the names each file defines for the files the notebooks' maps name."""
    files = sorted(p.relative_to(package.parent).as_posix() for p in package.rglob("*.py"))
    bare = Record(set(files), {})
    named: set[str] = set()
    for notebook in NOTEBOOKS:
        mentions, table_rows = map_mentions(notebook, bare)
        named.update(f for m in mentions if m.resolved and m.symbols for f in files_for(m.resolved, bare))
        named.update(f for _, paths, names in table_rows if names for p in paths for f in files_for(p, bare))
    lines = [f"# vLLM 0.34.0: every .py file of the PyPI wheel {WHEEL} (sha256 {WHEEL_SHA256}), sorted.",
             "# 'path: names' also records what the file defines, for the files the notebooks' maps name:",
             "# top-level classes, functions and assignments, __all__, and Class(members) for each class's",
             "# methods, class attributes and attributes set on self.",
             "# Checked by tests/course/test_vllm_maps.py; regenerate with: "
             "python tests/course/test_vllm_maps.py PATH/TO/UNZIPPED/vllm"]
    for path in files:
        if path in named:
            members: dict[str, list[str]] = {}
            for name in sorted(defined_names((package.parent / path).read_text(encoding="utf-8"))):
                owner, _, member = name.partition(".")
                members.setdefault(owner, [])
                if member:
                    members[owner].append(member)
            grouped = (f"{owner}({' '.join(m)})" if m else owner for owner, m in members.items())
            lines.append(f"{path}: {' '.join(grouped)}".rstrip())
        else:
            lines.append(path)
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_record(Path(sys.argv[1]))
