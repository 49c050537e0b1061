"""Build, cache and call the C++ paged-attention kernel for CPUs (``paged_attention.cpp``).

The kernel is plain C++ with OpenMP and no torch headers, so it compiles in about a
second with the system compiler. The build is cached on disk, keyed by everything
that changes the binary (source, flags, compiler, this CPU's features)::

    $MICROVLLM_CACHE_DIR (default ~/.cache/microvllm)/cpu_kernels/<key>/paged_attention.so

and loaded with ctypes. Tensors cross as raw pointers; the Python side checks their
dtypes, shapes and contiguity first, because C++ cannot.

Two details that matter:

* ``-march=native`` uses this CPU's vector units (AVX-512 here); the CPU flags are in
  the cache key, so a shared home directory never hands one machine another's build.
* The library is compiled with ``-ffast-math`` (so ``exp`` vectorizes) but *linked*
  without it: GCC before 13 would otherwise link ``crtfastmath.o``, which switches the
  whole process to flush denormals to zero, torch included.

``kernel_status()`` says whether the kernel can be used here and, if not, why; the
``"auto"`` backend falls back to the torch one in that case.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_attention.cpp")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c++17"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # GCC vectorizes with 256-bit registers on AVX-512 CPUs unless asked; 512-bit made
    # the kernel 10% (float32) to 20% (bfloat16) faster on a Sapphire Rapids Xeon.
    COMPILE_FLAGS.append("-mprefer-vector-width=512")
LINK_FLAGS = ["-shared"]
OPENMP = ["-fopenmp"]   # dropped, with a warning, by a compiler that lacks it (Apple clang)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
logger = logging.getLogger("microvllm")


class KernelUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    root = os.environ.get("MICROVLLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "microvllm"


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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    parts = [SOURCE.read_bytes().decode(), " ".join(COMPILE_FLAGS + LINK_FLAGS + OPENMP), version,
             platform.machine(), _cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def build() -> Path:
    """Compile ``paged_attention.cpp`` unless this exact build is cached; return the .so path."""
    compiler = _compiler()
    target = cache_dir() / "cpu_kernels" / _build_key(compiler) / "paged_attention.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private temporary folder, then rename into place: concurrent builds
    # (a test process and a notebook kernel) never see a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_attention.o", Path(tmp) / "paged_attention.so"
        try:
            _compile(compiler, obj, lib, OPENMP)
        except KernelUnavailable as error:
            try:
                _compile(compiler, obj, lib, [])
            except KernelUnavailable:
                raise error from None
            logger.warning("the CPU attention kernel was built without OpenMP (one thread): %s", error)
        os.replace(lib, target)
    return target


def _compile(compiler: str, obj: Path, lib: Path, openmp: list[str]) -> None:
    for command in ([compiler, *COMPILE_FLAGS, *openmp, "-c", str(SOURCE), "-o", str(obj)],
                    [compiler, *LINK_FLAGS, *openmp, str(obj), "-o", str(lib)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailable(f"compiling the CPU attention kernel failed:\n  {' '.join(command)}\n"
                                    f"{done.stderr.strip()[-2000:]}")


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """Build (if needed) and load the kernel library, once per process."""
    # torch is imported (above) before the library loads, so the library's OpenMP
    # calls bind to the runtime torch already loaded: one thread pool, not two.
    lib = ctypes.CDLL(str(build()))
    fn = lib.paged_attention_decode
    fn.restype = None
    fn.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 7
                   + [ctypes.c_float, ctypes.c_int])
    return lib


@functools.lru_cache(maxsize=None)
def kernel_status() -> str | None:
    """None if the kernel is usable on this machine, else the reason it is not."""
    try:
        load()
    except (KernelUnavailable, OSError) as error:
        return str(error)
    return None


def check_inputs(query, kv_cache, block_table, seq_lens, out) -> None:
    if query.dtype not in DTYPE_CODES:
        raise TypeError(f"the CPU attention kernel supports {sorted(map(str, DTYPE_CODES))}, "
                        f"not {query.dtype}")
    if kv_cache.dtype != query.dtype or out.dtype != query.dtype:
        raise TypeError(f"query, kv_cache and out must share a dtype; got {query.dtype}, "
                        f"{kv_cache.dtype}, {out.dtype}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_table and seq_lens must be int32")
    for name, t in (("query", query), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("out", out)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    num_reqs, num_heads, head_dim = query.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, {head_dim}], "
                         f"got {list(kv_cache.shape)}")
    if num_heads % kv_cache.shape[3]:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={kv_cache.shape[3]}")
    if block_table.shape[0] < num_reqs or seq_lens.shape[0] < num_reqs or out.shape != query.shape:
        raise ValueError("block_table, seq_lens and out must have a row per query")
    if num_reqs:
        longest, room = int(seq_lens[:num_reqs].max()), block_table.shape[1] * kv_cache.shape[2]
        if longest > room:  # the kernel would read past the table's row
            raise ValueError(f"seq_lens reach {longest} tokens but block_table holds {room}")


def paged_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           sliding_window: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention straight from the paged cache (see ``paged_attention.cpp``).

    ``query [num_reqs, num_heads, head_dim]``: request ``i``'s one query token attends
    over its ``seq_lens[i]`` cached tokens, found through ``block_table[i]``. Positions
    in ``seq_lens`` must fit the table (checked) and the block ids in it must be valid
    (trusted, as every paged-attention kernel does).
    """
    if out is None:
        out = torch.empty_like(query)
    check_inputs(query, kv_cache, block_table, seq_lens, out)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_reqs, num_heads, _ = query.shape
    if num_reqs:
        # Named for torch.profiler: a ctypes call is not a torch operator, so it would
        # otherwise be invisible in a profile (bench throughput --profile counts it).
        with torch.profiler.record_function("microvllm::paged_attention_decode"):
            load().paged_attention_decode(
                DTYPE_CODES[query.dtype], query.data_ptr(), kv_cache.data_ptr(),
                block_table.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads,
                num_kv_heads, head_dim, block_size, num_blocks, block_table.shape[1], scale,
                sliding_window or 0)
    return out
