"""Every environment variable microvllm reads, in one place (as vLLM's ``vllm/envs.py``).

    MICROVLLM_CACHE    where converted models and compiled CPU kernels live
                       (default: $XDG_CACHE_HOME/microvllm, else ~/.cache/microvllm)
    CXX                the C++ compiler for the CPU kernels (default: c++, g++ or clang++)
    TRITON_INTERPRET   1: run the Triton kernels in Triton's interpreter (on a CPU)
    MICROVLLM_MOE_IMPL how mixture-of-experts layers run their experts: iterative,
                       sorted or triton (default: triton on a GPU, sorted on a CPU)
    VLLM_XGRAMMAR_CACHE_MB   vLLM's name: the most memory compiled grammars may hold in
                       the grammar cache (default here 64; vLLM's is 512)
    VLLM_MAX_N_SEQUENCES     vLLM's name: the largest ``n`` the server accepts (default
                       here 64; vLLM's is 16384)
    VLLM_ENABLE_V1_MULTIPROCESSING   vLLM's name: 1 runs the engine core in a process of
                       its own (``SyncMPClient``), 0 in the caller's (``InprocClient``, which
                       a notebook can step); unset: 0 for ``LLM``, 1 for ``microvllm serve``
    VLLM_RPC_TIMEOUT   vLLM's name: milliseconds a call to an engine core in another process
                       (a utility: check_fits, reset_prefix_cache, ...) waits for its answer
                       (default here 300000, 5 min; vLLM's is 10000: a core answers between
                       two steps, and a step on a CPU can take seconds)
    VLLM_SERVER_DEV_MODE     vLLM's name: 1 adds the server's development endpoints
                       (``POST /reset_prefix_cache``); off by default, as any client could
                       otherwise empty every user's prefix cache
    VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT   vLLM's name: seconds a chat template that a request
                       brought may take to render (``--trust-request-chat-template``; default 30)
    VLLM_ALLOW_RUNTIME_LORA_UPDATING   vLLM's name: True adds ``POST /v1/load_lora_adapter``
                       and ``/v1/unload_lora_adapter``; off by default, as a client then
                       chooses a folder on the server's disk to load for every user

Each is read when it is used, not at import, so a notebook or a test can set it first.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$MICROVLLM_CACHE``, else ``$XDG_CACHE_HOME/microvllm``, else ``~/.cache/microvllm``::

        <cache_dir>/
            SmolLM2-135M-Instruct/       the embedded model, converted on first use
            cpu_kernels/<build key>/     the CPU platform's compiled kernels
    """
    if os.environ.get("MICROVLLM_CACHE"):
        return Path(os.environ["MICROVLLM_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "microvllm"


def cxx() -> str | None:
    """The compiler named by ``$CXX``, or None to look for one."""
    return os.environ.get("CXX") or None


CPU_ISAS = ("native", "avx512", "avx2", "portable")


def cpu_isa() -> str:
    """``$MICROVLLM_CPU_ISA``: the instruction set the CPU kernels are built for and may
    use (default ``native``, this CPU's best; ``avx512``, ``avx2`` or ``portable`` to build
    and test what another machine runs). Raises ValueError for any other value."""
    isa = os.environ.get("MICROVLLM_CPU_ISA", "native").strip().lower() or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"MICROVLLM_CPU_ISA={isa!r} is not a target: use one of {', '.join(CPU_ISAS)}")
    return isa


def triton_interpret() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def moe_impl() -> str | None:
    """``$MICROVLLM_MOE_IMPL`` (``layers/fused_moe/layer.py``), or None for the device's default."""
    return os.environ.get("MICROVLLM_MOE_IMPL", "").strip().lower() or None


def xgrammar_cache_bytes() -> int:
    """``$VLLM_XGRAMMAR_CACHE_MB`` in bytes (default 64 MiB): bounds xgrammar's own cache
    (in each compile worker) and the engine's cache of compiled grammars."""
    return int(float(os.environ.get("VLLM_XGRAMMAR_CACHE_MB", "64")) * (1 << 20))


def max_n_sequences() -> int:
    """``$VLLM_MAX_N_SEQUENCES`` (default 64): the largest ``n`` a server request may ask for."""
    return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "64"))


def server_dev_mode() -> bool:
    """``$VLLM_SERVER_DEV_MODE`` is 1: the server's development endpoints are on."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"


def chat_template_render_timeout() -> float:
    """``$VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT`` (vLLM's name, default 30): the seconds a chat
    template a request brought may take to render (``request_template.py``)."""
    return float(os.environ.get("VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT", "30"))


def allow_runtime_lora_updating() -> bool:
    """``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true (vLLM's switch)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes")


def enable_v1_multiprocessing(default: bool = False) -> bool:
    """``$VLLM_ENABLE_V1_MULTIPROCESSING`` (vLLM's switch, on there by default); unset:
    ``default`` (off for ``LLM``, so that a notebook can step the core; on for ``serve``)."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "").strip().lower()
    return default if not value else value in ("1", "true", "yes")


def rpc_timeout_s() -> float:
    """``$VLLM_RPC_TIMEOUT`` (vLLM's name, in milliseconds; default here 300000) in seconds:
    how long a utility call to an engine core in another process waits for its answer."""
    return float(os.environ.get("VLLM_RPC_TIMEOUT", "300000")) / 1000
