"""The AVX512-BF16 bfloat16 linear kernel (``csrc/dpbf16_linear.cpp``) against float64 math
and torch.

Fresh random inputs per test (seeded by the test's name). Skipped where the kernel cannot
run (a CPU without AVX512-BF16, a target that drops it, no compiler); the fallback and the
routing around it are tested everywhere."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from microvllm.layers.linear import Linear
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels, kernels
from microvllm.platforms.cpu.gemm import DPBF16_MAX_ROWS
from tests.platforms.conftest import on_cpu_platform
from tests.platforms.test_amx_linear import random_case  # bfloat16 x, W / sqrt(K), bias

needs_dpbf16 = pytest.mark.skipif(cpu_kernels.dpbf16_status() is not None,
                                  reason=f"AVX512-BF16 kernel unavailable: {cpu_kernels.dpbf16_status()}")
ROWS = [1, 3, 8, 9, 32, 33, 64, 70]   # 8: one micro-kernel chunk; 9: a chunk and one row
# (N, K): 16 and 32-wide last panels (N % 48), K below, at and past one k block (256 inputs)
SHAPES = [(16, 2), (32, 40), (48, 64), (112, 256), (960, 576), (576, 1536)]


@needs_dpbf16
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("rows", ROWS, ids=[f"M{m}" for m in ROWS])
def test_matches_float64_math(rows, n, k, bias, request):
    """The exact product of the bf16 inputs, rounded once to bf16: at most one bf16 step
    (2**-8 relative) apart, from float32 summation order."""
    x, w, b = random_case(request, rows, n, k, bias)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = cpu_kernels.dpbf16_linear(x, cpu_kernels.dpbf16_pack_weight(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    err = (got.double() - exact).abs()
    assert (err <= exact.abs() * 2 ** -8 + 1e-3).all(), f"worst error {err.max():.3g}"


@needs_dpbf16
def test_close_to_torch_bf16_matmul(request):
    """torch's bf16 matmul (oneDNN) sums in another order: the two differ by one bf16 step
    in a small share of outputs (measured 0.003-0.03 % on SmolLM2's shapes), never more."""
    x, w, b = random_case(request, 32, 960, 576, bias=True)
    got, torch_result = cpu_kernels.dpbf16_linear(x, cpu_kernels.dpbf16_pack_weight(w), b), F.linear(x, w, b)
    differ = got != torch_result
    assert differ.float().mean() < 1e-3
    step = torch_result.double().abs() * 2 ** -7 + 1e-6   # one bf16 step at that magnitude
    assert ((got.double() - torch_result.double()).abs() <= step).all()


def test_pack_layout():
    """flat packed[48·K·p + 2·w_p·kp + 2·j + e] = W[48·p + j, 2·kp + e]: checked element by
    element on a weight of one full panel and a 16-wide last one (plain torch: runs anywhere)."""
    n, k = 64, 6
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).to(torch.bfloat16)
    original = cpu_kernels.dpbf16_supports
    try:
        cpu_kernels.dpbf16_supports = lambda weight: True   # the layout needs no kernel
        flat = cpu_kernels.dpbf16_pack_weight(w).reshape(-1).float()
    finally:
        cpu_kernels.dpbf16_supports = original
    panel = cpu_kernels.DPBF16_PANEL
    for col in range(n):
        for i in range(k):
            p, j, kp, e = col // panel, col % panel, i // 2, i % 2
            width = min(panel, n - panel * p)
            assert flat[panel * k * p + 2 * width * kp + 2 * j + e] == w.float()[col, i]


@needs_dpbf16
def test_panel_width_matches_the_build():
    assert kernels.load("dpbf16_linear").dpbf16_linear_panel() == cpu_kernels.DPBF16_PANEL


@needs_dpbf16
def test_thread_count_does_not_change_the_bits(request):
    x, w, b = random_case(request, 40, 3072, 576, bias=True)
    packed = cpu_kernels.dpbf16_pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.dpbf16_linear(x, packed, b)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(cpu_kernels.dpbf16_linear(x, packed, b), one)
    finally:
        torch.set_num_threads(threads)


@needs_dpbf16
def test_bad_inputs_are_refused_with_what_to_change():
    packed = cpu_kernels.dpbf16_pack_weight(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"bfloat16 \[M, 64\]"):
        cpu_kernels.dpbf16_linear(torch.randn(3, 64), packed)                       # float32 x
    with pytest.raises(ValueError, match=r"bfloat16 \[M, 64\]"):
        cpu_kernels.dpbf16_linear(torch.randn(3, 48).to(torch.bfloat16), packed)    # wrong K
    with pytest.raises(ValueError, match=r"bias must be bfloat16 \[32\]"):
        cpu_kernels.dpbf16_linear(torch.randn(3, 64).to(torch.bfloat16), packed, torch.zeros(16).to(torch.bfloat16))
    with pytest.raises(ValueError, match="K % 2 == 0"):
        cpu_kernels.dpbf16_pack_weight(torch.randn(32, 41).to(torch.bfloat16))
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cpu_kernels.dpbf16_pack_weight(torch.randn(40, 64).to(torch.bfloat16))
    x = torch.randn(64, 3).to(torch.bfloat16).T                                      # not contiguous: copied
    assert cpu_kernels.dpbf16_linear(x, packed).shape == (3, 32)


@needs_dpbf16
@pytest.mark.parametrize("n,k,used", [(160, 96, True), (100, 40, False)], ids=["fits", "N-not-16s"])
def test_packed_gemm_routes_bfloat16_by_rows(n, k, used, monkeypatch):
    """On a CPU with AVX512-BF16 and no AMX, bf16 weights with N % 16 == 0 go to the kernel
    up to DPBF16_MAX_ROWS rows and to oneDNN beyond; other shapes always to oneDNN."""
    if cpu_kernels.amx_status() is None:
        pytest.skip("this CPU has AMX, which bfloat16 takes first")
    calls = []
    kernel = cpu_kernels.dpbf16_linear
    monkeypatch.setattr(cpu_kernels, "dpbf16_linear",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    layer = on_cpu_platform(Linear(k, n).to(torch.bfloat16))
    for rows in (1, DPBF16_MAX_ROWS, DPBF16_MAX_ROWS + 1, 300):
        x = torch.randn(rows, k).to(torch.bfloat16)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
    assert calls == ([1, DPBF16_MAX_ROWS] if used else [])
    assert set(layer._forward_method.gemm._packs) == ({"dpbf16", "onednn"} if used else {"onednn"})


def test_without_avx512_bf16_the_kernel_says_why_and_bfloat16_uses_onednn():
    """Run in a fresh interpreter that pretends the CPU has AVX-512 but neither AMX nor
    AVX512-BF16."""
    script = """
import torch
from microvllm.platforms.cpu import kernels
kernels.cpu_flags = lambda: {"avx512f", "avx512bw"}
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels
from microvllm.platforms import get_platform
from microvllm.layers.linear import Linear
from microvllm.platforms.cpu.gemm import bfloat16_onednn_available, packing_available
reason = cpu_kernels.dpbf16_status()
assert reason is not None and "avx512_bf16" in reason, reason
layer = Linear(64, 32).to(torch.bfloat16)
get_platform("cpu").process_weights_after_loading(layer)
with torch.inference_mode():
    layer(torch.randn(4, 64).to(torch.bfloat16))
onednn = packing_available() and bfloat16_onednn_available()
assert set(layer._forward_method.gemm._packs) == ({"onednn"} if onednn else set())
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
