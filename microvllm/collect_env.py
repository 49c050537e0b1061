"""``python -m microvllm collect-env``: what this machine runs, for a bug report or a
workshop's first minute (vLLM has a ``collect_env.py`` of the same name).

    machine      architecture, CPU model, cores, the vector and matrix units it has
    target       MICROVLLM_CPU_ISA, the compiler and the flags the kernels are built with
    torch        version, the CPU capability its own kernels use, threads, oneDNN
    kernels      each C++ library: built and loaded, or why not
    routes       which code each op takes in the default engine (``enforce_eager=True``
                 runs every op's ``forward_native`` instead)

Building a library here is what any first ``LLM()`` would do (cached after), so the
answers are the engine's own, not a guess from the CPU flags.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# /proc/cpuinfo flags worth naming, by the unit they belong to.
_UNITS = (("AMX", ("amx_tile", "amx_bf16", "amx_int8")),
          ("AVX-512", ("avx512f", "avx512bw", "avx512_bf16", "avx512_vnni")),
          ("AVX2", ("avx2", "fma", "f16c")),
          ("NEON", ("asimd", "asimddp", "fphp", "asimdhp", "sve")))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def units(flags: set[str]) -> str:
    """The named units among ``flags``, e.g. ``AVX-512 (avx512f avx512bw), AVX2 (avx2 fma f16c)``."""
    found = []
    for unit, names in _UNITS:
        have = [name for name in names if name in flags]
        if have:
            found.append(f"{unit} ({' '.join(have)})")
    return ", ".join(found) or "none of AVX2, AVX-512, AMX, NEON"


def collect() -> list[tuple[str, list[tuple[str, str]]]]:
    """The report as sections of (label, value) rows."""
    import torch

    from microvllm import envs
    from microvllm.platforms.cpu import gemm, gemm_kernels, kernels, quantized_gemm

    sections = []
    flags = kernels.cpu_flags()
    sections.append(("machine", [
        ("architecture", f"{kernels.machine()} ({platform.system()})"),
        ("CPU", f"{cpu_model()}, {os.cpu_count()} cores"),
        ("units", units(flags) if flags else "unknown (no /proc/cpuinfo): the compiler decides"),
    ]))

    target = [("MICROVLLM_CPU_ISA", envs.cpu_isa())]
    try:
        kernels.check_target()
        compiler = kernels._compiler()
        version = (kernels._compiler_version(compiler).splitlines() or ["?"])[0]
        target += [("compiler", f"{compiler}: {version}"),
                   ("flags", " ".join(f for f in kernels.compile_flags(compiler) if f not in kernels.COMPILE_FLAGS)
                    or "(the compiler's defaults)"),
                   ("units the kernels may use", units(kernels.isa_flags()) if flags else "as built")]
    except kernels.KernelUnavailable as error:
        target.append(("no build", str(error).splitlines()[0]))
    target.append(("cache", str(envs.cache_dir() / "cpu_kernels")))
    sections.append(("target", target))

    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    sections.append(("torch", [
        ("version", torch.__version__),
        ("CPU capability", f"{capability}" + (f" (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})"
                                              if os.environ.get("ATEN_CPU_CAPABILITY") else "")),
        ("threads", str(torch.get_num_threads())),
        ("oneDNN packed linear", "yes" if gemm.packing_available() else "no"),
    ]))

    rows = []
    for name in kernels.LIBRARIES:
        reason = kernels.status(name)
        built = "built"
        if name == "vec_linear" and reason is None:
            reason = gemm_kernels.vec_status()   # built, but a portable build has no vector unit
            built = f"built: {gemm_kernels.vec_lanes()}-lane vectors, panels of {gemm_kernels.vec_panel()} columns"
        rows.append((name, built if reason is None else "not used: " + reason.splitlines()[0]))
    sections.append(("kernels", rows))

    ok = {name: kernels.status(name) is None for name in kernels.LIBRARIES}
    vec = gemm_kernels.vec_status() is None
    quantized = quantized_gemm.status() is None
    layer_loop = all(ok[n] for n in ("norm_rope", "activation", "paged_attention", "decode_layers"))
    onednn = gemm.packing_available()
    top = gemm.float32_max_rows()
    if vec:
        f32 = f"rows 1-{gemm.VEC_MAX_ROWS}: vec_linear; " + (
            (f"to {top}: oneDNN; more: F.linear" if top else "more: oneDNN") if onednn else "more: F.linear")
    else:
        f32 = (f"rows {gemm.FLOAT32_MIN_ROWS}-{top}: oneDNN; others: F.linear" if top else
               f"rows {gemm.FLOAT32_MIN_ROWS} on: oneDNN; fewer: F.linear") if onednn and gemm.float32_onednn_pays() \
            else "F.linear"
    bf16_kernel = ((f"rows 1-{gemm.AMX_MAX_ROWS}: AMX; " if ok["amx_linear"] else
                    f"rows 1-{gemm.DPBF16_MAX_ROWS}: dpbf16_linear (AVX512-BF16); " if ok["dpbf16_linear"] else ""))
    bf16 = bf16_kernel + ("more: " if bf16_kernel else "") + ("oneDNN" if onednn else "F.linear")
    routes = [
        ("RMSNorm, RoPE", "C++ (norm_rope)" if ok["norm_rope"] else "torch"),
        ("SiLU and mul", "C++ (activation)" if ok["activation"] else "torch"),
        ("greedy argmax", "C++ (argmax)" if ok["argmax"] else "torch.argmax"),
        ("attention", ("cpu: paged decode kernel, prefill " + (
            "tiles (head_dim 64, 128)" if kernels.load("prefill_attention").prefill_supported(64) else "by SDPA"))
         if ok["paged_attention"] and ok["prefill_attention"] else "torch backend (SDPA)"),
        ("Linear, float32", f32),
        ("Linear, bfloat16", bf16),
        ("GGUF Q4_1 / Q8_0, int8", f"rows 1-{quantized_gemm.MAX_FUSED_ROWS}: quantized_linear on the stored blocks; "
         "more: dequantize, then F.linear" if quantized else "dequantized in torch at every call"),
        ("decode fast path", ", ".join(f"{what}: {'on' if on else 'off'}" for what, on in (
            ("float32", layer_loop and vec), ("bfloat16", layer_loop and bool(bf16_kernel)),
            ("GGUF / int8", layer_loop and quantized)))),
    ]
    sections.append(("routes (default engine; enforce_eager=True: torch for all)", routes))
    return sections


def main(argv: list[str] | None = None) -> int:
    for title, rows in collect():
        print(title)
        width = max(len(label) for label, _ in rows)
        for label, value in rows:
            print(f"  {label:<{width}}  {value}")
    return 0
