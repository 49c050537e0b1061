"""Build, cache and load the CPU platform's C++ kernels: the one module that does.

Every kernel is plain C++ with OpenMP and no torch headers (all in ``microvllm/csrc/``), so
each compiles in about a second with the system compiler on first use. A build is
cached, keyed by everything that changes the binary (source, headers, flags, compiler,
this CPU's features)::

    envs.cache_dir()  (default ~/.cache/microvllm)
        └── cpu_kernels/<key>/<name>.so

``load(name)`` returns the library with every C function declared for ctypes. The
declarations are read from ``csrc/ops.h``, the one place each C signature is written
(the kernels' .cpp files include it, so the compiler holds them to it)::

    ops.h    void rms_norm(int dtype, const void* x, void* residual, ..., float eps);
    ctypes   lib.rms_norm.argtypes = [c_int, c_void_p, c_void_p, ..., c_float]

Tensors cross into C++ as raw pointers, so every kernel's Python wrapper checks dtypes,
shapes and contiguity first, because C++ cannot.

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
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from microvllm import envs

COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c++17"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # GCC vectorizes with 256-bit registers on AVX-512 CPUs unless asked; the kernels'
    # loops are written for 512-bit ones.
    COMPILE_FLAGS.append("-mprefer-vector-width=512")
CSRC = Path(__file__).parents[2] / "csrc"     # every .cpp and .h of the package
COMPILE_FLAGS.append(f"-I{CSRC}")
LINK_FLAGS = ["-shared"]
OPENMP = ["-fopenmp"]   # dropped, with a warning, by a compiler that lacks it (Apple clang)
logger = logging.getLogger(__name__)


# The dtype argument every kernel's C entry point takes (matching dtypes.h's types).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class Library:
    """One kernel library: ``csrc/<name>.cpp``, the CPU flags it needs (``/proc/cpuinfo``
    names) and what runs without it; ``init``: a C function to call once after loading
    (it returns 0, or else the library is refused with ``init_error``)."""

    needs: tuple[str, ...] = ()
    otherwise: str = ""
    init: str | None = None
    init_error: str = ""


LIBRARIES = {
    "norm_rope": Library(),            # RMSNorm (+ residual add) and RoPE
    "activation": Library(),           # silu_and_mul
    "argmax": Library(),               # greedy sampling
    "paged_attention": Library(),      # write_kv and decode attention
    "prefill_attention": Library(),    # prefill chunks (tiles need AVX-512; see prefill_supported)
    "avx512_linear": Library(("avx512f",), ": float32 projections use oneDNN and MKL instead"),
    "amx_linear": Library(("amx_tile", "amx_bf16", "avx512_bf16"),
                          " (AMX): bfloat16 projections use oneDNN instead", init="amx_init",
                          init_error="Linux refused this process the AMX tile registers "
                                     "(arch_prctl ARCH_REQ_XCOMP_PERM needs Linux 5.16 or newer)"),
    "decode_layers": Library(),        # the decode fast path's layer loop
    "quantized_linear": Library(),     # GGUF Q4_1 / Q8_0 and int8 weights (AVX-512, else plain loops)
}


class KernelUnavailable(RuntimeError):
    """A C++ kernel could not be built or used here; the message says why."""


@lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL:
    """Build ``csrc/<name>.cpp`` (if needed) and load it, once per process, with every C
    function it defines declared from ``ops.h``. Raises ``KernelUnavailable`` saying why
    it cannot be used here."""
    library = LIBRARIES[name]
    missing = [flag for flag in library.needs if flag not in cpu_flags()]
    if missing:
        raise KernelUnavailable(f"this CPU lacks {', '.join(missing)}{library.otherwise}")
    # torch is imported (above) before the library loads, so the library's OpenMP
    # calls bind to the runtime torch already loaded: one thread pool, not two.
    lib = ctypes.CDLL(str(build(CSRC / f"{name}.cpp")))
    for function, (restype, argtypes) in signatures().items():
        if hasattr(lib, function):   # the functions this library defines
            fn = getattr(lib, function)
            fn.restype, fn.argtypes = restype, argtypes
    if library.init is not None and getattr(lib, library.init)() != 0:
        raise KernelUnavailable(library.init_error)
    return lib


@lru_cache(maxsize=None)
def status(name: str) -> str | None:
    """None if the ``name`` library builds and loads here, else the reason it does not."""
    try:
        load(name)
    except (KernelUnavailable, OSError) as error:
        return str(error)
    return None


_C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"^(void|int) (\w+)\((.*)\);$")


@lru_cache(maxsize=None)
def signatures() -> dict[str, tuple]:
    """``{name: (restype, argtypes)}`` for every prototype in ``csrc/ops.h`` (pointers of
    any type cross as ``c_void_p``)."""
    result = {}
    for line in (CSRC / "ops.h").read_text().splitlines():
        match = _PROTOTYPE.match(line.strip())
        if match is None:
            continue
        restype, name, params = match.groups()
        argtypes = []
        for param in filter(None, (p.strip() for p in params.split(","))):
            kind = param.rsplit(" ", 1)[0].replace("const ", "").strip()
            argtypes.append(ctypes.c_void_p if "*" in param else _C_TYPES[kind])
        result[name] = (None if restype == "void" else ctypes.c_int, argtypes)
    return result


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (``avx512f``, ``amx_bf16``, ...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build(source: Path) -> Path:
    """Compile ``source`` into a shared library unless this exact build is cached;
    return the library's path. Raises ``KernelUnavailable`` saying what to fix."""
    compiler = _compiler()
    target = envs.cache_dir() / "cpu_kernels" / _build_key(source, compiler) / f"{source.stem}.so"
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
    chosen = envs.cxx()
    if chosen:
        if shutil.which(chosen) is None:
            raise KernelUnavailable(f"CXX={chosen!r} is not a compiler found on this machine; "
                                    "fix CXX or unset it")
        return chosen
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    raise KernelUnavailable("no C++ compiler found: install g++ (or set CXX to one)")


@lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    """``compiler --version``, asked once per process (each library's build key needs it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _build_key(source: Path, compiler: str) -> str:
    version = _compiler_version(compiler)
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]
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
