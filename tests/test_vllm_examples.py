"""Real vLLM offline example scripts run unchanged but for their imports and model ids.

Each file in tests/vllm_examples/ is a copy of a script from the vLLM repository
(its header names the source path and commit and lists the mechanical edits: imports
from ``vllm.*`` become ``from microvllm import ...``, hub model ids become None, the
embedded model). Each runs in a fresh process, in a scratch folder, and must exit 0.

Model loading dominates (about 10 s each on 2 busy cores), so every test here is marked
``slow`` and left out of the quick tier (``bash .ci/run --quick``); the two slowest have a
10 s sleep in the script, or 128-token outputs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "tests" / "vllm_examples"
pytestmark = pytest.mark.slow


def run_example(name: str, *args: str, cwd: Path, timeout: int = 180) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture
def scratch(tmp_path, default_model_folder):  # the embedded model, converted once
    return tmp_path


def test_basic(scratch):
    out = run_example("basic.py", cwd=scratch)
    assert out.count("Prompt:") == 4 and "The capital of France is" in out


def test_generate_with_engine_args_flags(scratch):
    out = run_example("generate.py", "--max-tokens", "8", "--num_kv_blocks", "256",
                      "--no-enable-prefix-caching", cwd=scratch)
    assert out.count("Generated text:") == 4


def test_chat_with_a_chat_template_file(scratch, default_model_folder):
    template = default_model_folder / "chat_template.jinja"
    out = run_example("chat.py", "--max-tokens", "6", "--num-kv-blocks", "256",
                      "--chat-template-path", str(template), cwd=scratch)
    # One conversation, then 10 batched, then 10 with the template given explicitly.
    assert out.count("Generated text:") == 21
    assert "<|im_start|>assistant\\n'" in out  # the rendered prompt is on RequestOutput.prompt


def test_prefix_caching(scratch):
    out = run_example("prefix_caching.py", cwd=scratch)
    assert "Generated answers are the same: True" in out


def test_reproducibility(scratch):
    first = run_example("reproducibility.py", cwd=scratch)
    assert first.count("Generated text:") == 4


def test_model_default_sampling(scratch):
    out = run_example("basic_with_model_default_sampling.py", cwd=scratch)
    assert out.count("Generated text:") == 4


@pytest.mark.slow
def test_llm_engine_with_penalties_logprobs_and_cache_reset(scratch):
    out = run_example("llm_engine_reset_kv.py", "--num-kv-blocks", "256", cwd=scratch)
    assert "Resetting prefix cache at 10" in out
    finished = [line for line in out.splitlines() if line.startswith("RequestOutput(")]
    assert sorted(line.split("'")[1] for line in finished) == ["0", "1", "2", "3"]


@pytest.mark.slow
def test_simple_profiling_writes_a_trace(scratch):
    run_example("simple_profiling.py", cwd=scratch)
    traces = list((scratch / "vllm_profile").glob("*.json"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
