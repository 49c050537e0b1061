"""The AMX bfloat16 linear kernel (``csrc/amx_linear.cpp``) against float32 math and torch.

Fresh random inputs per test (seeded by the test's name). Skipped where the kernel
cannot run (no AMX CPU, old Linux, no compiler); the fallback is tested everywhere."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from microvllm.layers.linear import Linear
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels
from microvllm.platforms.cpu.gemm import AMX_MAX_ROWS
from tests.attention.cases import seed_for
from tests.platforms.conftest import on_cpu_platform

needs_amx = pytest.mark.skipif(cpu_kernels.amx_status() is not None,
                               reason=f"AMX kernel unavailable: {cpu_kernels.amx_status()}")
ROWS = [1, 5, 16, 17, 32, 33, 70]
SHAPES = [(16, 32), (48, 64), (160, 96), (960, 576), (576, 1536)]   # (N, K); 48: odd n blocks


def random_case(request, rows, n, k, bias):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


@needs_amx
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("rows", ROWS, ids=[f"M{m}" for m in ROWS])
def test_matches_float32_math(rows, n, k, bias, request):
    """The exact product of the bf16 inputs, rounded once to bf16: at most one bf16 step
    (2**-8 relative) apart, from float32 summation order."""
    x, w, b = random_case(request, rows, n, k, bias)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = cpu_kernels.amx_linear(x, cpu_kernels.amx_pack_weight(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    err = (got.double() - exact).abs()
    assert (err <= exact.abs() * 2 ** -8 + 1e-3).all(), f"worst error {err.max():.3g}"


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 32, 1024], ids=lambda m: f"M{m}")
def test_bit_identical_to_torch_bf16_matmul(rows, request):
    """torch's own bf16 matmul on an AMX CPU (oneDNN) also sums in k order in float32
    tiles: same bits at decode sizes (and at 1024 rows), so the kernel changes no greedy
    token there. (At 33-128 rows oneDNN takes another path: about 1 output in 10,000
    differs by one bf16 step, measured on a Sapphire Rapids Xeon, torch 2.13.)"""
    x, w, b = random_case(request, rows, 960, 576, bias=True)
    assert torch.equal(cpu_kernels.amx_linear(x, cpu_kernels.amx_pack_weight(w), b), F.linear(x, w, b))


@needs_amx
def test_pack_layout():
    """packed[nb, kb, r, n, e] = W[16*nb + n, 32*kb + 2*r + e]."""
    w = torch.arange(32 * 64).reshape(32, 64).to(torch.float32)
    packed = cpu_kernels.amx_pack_weight(w.to(torch.bfloat16)).float()
    assert packed.shape == (2, 2, 16, 16, 2)
    for nb, kb, r, n, e in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 0, 3, 5, 1), (1, 1, 15, 15, 1)]:
        assert packed[nb, kb, r, n, e] == w.to(torch.bfloat16).float()[16 * nb + n, 32 * kb + 2 * r + e]


@needs_amx
def test_thread_count_does_not_change_the_bits(request):
    x, w, b = random_case(request, 40, 3072, 576, bias=False)
    packed = cpu_kernels.amx_pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.amx_linear(x, packed)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(cpu_kernels.amx_linear(x, packed), one)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_bad_inputs_are_refused_with_what_to_change():
    w = torch.randn(32, 64).to(torch.bfloat16)
    packed = cpu_kernels.amx_pack_weight(w)
    with pytest.raises(ValueError, match=r"bfloat16 \[M, 64\]"):
        cpu_kernels.amx_linear(torch.randn(3, 64), packed)                       # float32 x
    with pytest.raises(ValueError, match=r"bfloat16 \[M, 64\]"):
        cpu_kernels.amx_linear(torch.randn(3, 48).to(torch.bfloat16), packed)    # wrong K
    with pytest.raises(ValueError, match=r"bias must be bfloat16 \[32\]"):
        cpu_kernels.amx_linear(torch.randn(3, 64).to(torch.bfloat16), packed, torch.zeros(16).to(torch.bfloat16))
    with pytest.raises(ValueError, match="K % 32 == 0"):
        cpu_kernels.amx_pack_weight(torch.randn(32, 40).to(torch.bfloat16))
    x = torch.randn(64, 3).to(torch.bfloat16).T                                  # not contiguous: copied
    packed = cpu_kernels.amx_pack_weight(torch.randn(32, 64).to(torch.bfloat16))
    torch.testing.assert_close(cpu_kernels.amx_linear(x, packed).shape, torch.Size([3, 32]))


@needs_amx
@pytest.mark.parametrize("n,k,amx", [(160, 96, True), (100, 40, False)], ids=["tiles", "not-tiles"])
def test_packed_gemm_routes_bfloat16_by_rows(n, k, amx, monkeypatch):
    """Whole-tile bf16 weights go to the AMX kernel up to AMX_MAX_ROWS rows, and to
    oneDNN beyond; other shapes always to oneDNN. Same results either way."""
    calls = []
    kernel = cpu_kernels.amx_linear
    monkeypatch.setattr(cpu_kernels, "amx_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    layer = on_cpu_platform(Linear(k, n).to(torch.bfloat16))
    for rows in (1, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 300):
        x = torch.randn(rows, k).to(torch.bfloat16)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
    assert calls == ([1, AMX_MAX_ROWS] if amx else [])
    assert set(layer._forward_method.gemm._packs) == ({"amx", "onednn"} if amx else {"onednn"})


def test_without_amx_the_kernel_says_why_and_bfloat16_uses_onednn():
    """Run in a fresh interpreter that pretends the CPU has no AMX."""
    script = """
import torch
from microvllm.platforms.cpu import kernels
kernels.cpu_flags = lambda: {"avx512f"}
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels
from microvllm.platforms import get_platform
from microvllm.layers.linear import Linear
from microvllm.platforms.cpu.gemm import bfloat16_onednn_available, packing_available
reason = cpu_kernels.amx_status()
assert reason is not None and "amx_tile" in reason, reason
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


@needs_amx
def test_bfloat16_engine_tokens_do_not_change_with_the_kernel(tmp_path, monkeypatch):
    """A bf16 engine (batches of at most 32 rows: the bit-identical sizes) generates the
    same greedy tokens with the kernel as with oneDNN, and the kernel is really used."""
    from microvllm.models.tiny import make_tiny_model
    from tests.engine.conftest import greedy_by_backend, varied_prompts

    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7)   # every shape is whole tiles
    prompts = varied_prompts(512, count=6, seed=3, max_len=40)

    def generate():   # batches of at most 32 tokens (max_num_batched_tokens=32)
        return greedy_by_backend(folder, prompts, ["auto"], dtype="bfloat16")["auto"][1]

    calls = []
    # Decode steps would take the fast path, which calls the C function itself (its
    # own tests compare it with the modules): here every step goes through the modules.
    from microvllm.platforms.cpu import decode_fast_path
    monkeypatch.setattr(decode_fast_path, "unsupported_reason", lambda model: "off in this test")
    kernel = cpu_kernels.amx_linear
    monkeypatch.setattr(cpu_kernels, "amx_linear", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    tokens_on = generate()
    assert len(calls) > 100          # every projection of every step
    monkeypatch.setattr(cpu_kernels, "amx_supports", lambda weight: False)
    calls.clear()
    tokens_off = generate()
    assert not calls and tokens_on == tokens_off
