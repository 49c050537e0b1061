"""The CPU platform's GEMM for ``Linear``: weights packed once, not at every call.

A BLAS library multiplies ``x [M, K] @ W.T`` by first copying ``W`` into a
cache-friendly tiled layout ("packing"), then running its micro-kernel over the
tiles. ``torch.nn.functional.linear`` packs the weight again at every call. For a
prefill (M in the hundreds) that copy is small next to the arithmetic; for a
decode step (M = number of running requests, often 1-32) it is a large share of
the time, since every one of the model's weights is copied once more per step::

    F.linear(x, W)            pack W ──> multiply          (every call)
    PackedGemm(W)(x)          pack W once ──> multiply     (every call reuses the pack)

Pre-packing is what vLLM's CPU backend does too (``dispatch_cpu_unquantized_gemm``:
oneDNN with a pre-packed weight, or on AMX CPUs ``weight_packed_linear`` from SGLang).
Here it uses the oneDNN operators PyTorch's own compiler uses for the same purpose
(``torch.ops.mkldnn``), and, at decode sizes, where the weights are the traffic, our
own kernels (``gemm_kernels.py``) where the CPU has their instructions. Each call picks
by dtype and row count (notebook 11 measures why these bounds)::

    rows per call                     1-2        3-32       33-64      65-256     >256
    float32, AVX-512 / AVX2 / NEON    vec        vec        vec        oneDNN     F.linear *
    float32 elsewhere                 F.linear   oneDNN     oneDNN     oneDNN     F.linear *
    float32, x86 torch below AVX2     F.linear   F.linear   F.linear   F.linear   F.linear
    bfloat16, AMX CPU                 AMX        AMX        oneDNN     oneDNN     oneDNN
    bfloat16, AVX512-BF16, no AMX     dpbf16     dpbf16     dpbf16     oneDNN     oneDNN
    bfloat16 elsewhere                oneDNN     oneDNN     oneDNN     oneDNN     oneDNN
    bfloat16, no AVX-512 (AVX2 only)  F.linear   F.linear   F.linear   F.linear   F.linear **

(* oneDNN on x86 CPUs not made by Intel: F.linear is MKL there, ``float32_max_rows``.
** oneDNN's bfloat16 pack needs avx512bw/vl/dq or avx_ne_convert: an AVX2 laptop or a Zen 3
server has neither, ``bfloat16_onednn_available``.)
A weight's packs are all made at load time: one more copy of the weights, for never
being slower. On any other device or dtype, with autograd on, or where oneDNN is
missing, ``F.linear`` runs: the same result up to float rounding (~1e-6 relative in
float32; bfloat16 measured bit-identical).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from microvllm.platforms.cpu import gemm_kernels, kernels

_PACKED_DTYPES = (torch.float32, torch.bfloat16)
# float32 inputs with fewer rows than this use F.linear, if not the vector kernel (see above);
# and with more rows than FLOAT32_MAX_ROWS, where F.linear's MKL runs on its own vendor's CPU
# (``float32_max_rows``).
FLOAT32_MIN_ROWS, FLOAT32_MAX_ROWS = 3, 256
# Inputs with at most this many rows use our kernels, where they are usable.
AMX_MAX_ROWS = 32          # bfloat16
# bfloat16 through vdpbf16ps (no AMX): SmolLM2's projections on a 2-core AMD EPYC (Zen 4),
# 1-32 rows 1.1-1.4x oneDNN's bfloat16 GEMM, 64 rows level, 128 level (so the decode fast
# path, which needs the kernel, reaches 64 requests).
DPBF16_MAX_ROWS = 64
# float32: the same bound for every vector width. With torch capped to AVX2 as well
# (MICROVLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) the 8-lane
# kernel still beat oneDNN at every row count from 1 to 64 on three model shapes.
VEC_MAX_ROWS = 64


def packing_available() -> bool:
    """Whether this PyTorch build has the oneDNN linear operators used here."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_AVAILABLE = packing_available()


@functools.lru_cache(maxsize=None)
def bfloat16_onednn_available() -> bool:
    """Whether oneDNN's bfloat16 linear runs on this CPU (its reorder refuses CPUs without
    avx512bw/vl/dq or avx_ne_convert: "bf16 path needs the cpu support ...")."""
    is_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(is_supported()) if is_supported is not None else False


@functools.lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... (x86 Linux's /proc/cpuinfo); "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def float32_max_rows() -> int | None:
    """The most rows a float32 input sends to oneDNN's pack; None: no bound. Above it
    F.linear runs, which is Intel's MKL for float32 on x86. Measured with SmolLM2's
    projections, 2 threads: on a Sapphire Rapids Xeon MKL beat oneDNN's pack above 256
    rows; on an AMD EPYC (Zen 4, AVX-512) oneDNN's pack was the faster at every row count,
    218 against 190 GFLOP/s from 512 to 2,048 rows (prefill chunks). So the bound stays
    only where MKL is on its own vendor's CPU, and wherever the vendor is not known."""
    if kernels.machine() == "x86_64" and cpu_vendor() not in ("GenuineIntel", ""):
        return None
    return FLOAT32_MAX_ROWS


@functools.lru_cache(maxsize=None)
def _float32_bound() -> int | None:
    """``float32_max_rows``, decided once per process: ``_choose`` runs for every projection
    of every step."""
    return float32_max_rows()


def float32_onednn_pays() -> bool:
    """Whether oneDNN's packed float32 GEMM is used at all here. The bounds above were
    measured with torch at AVX2 or better; on x86 with torch's kernels below AVX2 (a CPU
    without it, or ATEN_CPU_CAPABILITY=default) MKL's own F.linear was the faster one:
    the embedded model's float32 decode at batch 32, with ATen, oneDNN and MKL capped to
    SSE4 (``bench targets``' portable target), 168-176 tok/s through F.linear against 158
    through oneDNN's pack."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return not (kernels.machine() == "x86_64" and capability == "DEFAULT")


class PackedGemm:
    """``y = x @ weight.T (+ bias)`` with ``weight`` packed once, for oneDNN and for our
    kernel (AMX tiles or vdpbf16ps panels for bfloat16, vector panels for float32) where the CPU has it;
    each call uses the pack that suits its row count.

    The packs are copies: they are rebuilt whenever the weight changes (another tensor,
    another dtype, or an in-place update such as loading a checkpoint), so callers
    never see a stale result."""

    def __init__(self):
        self._key: tuple | None = None                # identifies the weight the packs are of
        self._kinds: list[str] = []                   # the packs that weight can use here
        self._packs: dict[str, torch.Tensor] = {}     # "amx" / "dpbf16" / "vec" / "onednn" -> pack

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        kind = self._choose(x, weight, bias)
        if kind is None:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        if kind == "amx":
            out = gemm_kernels.amx_linear(rows, self._pack(weight, kind), bias)
        elif kind == "dpbf16":
            out = gemm_kernels.dpbf16_linear(rows, self._pack(weight, kind), bias)
        elif kind == "vec":
            out = gemm_kernels.vec_linear(rows, self._pack(weight, kind), bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self._pack(weight, kind), bias,
                                                     "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])

    def prepack(self, weight: torch.Tensor) -> None:
        """Make every pack ``weight`` can use here now (the loader does, as vLLM packs at
        load time), so that no step pays for one; a no-op where packing does not apply."""
        for kind in self._refresh(weight):
            self._pack(weight, kind)

    def packings(self, weight: torch.Tensor) -> list[str]:
        """The packs ``weight`` can use here (``"amx"``, ``"dpbf16"`` or ``"vec"``, ``"onednn"``)."""
        return self._refresh(weight)

    def pack(self, weight: torch.Tensor, kind: str) -> torch.Tensor:
        """``weight``'s ``kind`` pack, as a call would use it now (remade if ``weight``
        changed); for callers that run the kernel themselves (``DecodeFastPath``)."""
        if kind not in self._refresh(weight):
            raise ValueError(f"a {weight.dtype} {list(weight.shape)} weight has no {kind!r} pack here")
        return self._pack(weight, kind)

    def _choose(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> str | None:
        """The pack this call uses (see the table above), or None for ``F.linear``."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not (x.device.type == "cpu" and x.dtype == weight.dtype and rows > 0
                and x.shape[-1] == weight.shape[1] and (bias is None or bias.dtype == weight.dtype)
                and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                         for t in (x, weight, bias)))):
            return None
        kinds = self._refresh(weight)
        if "amx" in kinds and rows <= AMX_MAX_ROWS:
            return "amx"
        if "dpbf16" in kinds and rows <= DPBF16_MAX_ROWS:
            return "dpbf16"
        if "vec" in kinds and rows <= VEC_MAX_ROWS:
            return "vec"
        if weight.dtype == torch.float32 and (rows < FLOAT32_MIN_ROWS or rows > (_float32_bound() or rows)):
            return None
        return "onednn" if "onednn" in kinds else None

    def _refresh(self, weight: torch.Tensor) -> list[str]:
        """The packs ``weight`` can use here, worked out once per weight; a changed weight
        drops the old packs."""
        key = (weight.data_ptr(), weight.dtype, tensor_version(weight), tuple(weight.shape))
        if key != self._key:
            self._key, self._kinds, self._packs = key, _packings(weight), {}
        return self._kinds

    def _pack(self, weight: torch.Tensor, kind: str) -> torch.Tensor:
        """The ``kind`` pack of ``weight`` (made on first use; ``_refresh`` came first)."""
        if kind not in self._packs:
            if kind == "amx":
                self._packs[kind] = gemm_kernels.amx_pack_weight(weight)
            elif kind == "dpbf16":
                self._packs[kind] = gemm_kernels.dpbf16_pack_weight(weight)
            elif kind == "vec":
                self._packs[kind] = gemm_kernels.vec_pack_weight(weight)
            else:
                self._packs[kind] = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        return self._packs[kind]


def _packings(weight: torch.Tensor) -> list[str]:
    """The packs this weight can use here: ``"amx"``, ``"dpbf16"`` or ``"vec"``, and ``"onednn"``."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES:
        return []
    kinds = []
    if weight.dtype == torch.bfloat16 and gemm_kernels.amx_supports(weight):
        kinds.append("amx")
    elif weight.dtype == torch.bfloat16 and gemm_kernels.dpbf16_supports(weight):
        kinds.append("dpbf16")
    if weight.dtype == torch.float32 and gemm_kernels.vec_supports(weight):
        kinds.append("vec")
    if _AVAILABLE and (float32_onednn_pays() if weight.dtype == torch.float32 else bfloat16_onednn_available()):
        kinds.append("onednn")
    return kinds


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (tensors made under
    ``torch.inference_mode`` have none; they cannot be updated outside it either)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


class PackedLinear:
    """``Linear``'s CPU version: ``F.linear``'s result through a ``PackedGemm`` whose packs
    are made now, when the platform binds it after loading, so that no step pays for one."""

    def __init__(self, linear):
        self.linear, self.gemm = linear, PackedGemm()
        self.gemm.prepack(linear.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.linear.weight, self.linear.bias)
