"""The quantized linear kernels (``csrc/quantized_linear.cpp``) against the torch
dequantization (``layers/quantization/``) on fresh random inputs, and their fallback.

Fresh random inputs per test (seeded by the test's name). The versions other CPUs run
(the AVX-512, AVX2 and portable builds: MICROVLLM_CPU_ISA) are built here too and checked
the same way, each wherever this CPU can run it."""

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microvllm.layers.quantization.gguf import dequantize
from microvllm.layers.quantization.int8 import dequantize_int8, quantize_int8_per_row
from microvllm.platforms.cpu import kernels, quantized_gemm
from tests.attention.cases import seed_for

needs_kernels = pytest.mark.skipif(quantized_gemm.status() is not None,
                                   reason=f"quantized kernels unavailable: {quantized_gemm.status()}")
ROWS = [1, 3, 4, 5, 17, 32, 64]   # Q4_1, Q8_0 from 5 rows on an AMX CPU: amx_quantized_linear.h
SHAPES = [(4, 32), (20, 64), (96, 576), (960, 576), (576, 1536)]
FORMATS = ["Q4_1", "Q8_0", "int8"]
FORMAT_NUMBERS = quantized_gemm.FORMATS   # quantized_linear.cpp's format argument


def quantized_case(request, fmt, n, k):
    """A random weight in ``fmt`` and its dequantized float32 reference."""
    import gguf

    g = torch.Generator().manual_seed(seed_for(request.node.name))
    w = torch.randn(n, k, generator=g) / k ** 0.5
    if fmt == "int8":
        q, scales = quantize_int8_per_row(w)
        return q, scales, dequantize_int8(q, scales)
    stored = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[fmt])
    q = torch.from_numpy(np.ascontiguousarray(stored))
    return q, None, dequantize(q, fmt, k)


def close(got, expected, k):
    # float32 sums of k products in another order: a few units of roundoff times sqrt(k)
    tolerance = 2.0 ** -24 * 8 * k ** 0.5 * (expected.abs().max().item() + 1)
    assert (got - expected).abs().max().item() <= tolerance


@needs_kernels
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("rows", ROWS, ids=[f"M{m}" for m in ROWS])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_the_torch_dequantization(request, fmt, rows, n, k, bias):
    q, scales, reference = quantized_case(request, fmt, n, k)
    g = torch.Generator().manual_seed(seed_for(request.node.name) + 1)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = quantized_gemm.quantized_linear(x, q, fmt, n, b, scales)
    close(got, F.linear(x, reference, b), k)


@needs_kernels
def test_gguf_blocks_run_on_amx_tiles_where_the_cpu_has_them():
    """So that on such a CPU the Q4_1 and Q8_0 cases above from 5 rows on check
    amx_quantized_linear.h (N a multiple of 16; the others take the AVX-512 paths)."""
    if not {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"} <= kernels.isa_flags():
        pytest.skip("this CPU (or MICROVLLM_CPU_ISA) has no AMX")
    assert kernels.load("quantized_linear").quantized_amx_ready() == 1


@needs_kernels
@pytest.mark.parametrize("rows,k", [(5, 576), (17, 1536), (32, 576)])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_amx_blocks_are_as_exact_as_a_float32_sum(request, fmt, rows, k):
    """x is split into three bf16 parts that add up to it exactly: the result is off from
    the exact sum by float32 roundoff alone, a few units of 2^-24 times sum |x w| (measured
    ~1; with x cut to two parts it is ~16-20, which the test above cannot see)."""
    if not kernels.load("quantized_linear").quantized_amx_ready():
        pytest.skip("GGUF blocks do not run on AMX tiles here")
    q, _, reference = quantized_case(request, fmt, 96, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed_for(request.node.name) + 1))
    got = quantized_gemm.quantized_linear(x, q, fmt, 96).double()
    exact, scale = x.double() @ reference.double().T, x.double().abs() @ reference.double().abs().T
    assert ((got - exact).abs() / scale).max().item() <= 4 * 2.0 ** -24


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_matches_torch(request, fmt):
    q, scales, reference = quantized_case(request, fmt, 96, 576)
    got = quantized_gemm.dequantize_weight(q, fmt, 96, 576, scales)
    # the kernel may fuse d * q + m into one rounding: at most one unit of roundoff apart
    assert torch.allclose(got, reference, rtol=2.0 ** -23, atol=1e-7)


@needs_kernels
def test_int8_rows_whose_length_is_not_a_multiple_of_16(request):
    q, scales, reference = quantized_case(request, "int8", 8, 40)
    x = torch.randn(3, 40)
    close(quantized_gemm.quantized_linear(x, q, "int8", 8, None, scales), F.linear(x, reference), 40)


def test_wrong_inputs_are_refused_with_the_reason(request):
    q, _, _ = quantized_case(request, "Q4_1", 8, 64)
    with pytest.raises(ValueError, match="must be a contiguous CPU tensor"):
        quantized_gemm.quantized_linear(torch.randn(1, 64), q[:, :20], "Q4_1", 8)
    with pytest.raises(ValueError, match="int8 weights need float32 scales"):
        quantized_gemm.quantized_linear(torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), "int8", 8)
    with pytest.raises(ValueError, match="x must be float32"):
        quantized_gemm.quantized_linear(torch.randn(1, 64, dtype=torch.bfloat16), q, "Q4_1", 8)


_target_libraries: dict[str, ctypes.CDLL] = {}


def target_library(isa: str, monkeypatch) -> ctypes.CDLL:
    """quantized_linear.cpp built for ``isa`` (kernels.build), its functions declared from
    ops.h. Skipped where this CPU cannot run that target; a build that fails fails."""
    monkeypatch.setenv("MICROVLLM_CPU_ISA", isa)
    try:
        kernels.check_target()
    except kernels.KernelUnavailable as error:
        if error.expected:
            pytest.skip(str(error))
        raise
    if isa not in _target_libraries:
        try:
            path = kernels.build(kernels.CSRC / "quantized_linear.cpp", isa=isa)
        except kernels.KernelUnavailable as error:
            pytest.fail(f"quantized_linear.cpp does not build for MICROVLLM_CPU_ISA={isa}: {error}")
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in kernels.signatures().items():
            if hasattr(lib, name):
                getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
        _target_libraries[isa] = lib
    return _target_libraries[isa]


TARGET_SHAPES = [(52, 96), (20, 576)]   # N: not a multiple of the wide tiles' 48 rows; K: 3 and 18 blocks


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 33, 70], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_every_target_matches(request, monkeypatch, isa, fmt, rows):
    """What each MICROVLLM_CPU_ISA target runs (AVX-512, AVX2 and portable builds of the same
    file, whatever this process loaded): small-batch passes, wide tiles and plain loops.
    Row counts cross each target's routes: passes of 4 rows (1-20 rows on AVX-512, 1-8 on
    AVX2), then wide tiles in chunks of 64 (AVX-512) or 16 (AVX2) rows."""
    lib = target_library(isa, monkeypatch)
    for n, k in TARGET_SHAPES:
        q, scales, reference = quantized_case(request, fmt, n, k)
        g = torch.Generator().manual_seed(seed_for(request.node.name) + k)
        x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
        y = torch.empty(rows, n)
        if fmt == "int8":
            lib.int8_linear(x.data_ptr(), q.data_ptr(), scales.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, n, k)
        else:
            getattr(lib, f"{fmt.lower()}_linear")(x.data_ptr(), q.data_ptr(), bias.data_ptr(), y.data_ptr(),
                                                  rows, n, k)
        close(y, F.linear(x, reference, bias), k)
        weight = torch.empty(n, k)
        lib.dequantize_rows(FORMAT_NUMBERS[fmt], q.data_ptr(), scales.data_ptr() if scales is not None else None,
                            weight.data_ptr(), n, k)
        assert torch.allclose(weight, reference, rtol=2.0 ** -23, atol=1e-7)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_every_target_takes_int8_rows_of_any_length(request, monkeypatch, isa):
    """int8 rows are not blocks: K = 40 leaves 8 weights past the last whole vector."""
    lib = target_library(isa, monkeypatch)
    q, scales, reference = quantized_case(request, "int8", 8, 40)
    for rows in (1, 5, 33):
        x, y = torch.randn(rows, 40), torch.empty(rows, 8)
        lib.int8_linear(x.data_ptr(), q.data_ptr(), scales.data_ptr(), None, y.data_ptr(), rows, 8, 40)
        close(y, F.linear(x, reference), 40)


@needs_kernels
@pytest.mark.parametrize("rows", [2, 40, 100, 300], ids=["small", "wide", "100-rows", "prefill-dequantize"])
def test_quantized_linear_version_routes_every_size(request, rows):
    """The platform's version of a quantized Linear: each row count takes its route and
    matches forward_native (100 rows: dequantize into a temporary, then F.linear, except
    on an AMX CPU, whose Q4_1 tiles take up to 256 rows; 300 rows: dequantize everywhere)."""
    from microvllm.layers.linear import Linear
    from microvllm.layers.quantization.gguf import GGUFLinearMethod

    q, _, _ = quantized_case(request, "Q4_1", 64, 96)
    linear = Linear(96, 64, bias=False)   # (bias: the kernel tests above)
    linear.quant_method = GGUFLinearMethod("Q4_1")
    linear.quant_method.create_weights(linear)
    with torch.no_grad():
        linear.weight.copy_(q)
    version = quantized_gemm.quantized_linear_version(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        close(version(x), linear.forward_native(x), 96)
        assert version(x.to(torch.bfloat16)).dtype == torch.bfloat16   # other dtypes: forward_native
