"""The package's layers: no module imports from a higher layer, and no import cycle.

A learner reads the package bottom-up; each layer may use only the ones below it::

    envs                                     environment variables, cache folders
    sampling_params inputs trace tokenizer   plain data and text
      detokenizer core distributed profiler
    attention layers                         attention backends, the model's building blocks
    config                                   EngineConfig and its parts (knows backend names)
    models sample structured_output          the models, the loader, the sampler, grammars,
      spec_decode lora                       speculative decoding's proposers, LoRA adapters
    platforms                                the hardware: ops' fast versions, C++ kernels
    worker  <  executor  <  engine  <  llm   the request's path, top-down
    entrypoints router                       the OpenAI-compatible server (over engine.async_llm),
                                             the course router (over N engines)
    viz checks course bench cli __main__     tools around the engine

Every ``import`` counts, including those inside functions (an import deferred to run
time is still a dependency); only ``if TYPE_CHECKING:`` blocks are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "microvllm"
LAYERS = [
    {"envs", "utils"},
    {"sampling_params", "inputs", "trace", "tokenizer", "detokenizer", "core", "csrc",
     "distributed", "profiler", "tool_parsers", "reasoning"},   # the parsers: text in, text out
    {"attention", "layers"},
    {"config"},
    {"models", "sample", "structured_output", "spec_decode", "lora"},   # lora: wraps layers/, used by worker/
    {"platforms"},
    {"worker"},
    {"executor"},
    {"engine"},
    {"llm"},
    {"entrypoints", "router"},   # the OpenAI server; the course router
    {"viz", "checks", "course", "bench", "testing", "cli", "collect_env", "__main__", ""},   # "": the __init__
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (``from a import b``: ``a.b`` if that is a
    module, else ``a``), outside ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node):
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node):
            for alias in node.names:
                if alias.name.startswith("microvllm"):
                    add(alias.name)

        def visit_ImportFrom(self, node):
            if not (node.module or "").startswith("microvllm"):
                return
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                add(full if full in modules else node.module)

    Visitor().visit(ast.parse(path.read_text()))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(paths)) - {name} for name, path in paths.items()}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{module} is in no layer: add its top-level name to LAYERS")


def test_no_module_imports_from_a_higher_layer():
    graph = import_graph()
    upward = [f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
              for module, targets in sorted(graph.items()) for target in sorted(targets)
              if layer_of(target) > layer_of(module)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_graph_is_real():
    """The checks above would pass on an empty graph: make sure it is not."""
    graph = import_graph()
    assert "microvllm.platforms.cpu.kernels" in graph["microvllm.platforms.cpu.ops"]
    assert "microvllm.engine.engine" in graph["microvllm.llm"]
    assert layer_of("microvllm.engine.engine") > layer_of("microvllm.core.scheduler")


def test_all_cpp_is_in_csrc_and_the_lesson_path_has_no_speed_code():
    """Every .cpp/.h lives in csrc/; the model and its layers are plain torch: no ctypes, no
    kernel module, no fast-path branch, and Linear knows nothing of the CPU's GEMMs."""
    sources = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*") if p.suffix in (".cpp", ".h")]
    assert sources and all(p.parts[0] == "csrc" for p in sources), sources
    lesson = [*PACKAGE.glob("layers/*.py"), *PACKAGE.glob("models/*.py")]
    assert len(lesson) > 5
    for path in lesson:
        text = path.read_text()
        for word in ("ctypes", "decode_fast_path", "mkldnn", "cpu_kernels"):
            assert word not in text, f"{path.relative_to(PACKAGE)} mentions {word!r}"
    linear = (PACKAGE / "layers" / "linear.py").read_text()
    for word in ("oneDNN", "onednn", "AMX", "amx", "AVX", "avx"):
        assert word not in linear, f"layers/linear.py mentions {word!r}"


def test_no_module_is_imported_by_a_name_in_a_string():
    """The graph above sees ``import`` statements only. A module named in a string and
    imported at run time (``importlib.import_module("microvllm.platforms...")``) would be a
    dependency it cannot see, so there is none: a lazy import is a plain ``import`` inside a
    function (as ``attention/selector.py`` loads its backends). The one exception loads the
    course's exercise specs, its own submodules, by folder listing."""
    dynamic = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = getattr(func, "attr", None) or getattr(func, "id", None)
                if name in ("import_module", "__import__"):
                    dynamic.append(module_name(path))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value
                if value.startswith("microvllm.") and ":" in value and " " not in value:
                    dynamic.append(f"{module_name(path)}: {value!r}")
    assert dynamic == ["microvllm.course.specs"], dynamic


def test_the_cpu_attention_backend_is_registered_by_its_platform():
    """attention/ (below platforms/) names no platform module; the CPU platform registers
    "cpu" itself, so the dependency points down."""
    graph = import_graph()
    assert not any(target.startswith("microvllm.platforms") for target in graph["microvllm.attention.selector"])
    assert "microvllm.attention.selector" in graph["microvllm.platforms.cpu.attention_backend"]
