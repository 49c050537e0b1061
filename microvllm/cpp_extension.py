"""Compile a C++ kernel on first use and cache the library on disk (its wrapper loads it with ctypes).

microvllm's CPU kernels (``attention/cpu_kernels``, ``layers/cpu_kernels``) are plain
C++ with OpenMP and no torch headers, so each compiles in about a second with the
system compiler. A build is cached, keyed by everything that changes the binary
(source, shared headers, flags, compiler, this CPU's features)::

    $MICROVLLM_CACHE (default ~/.cache/microvllm, as for the default model)
        └── cpu_kernels/<key>/<name>.so

Tensors cross into C++ as raw pointers, so every kernel's Python wrapper checks
dtypes, shapes and contiguity first, because C++ cannot.

Two details that matter:

* ``-march=native`` uses this CPU's vector and matrix units (AVX-512, AMX); the CPU
  flags are in the cache key, so a shared home directory never hands one machine
  another's build.
* Libraries are compiled with ``-ffast-math`` (so ``exp`` vectorizes) but *linked*
  without it: GCC before 13 would otherwise link ``crtfastmath.o``, which switches the
  whole process to flush denormals to zero, torch included.

vLLM compiles its CPU kernels (``csrc/cpu/``) when it is installed; building on first
use instead keeps ``pip install`` free of a compiler step.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from microvllm.models.default_model import cache_dir

COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c++17"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # GCC vectorizes with 256-bit registers on AVX-512 CPUs unless asked; 512-bit made
    # the attention kernel 10% (float32) to 20% (bfloat16) faster on a Sapphire Rapids Xeon.
    COMPILE_FLAGS.append("-mprefer-vector-width=512")
INCLUDE_DIR = Path(__file__).with_name("csrc")   # headers shared by the kernels (dtypes.h)
COMPILE_FLAGS.append(f"-I{INCLUDE_DIR}")
LINK_FLAGS = ["-shared"]
OPENMP = ["-fopenmp"]   # dropped, with a warning, by a compiler that lacks it (Apple clang)
logger = logging.getLogger("microvllm")


# The dtype argument every kernel's C entry point takes (matching dtypes.h's types).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class KernelUnavailable(RuntimeError):
    """A C++ kernel could not be built or used here; the message says why."""


def unavailable_reason(load) -> str | None:
    """Call a kernel's ``load()``: None if it works here, else why not (for ``*_status``)."""
    try:
        load()
    except (KernelUnavailable, OSError) as error:
        return str(error)
    return None


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (``avx512f``, ``amx_bf16``, ...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load_library(source: Path, functions: dict[str, tuple], *, cpu_needs: tuple[str, ...] = (),
                 otherwise: str = "") -> ctypes.CDLL:
    """Build ``source`` (if needed) and load it with ctypes, declaring each C function
    ``name: (restype, argtypes)`` so that ctypes converts its arguments. With
    ``cpu_needs`` (``/proc/cpuinfo`` flags), a CPU that lacks any of them raises
    ``KernelUnavailable`` first: "this CPU lacks <flags><otherwise>"."""
    missing = [flag for flag in cpu_needs if flag not in cpu_flags()]
    if missing:
        raise KernelUnavailable(f"this CPU lacks {', '.join(missing)}{otherwise}")
    # torch is imported (above) before the library loads, so the library's OpenMP
    # calls bind to the runtime torch already loaded: one thread pool, not two.
    lib = ctypes.CDLL(str(build(source)))
    for name, (restype, argtypes) in functions.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def build(source: Path) -> Path:
    """Compile ``source`` into a shared library unless this exact build is cached;
    return the library's path. Raises ``KernelUnavailable`` saying what to fix."""
    compiler = _compiler()
    target = cache_dir() / "cpu_kernels" / _build_key(source, compiler) / f"{source.stem}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private temporary folder, then rename into place: concurrent builds
    # (a test process and a notebook kernel) never see a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        try:
            _compile(compiler, source, obj, lib, OPENMP)
        except KernelUnavailable as error:
            try:
                _compile(compiler, source, obj, lib, [])
            except KernelUnavailable:
                raise error from None
            logger.warning("%s was built without OpenMP (one thread): %s", source.name, error)
        os.replace(lib, target)
    return target


def _compiler() -> str:
    chosen = os.environ.get("CXX")
    if chosen:
        if shutil.which(chosen) is None:
            raise KernelUnavailable(f"CXX={chosen!r} is not a compiler found on this machine; "
                                    "fix CXX or unset it")
        return chosen
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    raise KernelUnavailable("no C++ compiler found: install g++ (or set CXX to one)")


def _build_key(source: Path, compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    parts = [source.read_bytes().decode(), *headers, " ".join(COMPILE_FLAGS + LINK_FLAGS + OPENMP), version,
             platform.machine(), " ".join(sorted(cpu_flags())) or platform.processor()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _compile(compiler: str, source: Path, obj: Path, lib: Path, openmp: list[str]) -> None:
    for command in ([compiler, *COMPILE_FLAGS, *openmp, "-c", str(source), "-o", str(obj)],
                    [compiler, *LINK_FLAGS, *openmp, str(obj), "-o", str(lib)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailable(f"compiling {source.name} failed:\n  {' '.join(command)}\n"
                                    f"{done.stderr.strip()[-2000:]}")


def profiled(name: str):
    """A named range for torch.profiler around a kernel call, since a ctypes call is not a
    torch operator and a profile would not show it otherwise; ``bench throughput
    --profile`` counts these. Nothing when no profiler runs: a range costs ~10 us, which
    is a few percent of a small decode step over its ~200 kernel calls."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
