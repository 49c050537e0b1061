"""Every C++ kernel source compiles for every target, with g++ and with clang.

``MICROVLLM_CPU_ISA`` picks the target (kernels.target_flags); a file written for one
instruction set (AMX, AVX-512) must compile to an empty body elsewhere, so one command
builds the whole folder anywhere. The matrix, each with kernels.COMPILE_FLAGS and -fopenmp::

    g++, clang++ (x86-64)             avx2      -march=x86-64-v3
                                      avx512    -march=x86-64-v4
                                      native    -march=native (this machine's: AMX here)
                                      portable  -march=x86-64 -DMICROVLLM_PORTABLE
    aarch64-linux-gnu-g++             the default CPU (NEON), -mcpu=neoverse-n1, portable
    clang++ --target=aarch64-linux-gnu   the default CPU (NEON), -mcpu=apple-m1, portable

and in each build, the objects together define every C entry point in ops.h (kernels.py
declares them for ctypes; a file without its instructions defines stubs it never calls).
Compile only: tests/platforms/test_aarch64_kernels.py links and runs the kernels.
"""

from __future__ import annotations

import subprocess

import pytest

from microvllm.platforms.cpu import kernels
from tests.platforms.toolchains import CSRC, compile_objects, cross_flags, require

AARCH64 = "aarch64-linux-gnu-g++"
CLANG_AARCH64 = ["clang++", "--target=aarch64-linux-gnu"]
BUILDS = {
    **{f"{cxx}-x86-{isa}": ([cxx], kernels.target_flags(isa, "x86_64")[0])
       for cxx in ("g++", "clang++") for isa in ("avx2", "avx512", "native", "portable")},
    "g++-aarch64-default": ([AARCH64], cross_flags("native", "aarch64")),
    "g++-aarch64-neoverse-n1": ([AARCH64], ["-mcpu=neoverse-n1"]),
    "g++-aarch64-portable": ([AARCH64], cross_flags("portable", "aarch64")),
    "clang++-aarch64-default": (CLANG_AARCH64, cross_flags("native", "aarch64")),
    "clang++-aarch64-apple-m1": (CLANG_AARCH64, ["-mcpu=apple-m1"]),
    "clang++-aarch64-portable": (CLANG_AARCH64, cross_flags("portable", "aarch64")),
}


def defined_symbols(nm: str, objects: list) -> set[str]:
    listing = subprocess.run([nm, "--defined-only", "-g", *map(str, objects)],
                             capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in listing.splitlines() if len(line.split()) == 3}


@pytest.mark.slow
@pytest.mark.parametrize("build", list(BUILDS))
def test_every_kernel_compiles_for_the_target(build, tmp_path):
    compiler, target = BUILDS[build]
    require(compiler[0])
    arm = "aarch64" in build
    if arm:
        require(AARCH64)   # its headers and libraries, which clang's arm64 builds use too
    elif kernels.machine() != "x86_64":
        pytest.skip("x86 builds are checked on an x86 machine")
    sources = sorted(CSRC.glob("*.cpp"))
    flags = [*kernels.COMPILE_FLAGS, *target, "-fopenmp"]
    failures = compile_objects(compiler, flags, sources, tmp_path)
    assert not failures, (f"{len(failures)} of {len(sources)} kernel sources do not compile for "
                          f"{build} ({' '.join(target) or 'no target flags'}); a file written for one "
                          "instruction set must compile to stubs elsewhere:\n" + "\n".join(failures))
    nm = "aarch64-linux-gnu-nm" if arm else "nm"
    missing = set(kernels.signatures()) - defined_symbols(nm, sorted(tmp_path.glob("*.o")))
    assert not missing, (f"built for {build}, no kernel source defines {sorted(missing)}: every "
                         "C entry point in ops.h must exist on every target (as a stub where "
                         "the target lacks its instructions) so that ctypes can declare it")
