"""The kernels, cross-compiled for arm64 (Apple silicon, Graviton) and run under qemu,
against plain references: the only way this x86 CI sees the NEON and arm64 code run.

Each target compiles every ``csrc/*.cpp`` to an object with its flags (kernels.COMPILE_FLAGS
and kernels.target_flags, as a real build would), compiles the harness in
``tests/platforms/aarch64/`` (a C++ program: check.h says what it checks) and links them
statically::

    csrc/*.cpp --(target flags)--> *.o ─┐
    aarch64/*.cpp ---------------> *.o ─┴─ -static ─> kernel_check ─(qemu-aarch64)─> ok / FAIL lines

The harness prints the build it is (``build: MICROVLLM_VEC 128, ...``), which the test holds
to the target: an "arm64 NEON" run that silently built the plain loops would prove nothing.
The same harness also runs natively on x86 (AVX2, AVX-512, portable): cheap, and it
proves the harness itself. clang builds link without OpenMP (its runtime has no static or
arm64 build here): one thread, the same code otherwise.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from microvllm.platforms.cpu import kernels
from tests.platforms.toolchains import CSRC, compile_objects, cross_flags, require, run

HARNESS = Path(__file__).parent / "aarch64"
AARCH64_GXX = ["aarch64-linux-gnu-g++"]
AARCH64_CLANG = ["clang++", "--target=aarch64-linux-gnu"]
X86_NEEDS = {"avx2": {"avx2", "fma", "f16c"},
             "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}


@dataclass(frozen=True)
class Target:
    compiler: list[str]
    arch: str
    isa: str          # MICROVLLM_CPU_ISA
    openmp: bool
    vec: int          # the MICROVLLM_VEC (vec.h) this target must build


TARGETS = {
    "aarch64-g++-neon": Target(AARCH64_GXX, "aarch64", "native", True, 128),
    "aarch64-g++-portable": Target(AARCH64_GXX, "aarch64", "portable", True, 0),
    "aarch64-clang++-neon": Target(AARCH64_CLANG, "aarch64", "native", False, 128),
    "x86-g++-avx2": Target(["g++"], "x86_64", "avx2", True, 256),
    "x86-g++-avx512": Target(["g++"], "x86_64", "avx512", True, 512),
    "x86-g++-portable": Target(["g++"], "x86_64", "portable", True, 0),
    "x86-clang++-avx512": Target(["clang++"], "x86_64", "avx512", False, 512),
}


def build_harness(target: Target, folder: Path) -> Path:
    """Compile the kernels and the harness for ``target`` and link them; the program."""
    flags = cross_flags(target.isa, target.arch) + (["-fopenmp"] if target.openmp else [])
    check_vec_linear = (CSRC / "vec_linear.cpp").exists()
    failures = compile_objects(target.compiler, [*kernels.COMPILE_FLAGS, *flags], sorted(CSRC.glob("*.cpp")),
                               folder / "kernels")
    # The harness without -ffast-math: its references test for NaN and must keep subnormals.
    # Not vectorized: GCC 12 for arm64 crashes (an internal compiler error) vectorizing two of
    # its reductions, and a harness need not be fast.
    harness_flags = ["-O2", "-fno-tree-vectorize", "-std=c++17", "-Wall", f"-I{CSRC}", *flags,
                     *(["-DMICROVLLM_CHECK_VEC_LINEAR"] if check_vec_linear else [])]
    failures += compile_objects(target.compiler, harness_flags, sorted(HARNESS.glob("*.cpp")), folder / "harness")
    assert not failures, "the kernel harness does not compile:\n" + "\n".join(failures)
    program = folder / "kernel_check"
    objects = sorted(map(str, folder.glob("*/*.o")))
    error = run([*target.compiler, "-static", *(["-fopenmp"] if target.openmp else []), *objects, "-o", str(program)])
    assert error is None, f"linking the kernel harness failed:\n{error}"
    return program


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TARGETS))
def test_kernels_match_the_references(name, tmp_path):
    target = TARGETS[name]
    require(target.compiler[0])
    if target.arch == "aarch64":
        require(AARCH64_GXX[0])   # arm64 headers and libraries, which clang uses too
        launcher = [require("qemu-aarch64"), "-L", "/usr/aarch64-linux-gnu"]
    else:
        if kernels.machine() != "x86_64":
            pytest.skip("x86 targets run on an x86 machine")
        missing = X86_NEEDS.get(target.isa, set()) - kernels.cpu_flags()
        if missing:
            pytest.skip(f"this CPU lacks {', '.join(sorted(missing))} for {target.isa}")
        launcher = []
    program = build_harness(target, tmp_path)
    done = subprocess.run([*launcher, str(program)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    print(done.stdout, done.stderr)
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, (
        f"the kernels built for {name} disagree with the references (exit {done.returncode}):\n"
        + "\n".join(failed or done.stdout.splitlines()[-20:]) + done.stderr[-2000:])
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"build: MICROVLLM_VEC {target.vec},"), (
        f"{name} must build vec.h's {target.vec}-bit vectors, but the harness says {first!r}: "
        f"the target flags {cross_flags(target.isa, target.arch)} no longer select them")
    if target.vec and (CSRC / "vec_linear.cpp").exists():
        assert "vec_linear M33" in done.stdout, "vec_linear was not checked on a build with vectors"
