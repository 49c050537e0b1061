"""The compilers and emulator that the kernel build tests use, and how they compile.

The kernels must build for every target a workshop laptop can be (x86 AVX2, AVX-512,
Apple silicon / arm64, and the portable fallback), so CI compiles them with each of::

    g++, clang++                 x86-64, the host's compilers
    aarch64-linux-gnu-g++        arm64, cross (Debian: g++-aarch64-linux-gnu)
    clang++ --target=aarch64...  arm64, cross, compile only (clang has no arm64 libraries here)
    qemu-aarch64                 runs what the cross compiler linked (Debian: qemu-user)

A missing tool fails the test in CI (``CI=true``: .ci/run installs them, so a missing one
means the install broke) and only skips it elsewhere (a laptop need not have them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from microvllm.platforms.cpu import kernels

CSRC = kernels.CSRC
# Debian's package for each tool, said when one is missing.
PACKAGES = {"g++": "g++", "clang++": "clang", "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu",
            "qemu-aarch64": "qemu-user"}


def require(tool: str) -> str:
    """``tool``'s path, or the test stops: failed in CI, skipped elsewhere."""
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed (apt-get install {PACKAGES.get(tool, tool)})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}: CI installs it in .ci/run, so that install step broke")
        pytest.skip(message)
    return path


def cross_flags(isa: str, arch: str) -> list[str]:
    """The target's flags for ``arch`` as ``kernels.target_flags`` chooses them, less any
    ``native`` CPU choice when ``arch`` is not this machine's (``-mcpu=native`` means the
    build machine's CPU: cross compiling, the compiler's default CPU is the one to use)."""
    choices = kernels.target_flags(isa, arch)
    if arch != kernels.machine():
        choices = [c for c in choices if not any(flag.endswith("=native") for flag in c)]
    return choices[0]


def run(command: list[str], timeout: float = 300) -> str | None:
    """None if ``command`` exits 0, else its command line and its first error lines."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode == 0:
        return None
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()] or \
        done.stderr.splitlines()[-5:]
    return " ".join(command) + "\n    " + "\n    ".join(errors[:5])


def compile_objects(compiler: list[str], flags: list[str], sources: list[Path], out: Path) -> list[str]:
    """Compile each source to ``out/<stem>.o`` (in parallel: one compiler per core); the
    failures, each as its command line and first errors."""
    out.mkdir(parents=True, exist_ok=True)
    commands = [[*compiler, *flags, "-c", str(source), "-o", str(out / f"{source.stem}.o")]
                for source in sources]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return [error for error in pool.map(run, commands) if error is not None]
