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

Three details that matter:

* The target, ``MICROVLLM_CPU_ISA`` (``envs.cpu_isa``), decides the instructions the
  kernels are compiled for *and* the CPU features every run-time check may see
  (``isa_flags``), so one machine can build and test what a laptop runs::

      native     this CPU's best: -march=native on x86, -mcpu=native on arm64 (no flag
                 where the compiler rejects it: Apple clang before 15)
      avx512     x86-64-v4: AVX-512 F/BW/CD/DQ/VL (no AMX, no AVX512-BF16)
      avx2       x86-64-v3: AVX2, FMA, F16C: most x86 laptops
      portable   the architecture's baseline, and no intrinsics at all (MICROVLLM_PORTABLE):
                 the plain loops every kernel keeps

  ``vec.h`` gives the kernels one float vector type per target (16, 8 or 4 lanes), and
  a file written for one instruction set (AMX, AVX-512) compiles to an empty body
  elsewhere, so every file builds for every target. The target and the CPU flags are
  in the cache key, so a shared home directory never hands one machine another's build.
* A build that fails is remembered (``<name>.failed`` beside where the library would
  be), so later processes do not pay for the compiler again; each fallback is said
  once on stderr (``warn_fallback``): what fell back, the compiler's first error line,
  and what it costs. ``python -m microvllm collect-env`` lists it all.
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
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from microvllm import envs

CSRC = Path(__file__).parents[2] / "csrc"     # every .cpp and .h of the package
# The flags every build shares; the target's own (-march and so on) are added by
# compile_flags().
COMPILE_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-std=c++17", f"-I{CSRC}"]
LINK_FLAGS = ["-shared"]
logger = logging.getLogger(__name__)


def machine() -> str:
    """``x86_64`` or ``aarch64`` (what Linux calls them; macOS says ``arm64``), else as reported."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def target_flags(isa: str, arch: str | None = None) -> list[list[str]]:
    """The target's compiler flags for ``arch`` (default: this machine's), as choices in
    order: the first that the compiler accepts is used (an arm64 ``-mcpu=native`` that an
    older Apple clang rejects falls back to the compiler's default CPU, which has NEON)."""
    arch = arch or machine()
    portable = ["-DMICROVLLM_PORTABLE"]
    if arch == "x86_64":
        return {"native": [["-march=native", "-mprefer-vector-width=512"]],
                # GCC vectorizes with 256-bit registers on AVX-512 CPUs unless asked; the
                # kernels' loops are written for 512-bit ones.
                "avx512": [["-march=x86-64-v4", "-mprefer-vector-width=512"]],
                "avx2": [["-march=x86-64-v3"]],
                "portable": [["-march=x86-64", *portable]]}[isa]
    if isa in ("avx512", "avx2"):
        raise KernelUnavailable(f"MICROVLLM_CPU_ISA={isa} is an x86 target and this machine is {arch}: "
                                "use native or portable", expected=True)
    if isa == "portable":
        return [portable]
    return [["-mcpu=native"], []] if arch == "aarch64" else [["-march=native"], []]


# x86 targets: the /proc/cpuinfo flags a CPU must have to run the target's code, and
# the flags the target's code may use (a run-time check sees only those).
_X86_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"},
              "avx2": {"avx2", "fma", "f16c"}}
_X86_V4_AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def isa_flags() -> set[str]:
    """The CPU flags (``cpu_flags`` names) the chosen target lets kernels use: all of this
    CPU's for ``native``; without AMX and past-v4 AVX-512 for ``avx512``; without any
    AVX-512 for ``avx2``; without AVX, FMA and F16C for ``portable``."""
    isa, flags = envs.cpu_isa(), cpu_flags()
    if isa == "native":
        return flags
    def dropped(flag):
        if flag.startswith("amx"):
            return True
        if isa == "avx512":
            return flag.startswith("avx512") and flag not in _X86_V4_AVX512
        if isa == "avx2":
            return flag.startswith(("avx512", "avx_vnni"))
        return flag.startswith(("avx", "fma", "f16c"))   # portable
    return {flag for flag in flags if not dropped(flag)}


def check_target(isa: str | None = None) -> None:
    """Raise ``KernelUnavailable`` if target ``isa`` (default: the chosen one) cannot run on
    this CPU (code built for AVX-512 would die of an illegal instruction on an AVX2 laptop)."""
    isa = isa or envs.cpu_isa()
    needs = _X86_NEEDS.get(isa, set()) if machine() == "x86_64" else set()
    target_flags(isa)   # an x86 target on another architecture raises here
    flags = cpu_flags()
    missing = sorted(needs - flags) if flags else []
    if missing:
        raise KernelUnavailable(f"MICROVLLM_CPU_ISA={isa} needs {', '.join(missing)}, which this CPU "
                                "lacks: unset it (native) or choose avx2 / portable", expected=True)


def compile_flags(compiler: str | None = None, isa: str | None = None) -> list[str]:
    """Every compile flag for target ``isa`` (default: the chosen one) with ``compiler``
    (default: the one used): the shared ones and the first of the target's choices that
    this compiler accepts."""
    compiler = compiler or _compiler()
    choices = target_flags(isa or envs.cpu_isa())
    for flags in choices:
        if _probe(compiler, tuple(flags)) is None:
            return [*COMPILE_FLAGS, *flags]
    raise KernelUnavailable(_probe(compiler, tuple(choices[0])) or "the compiler failed")


def openmp_choices(compiler: str) -> list[tuple[list[str], list[str]]]:
    """(compile flags, link flags) for OpenMP, in the order tried: ``-fopenmp``; on macOS
    Apple clang's ``-Xpreprocessor -fopenmp`` against the libomp that torch ships; and last
    none (one thread: the kernels compile without it, and say so)."""
    choices = [(["-fopenmp"], ["-fopenmp"])]
    torch_lib = Path(torch.__file__).parent / "lib"
    if sys.platform == "darwin" and (torch_lib / "libomp.dylib").exists():
        choices.append((["-Xpreprocessor", "-fopenmp"],
                        [f"-L{torch_lib}", "-lomp", f"-Wl,-rpath,{torch_lib}"]))
    choices.append(([], []))
    return choices


# The dtype argument every kernel's C entry point takes (matching dtypes.h's types).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class Library:
    """One kernel library: ``csrc/<name>.cpp``, the CPU flags it needs (``/proc/cpuinfo``
    names, as ``isa_flags`` filters them) and what runs without it (``otherwise``, said
    in every reason and warning); ``init``: a C function to call once after loading (it
    returns 0, or else the library is refused with ``init_error``)."""

    otherwise: str
    needs: tuple[str, ...] = ()
    init: str | None = None
    init_error: str = ""


LIBRARIES = {
    "norm_rope": Library("RMSNorm and RoPE run in torch"),
    "activation": Library("SiLU-and-mul runs in torch"),
    "argmax": Library("greedy sampling runs torch.argmax"),
    "paged_attention": Library("attention runs the torch backend and the decode fast path is off"),
    "prefill_attention": Library("prefill attention runs torch's SDPA"),
    "vec_linear": Library("float32 projections use oneDNN and MKL, and the float32 decode fast path is off"),
    "amx_linear": Library("bfloat16 projections use dpbf16_linear (AVX512-BF16) where the CPU has it, "
                          "else oneDNN",
                          needs=("amx_tile", "amx_bf16", "avx512_bf16"), init="amx_init",
                          init_error="Linux refused this process the AMX tile registers "
                                     "(arch_prctl ARCH_REQ_XCOMP_PERM needs Linux 5.16 or newer)"),
    "dpbf16_linear": Library("bfloat16 projections use oneDNN, and the bfloat16 decode fast path is off "
                             "(unless the CPU has AMX)", needs=("avx512_bf16", "avx512bw")),
    "decode_layers": Library("the decode fast path is off"),
    "quantized_linear": Library("GGUF and int8 weights are dequantized in torch at every call "
                                "(measured 0.04x of the kernel at batch 1)"),
}
# What the whole engine costs without any kernel (the embedded model, greedy, batch 1-32,
# on an AVX-512 and on an AVX2 build): said when no kernel can be built at all.
WITHOUT_KERNELS = "about 0.7x the speed, the same tokens"


class KernelUnavailable(RuntimeError):
    """A C++ kernel could not be built or used here; the message says why. ``expected``:
    the CPU or the chosen target simply lacks its instructions (nothing to fix, so no
    warning), as opposed to a build that failed."""

    def __init__(self, message: str, expected: bool = False):
        super().__init__(message)
        self.expected = expected
        self.compiler_error = message.splitlines()[0] if message else ""   # the compiler's first error line


@lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL:
    """Build ``csrc/<name>.cpp`` (if needed) and load it, once per process, with every C
    function it defines declared from ``ops.h``. Raises ``KernelUnavailable`` saying why
    it cannot be used here."""
    library = LIBRARIES[name]
    check_target()
    missing = [flag for flag in library.needs if flag not in isa_flags()]
    if missing:
        where = "this CPU" if envs.cpu_isa() == "native" else f"MICROVLLM_CPU_ISA={envs.cpu_isa()}"
        raise KernelUnavailable(f"{where} lacks {', '.join(missing)}: {library.otherwise}", expected=True)
    # torch is imported (above) before the library loads, so the library's OpenMP
    # calls bind to the runtime torch already loaded: one thread pool, not two.
    lib = ctypes.CDLL(str(build(CSRC / f"{name}.cpp")))
    for function, (restype, argtypes) in signatures().items():
        if hasattr(lib, function):   # the functions this library defines
            fn = getattr(lib, function)
            fn.restype, fn.argtypes = restype, argtypes
    if library.init is not None and getattr(lib, library.init)() != 0:
        raise KernelUnavailable(library.init_error, expected=True)
    return lib


@lru_cache(maxsize=None)
def status(name: str) -> str | None:
    """None if the ``name`` library builds and loads here, else the reason it does not.
    A reason that is not just the CPU lacking an instruction set is also said once on
    stderr (``warn_fallback``)."""
    try:
        load(name)
    except (KernelUnavailable, OSError) as error:
        if not getattr(error, "expected", False):
            warn_fallback(name, str(error))
        return str(error)
    return None


_warned: set[str] = set()


def warn_fallback(name: str, reason: str, what: str | None = None) -> None:
    """Say on stderr, once per reason, that kernel ``name`` fell back: ``what`` runs
    instead (default: the library's ``otherwise``) and why (the reason's first line: the
    compiler's first error)."""
    first = next((line.strip() for line in reason.splitlines() if line.strip()), "no reason given")
    if first in _warned:
        return
    _warned.add(first)
    if reason.startswith(_NO_COMPILER):
        what = f"no C++ kernel can be built, so the engine runs on torch ops ({WITHOUT_KERNELS})"
    elif what is None:
        what = f"the {name} kernel is not used: {LIBRARIES[name].otherwise}"
    # Straight to stderr, not through logging: the package's logger has no handler
    # unless the CLI set one up, and a notebook must show this too.
    print(f"microvllm warning: {what}. Why: {first}. "
          "(`python -m microvllm collect-env` lists every kernel and its route.)", file=sys.stderr)


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


_NO_COMPILER = "no C++ kernel builds"   # how a reason that stops every library starts


def build(source: Path, isa: str | None = None) -> Path:
    """Compile ``source`` for target ``isa`` (default: the chosen one) into a shared
    library unless this exact build is cached (or failed before: the failure is
    remembered beside it); return the library's path. Raises ``KernelUnavailable``
    saying what to fix. (Tests build other targets' libraries with ``isa``; only
    ``load`` checks that this CPU can run them.)"""
    compiler, isa = _compiler(), isa or envs.cpu_isa()
    flags = compile_flags(compiler, isa)
    folder = envs.cache_dir() / "cpu_kernels" / _build_key(source, compiler, flags, isa)
    target, failed = folder / f"{source.stem}.so", folder / f"{source.stem}.failed"
    if target.exists():
        return target
    if failed.exists():
        raise KernelUnavailable(f"{failed.read_text()}\n(remembered from an earlier build: "
                                f"delete {failed} to try again)")
    folder.mkdir(parents=True, exist_ok=True)
    # Build in a private temporary folder, then rename into place: concurrent builds
    # (a test process and a notebook kernel) never see a half-written library.
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        first_error = None
        for openmp_compile, openmp_link in openmp_choices(compiler):
            try:
                _compile(compiler, source, obj, lib, flags + openmp_compile, LINK_FLAGS + openmp_link)
                break
            except KernelUnavailable as error:
                first_error = first_error or error
        else:
            failed.write_text(str(first_error))
            raise first_error
        if not openmp_compile:   # one warning for all the libraries: the compiler's error is the same
            warn_fallback(source.stem, first_error.compiler_error,
                          "the kernels are built without OpenMP, so each runs on one thread (install "
                          "libomp, or a compiler with OpenMP)")
        os.replace(lib, target)
    return target


def _compiler() -> str:
    chosen = envs.cxx()
    if chosen:
        if shutil.which(chosen) is None:
            raise KernelUnavailable(f"{_NO_COMPILER}: CXX={chosen!r} is not a compiler found on this "
                                    "machine; fix CXX or unset it")
        return chosen
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    raise KernelUnavailable(f"{_NO_COMPILER}: no C++ compiler found: install g++ or clang++ (or set CXX to one)")


@lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    """``compiler --version``, asked once per process (each library's build key needs it)."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""


@lru_cache(maxsize=None)
def _probe(compiler: str, flags: tuple[str, ...]) -> str | None:
    """None if ``compiler`` builds an empty library with ``flags``, else why not (the
    reason starts with ``_NO_COMPILER``: a compiler that cannot do this builds nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text("extern \"C\" int microvllm_probe() { return 0; }\n")
        try:
            _compile(compiler, source, Path(tmp) / "probe.o", Path(tmp) / "probe.so",
                     [*COMPILE_FLAGS, *flags], LINK_FLAGS)
        except KernelUnavailable as error:
            return f"{_NO_COMPILER}: {error}"
    return None


def _build_key(source: Path, compiler: str, flags: list[str], isa: str) -> str:
    version = _compiler_version(compiler)
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]
    parts = [source.read_bytes().decode(), *headers, " ".join(flags + LINK_FLAGS), compiler, version,
             isa, machine(), " ".join(sorted(cpu_flags())) or platform.processor()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _compile(compiler: str, source: Path, obj: Path, lib: Path, compile_flags: list[str],
             link_flags: list[str]) -> None:
    for command in ([compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
                    [compiler, *link_flags, str(obj), "-o", str(lib)]):
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            raise KernelUnavailable(f"running {compiler} failed: {error}") from None
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
            first = errors[0].strip() if errors else (done.stderr.strip().splitlines() or [
                f"{compiler} exited with status {done.returncode} and printed nothing"])[0]
            error = KernelUnavailable(f"compiling {source.name} failed: {first}\n  {' '.join(command)}\n"
                                      f"{done.stderr.strip()[-2000:]}")
            error.compiler_error = first
            raise error


def profiled(name: str):
    """A named range for torch.profiler around a kernel call, since a ctypes call is not a
    torch operator and a profile would not show it otherwise; ``bench throughput
    --profile`` counts these. Nothing when no profiler runs: a range costs ~10 us, which
    is a few percent of a small decode step over its ~200 kernel calls."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
