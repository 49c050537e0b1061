"""``MICROVLLM_CPU_ISA`` and the fallbacks: a target decides the build flags and what
run-time checks see; a fallback is said once on stderr, and a failed build is
remembered; ``collect-env`` reports it all."""

import os
import re
import subprocess
import sys

import pytest

from microvllm import envs
from microvllm.platforms.cpu import kernels


def run(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def test_an_unknown_target_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("MICROVLLM_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="native, avx512, avx2, portable"):
        envs.cpu_isa()


@pytest.mark.parametrize("isa,dropped,kept", [
    ("avx2", {"avx512f", "avx512_bf16", "amx_tile", "avx_vnni"}, {"avx2", "fma", "f16c"}),
    ("avx512", {"amx_tile", "avx512_bf16", "avx512_fp16"}, {"avx512f", "avx512bw", "avx2"}),
    ("portable", {"avx", "avx2", "fma", "f16c", "avx512f", "amx_tile"}, {"sse2", "popcnt"}),
])
def test_a_target_hides_the_flags_it_does_not_build_for(isa, dropped, kept, monkeypatch):
    cpu = {"sse2", "popcnt", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512cd",
           "avx512dq", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile"}
    monkeypatch.setattr(kernels, "cpu_flags", lambda: cpu)
    monkeypatch.setenv("MICROVLLM_CPU_ISA", isa)
    seen = kernels.isa_flags()
    assert not seen & dropped and kept <= seen


def test_a_target_this_cpu_cannot_run_is_refused_not_built(monkeypatch):
    """Code built for AVX-512 would die of an illegal instruction on an AVX2 laptop."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx", "avx2", "fma", "f16c"})
    monkeypatch.setattr(kernels, "machine", lambda: "x86_64")
    monkeypatch.setenv("MICROVLLM_CPU_ISA", "avx512")
    with pytest.raises(kernels.KernelUnavailable, match="needs avx512bw.*avx2 / portable") as raised:
        kernels.check_target()
    assert raised.value.expected


def test_x86_targets_are_refused_on_arm64():
    with pytest.raises(kernels.KernelUnavailable, match="x86 target and this machine is aarch64"):
        kernels.target_flags("avx2", "aarch64")
    # arm64's native: -mcpu=native, else the compiler's default CPU (Apple clang before 15)
    assert kernels.target_flags("native", "aarch64") == [["-mcpu=native"], []]
    assert kernels.target_flags("portable", "aarch64") == [["-DMICROVLLM_PORTABLE"]]


def test_no_compiler_is_one_warning_on_stderr_and_the_engine_still_runs():
    """``CXX=/bin/false``: every library fails the same way, said once (with what it
    costs); the engine runs on torch ops and generates. (The shared cache is safe to use:
    a compiler that cannot build an empty file writes nothing there.)"""
    script = """
from microvllm import LLM, SamplingParams
llm = LLM(max_num_seqs=2, num_kv_blocks=16)
out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
print("ok", len(out[0].outputs[0].token_ids))
"""
    done = run(script, CXX="/bin/false")
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["ok", "2"], done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "microvllm warning" in line]
    assert len(warnings) == 1, done.stderr[-3000:]
    assert "no C++ kernel can be built" in warnings[0] and "0.7x" in warnings[0] and "/bin/false" in warnings[0]


def test_a_failed_build_is_remembered_and_said_once(tmp_path):
    """A library that does not compile: the first process pays for the compiler and
    says why (the compiler's first error line); the next one reads the remembered
    failure instead of compiling again."""
    broken = tmp_path / "csrc"
    broken.mkdir()
    for header in kernels.CSRC.glob("*.h"):
        (broken / header.name).write_text(header.read_text())
    (broken / "argmax.cpp").write_text('#include "ops.h"\nthis is not C++;\n')
    script = f"""
from pathlib import Path
from microvllm.platforms.cpu import kernels
kernels.CSRC = Path({str(broken)!r})
kernels.COMPILE_FLAGS[-1] = "-I" + str(kernels.CSRC)
reason = kernels.status("argmax")
print("reason", reason.splitlines()[0])
print("remembered", "remembered from an earlier build" in reason)
"""
    first = run(script, MICROVLLM_CACHE=str(tmp_path / "cache"))
    second = run(script, MICROVLLM_CACHE=str(tmp_path / "cache"))
    for done in (first, second):
        assert done.returncode == 0, done.stderr
        assert "argmax.cpp" in done.stdout and "error" in done.stdout, done.stdout
        warnings = [line for line in done.stderr.splitlines() if "microvllm warning" in line]
        assert len(warnings) == 1 and "greedy sampling runs torch.argmax" in warnings[0], done.stderr
    assert "remembered False" in first.stdout and "remembered True" in second.stdout
    assert len(list((tmp_path / "cache").rglob("argmax.failed"))) == 1


def test_collect_env_names_the_target_each_kernel_and_the_routes():
    done = subprocess.run([sys.executable, "-m", "microvllm", "collect-env"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for section in ("machine", "target", "torch", "kernels", "routes"):
        assert f"\n{section}" in "\n" + out, out
    assert re.search(r"MICROVLLM_CPU_ISA +native", out), out
    for name in kernels.LIBRARIES:
        assert name in out
    assert "decode fast path" in out and "Linear, float32" in out


def test_a_compiler_without_openmp_builds_single_threaded_and_says_so_once(tmp_path):
    """Apple clang rejects -fopenmp: every library then builds without it (one thread),
    and that is one warning, not one per library."""
    compiler = tmp_path / "c++-without-openmp"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && '
                        '{ echo "c++: error: unsupported option \'-fopenmp\'" >&2; exit 1; }; done\nexec g++ "$@"\n')
    compiler.chmod(0o755)
    script = """
from microvllm.platforms.cpu import kernels
print([kernels.status(name) for name in ("norm_rope", "activation")])
"""
    done = run(script, CXX=str(compiler), MICROVLLM_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0 and done.stdout.strip() == "[None, None]", done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if "microvllm warning" in line]
    assert len(warnings) == 1 and "without OpenMP" in warnings[0] and "-fopenmp" in warnings[0], done.stderr
