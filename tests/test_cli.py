"""The ``microvllm`` command: subcommands with their own help, --version, one-line
errors, vLLM's flags and summary line for ``bench throughput``, a hidden ``course``."""

import json
import re

import pytest

from microvllm import __version__
from microvllm.cli.main import main
from microvllm.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli") / "llama", "llama", seed=7)


def run(capsys, *argv):
    """(exit status, stdout, stderr) of ``microvllm *argv`` run in this process."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_help_lists_user_commands_only(capsys):
    status, out, _ = run(capsys, "--help")
    assert status == 0
    assert "{generate,bench,serve,collect-env}" in out and "course" not in out.split("positional arguments")[1]


@pytest.mark.parametrize("argv, words", [
    (["generate", "--help"], ["--max-tokens", "--max-num-seqs", "--enable-prefix-caching"]),
    (["bench", "--help"], ["throughput", "serve", "attention", "targets"]),
    (["bench", "targets", "--help"], ["--targets", "--batches", "--repeat"]),
    (["bench", "serve", "--help"], ["--request-rate", "--num-prompts", "--output-json"]),
    (["serve", "--help"], ["--host", "--port", "--max-num-seqs"]),
    (["bench", "throughput", "--help"], ["--num-prompts", "--input-len", "--output-len", "--output-json"]),
    (["course", "--help"], ["build", "check"]),  # hidden, yet reachable
])
def test_each_command_has_help(capsys, argv, words):
    status, out, _ = run(capsys, *argv)
    assert status == 0
    for word in words:
        assert word in out


def test_version(capsys):
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out.strip() == f"microvllm {__version__}"


@pytest.mark.parametrize("argv, words", [
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["generate"], ["the following arguments are required: prompt"]),
    (["generate", "hi", "--max-num-seqs", "many"], ["--max-num-seqs", "invalid int value"]),
    (["generate", "hi", "--max-num-seqs", "0"], ["max_num_seqs=0 must be at least 1"]),
    (["generate", "hi", "--model", "/no/such/folder"], ["/no/such/folder", "is not a folder"]),
    # the default model's 9 query heads do not split over 2 ranks: refused before any worker starts
    (["generate", "hi", "--tensor-parallel-size", "2"], ["num_attention_heads=9", "tensor_parallel_size=2",
                                                         "[1, 3, 9]"]),
    (["bench", "throughput", "--input-len", "0"], ["--input-len", "expected a whole number >= 1"]),
    (["serve", "/no/such/folder"], ["/no/such/folder", "is not a folder"]),
    (["serve", "--port", "http"], ["--port", "invalid int value"]),
])
def test_bad_arguments_give_one_error_line_and_status_2(capsys, argv, words):
    status, _, err = run(capsys, *argv)
    assert status == 2
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in error_lines[0]


def test_generate_with_engine_flags(capsys, tiny_llama):
    status, out, err = run(capsys, "generate", "hello there", "--model", str(tiny_llama),
                           "--max-tokens", "5", "--max_num_seqs", "4", "--dtype", "auto")
    assert status == 0 and out.startswith("hello there")
    assert "5 generated tokens" in err


def test_bench_throughput_vllm_flags_line_and_json(capsys, tiny_llama, tmp_path):
    report = tmp_path / "throughput.json"
    status, out, _ = run(capsys, "bench", "throughput", "--quick", "--skip-hf", "--workload", "random",
                         "--threads", "1", "--model", str(tiny_llama), "--num-prompts", "3",
                         "--input-len", "12", "--output-len", "5", "--output-json", str(report))
    assert status == 0
    assert "workload: 3 requests, prompts 12-12, outputs 5-5" in out
    line = re.search(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$",
                     out, re.MULTILINE)
    assert line, out
    data = json.loads(report.read_text())
    assert data["num_requests"] == 3 and data["total_num_tokens"] == 3 * (12 + 5)
    assert data["requests_per_second"] == pytest.approx(float(line[1]), rel=0.01)


def test_bench_serve_takes_vllms_dataset_spellings():
    from microvllm.bench.serve import build_parser

    args = build_parser().parse_args(["--dataset-name", "random", "--random-input-len", "7",
                                      "--random-output-len", "3", "--num-prompts", "5"])
    assert (args.dataset_name, args.input_len, args.output_len, args.num_prompts) == ("random", 7, 3, 5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dataset-name", "sharegpt"])


def test_bench_structured_runs_on_a_tiny_model(capsys, tiny_llama):
    from microvllm.bench.structured import main as bench_main

    assert bench_main(["--model", str(tiny_llama), "--batch-sizes", "1", "2", "--max-tokens", "8",
                       "--backend", "xgrammar"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["batch", "constraint", "tok/s"] and len(lines) == 7
    assert [line.split()[1] for line in lines[1:4]] == ["plain", "schema", "strict"]


def test_serve_without_the_serve_extra_names_the_extra(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "fastapi" else find_spec(name, *args))
    status, _, err = run(capsys, "serve", "--port", "1")
    assert status == 2 and "needs fastapi" in err and "microvllm[serve]" in err and "Traceback" not in err


def test_bench_lora_runs_on_a_tiny_model(capsys, tiny_llama):
    pytest.importorskip("peft")
    from microvllm.bench.lora import main as bench_main

    assert bench_main(["--model", str(tiny_llama), "--adapters", "2", "--rank", "8", "--batch-sizes", "1", "3",
                       "--max-tokens", "4", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["batch", "run", "tok/s", "vs", "base"] and len(lines) == 7
    assert [" ".join(line.split()[1:-2]) for line in lines[2:4]] == ["base, LoRA on", "2 adapters"]
