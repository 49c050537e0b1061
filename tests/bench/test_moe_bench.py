"""Smoke test of ``microvllm bench throughput --workload moe --quick``: every row is printed and
every engine run's greedy token ids agree with Hugging Face's. No timing is asserted."""

import os
import re

from microvllm.bench.moe import moe_impl
from microvllm.cli.main import main as cli_main


def test_quick_prints_the_table_and_agreement(capsys, monkeypatch):
    monkeypatch.setenv("MICROVLLM_MOE_IMPL", "iterative")      # the bench sets and restores it
    assert cli_main(["bench", "throughput", "--workload", "moe", "--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for pattern in [
        r"^microvllm bench throughput --workload moe: qwen3_moe, 8 experts, top-2, 2 layers, hidden 128, "
        r"vocab 1024; [\d.]+M params, [\d.]+M active per token",
        r"^cpu: .+, \d+ cores",
        r"^\s+T=4 rows\s+T=64 rows$",
        r"^\(a\) iterative\s+[\d.]+ ms\s+1\.0x\s+[\d.]+ ms\s+1\.0x$",
        r"^\(b\) sorted\s+[\d.]+ ms\s+[\d.]+x\s+[\d.]+ ms\s+[\d.]+x$",
        r"^\(c\) triton\s+(skipped: no CUDA GPU|[\d.]+ ms)",
        r"^workload: 4 requests, prompts 16-32, outputs 8-12 \(seed 0\)",
        r"^HF static batch\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+1\.00x  \(the reference\)$",
        r"^sorted / iterative \(eager\): [\d.]+x$",
    ]:
        assert re.search(pattern, out, re.MULTILINE), f"no line matching {pattern!r} in:\n{out}"
    for name in ["iterative", "sorted", r"default \((sorted|triton)\)"]:
        for mode in ["eager", "not eager"]:
            row = rf"^microvllm {name}, {mode}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x  agree 4/4$"
            assert re.search(row, out, re.MULTILINE), f"no line matching {row!r} in:\n{out}"
    assert "DISAGREE" not in out
    assert os.environ["MICROVLLM_MOE_IMPL"] == "iterative"


def test_moe_impl_sets_and_restores(monkeypatch):
    monkeypatch.delenv("MICROVLLM_MOE_IMPL", raising=False)
    with moe_impl("sorted"):
        assert os.environ["MICROVLLM_MOE_IMPL"] == "sorted"
        with moe_impl(None):
            assert "MICROVLLM_MOE_IMPL" not in os.environ
        assert os.environ["MICROVLLM_MOE_IMPL"] == "sorted"
    assert "MICROVLLM_MOE_IMPL" not in os.environ
