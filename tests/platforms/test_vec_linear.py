"""The AVX-512 float32 linear kernel (``csrc/avx512_linear.cpp``) against
float64 math and torch.

Fresh random inputs per test (seeded by the test's name). Skipped where the kernel
cannot run (no AVX-512 CPU, no compiler); the fallback is tested everywhere."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from microvllm.layers.linear import Linear
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels
from microvllm.platforms.cpu.gemm import AVX512_MAX_ROWS
from tests.attention.cases import seed_for
from tests.platforms.conftest import on_cpu_platform

needs_avx512 = pytest.mark.skipif(cpu_kernels.avx512_status() is not None,
                                  reason=f"AVX-512 kernel unavailable: {cpu_kernels.avx512_status()}")
ROWS = [1, 7, 8, 9, 32, 33, 64]
# (N, K): 160 and 176 end in a 16- and a 32-column panel; K 40 and 200 end in a
# partial k block (128); 1536 is twelve whole blocks.
SHAPES = [(16, 32), (160, 40), (176, 200), (960, 576), (576, 1536)]
UNIT_ROUNDOFF = 2.0 ** -24


def random_case(request, rows, n, k, bias):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@needs_avx512
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("rows", ROWS, ids=[f"M{m}" for m in ROWS])
def test_matches_float64_math(rows, n, k, bias, request):
    """Within the textbook bound for a float32 dot product of length K summed in any
    order, (K + 1)·u·Σ|x·w| (+ one rounding of the bias add): a wrong index or a lost
    block would be off by O(1)."""
    x, w, b = random_case(request, rows, n, k, bias)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    got = cpu_kernels.avx512_linear(x, cpu_kernels.avx512_pack_weight(w), b)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    bound = (k + 2) * UNIT_ROUNDOFF * (x.double().abs() @ w.double().abs().T
                                       + (b.double().abs() if bias else 0))
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"worst error {err.max():.3g}"


@needs_avx512
def test_rows_do_not_depend_on_the_batch(request):
    """Each output is one FMA chain in k order, whatever the row count, the row's place
    in an 8-row chunk or the thread count: a request's logits are the same bits alone
    or in a batch of 37."""
    x, w, b = random_case(request, 37, 960, 576, bias=True)
    packed = cpu_kernels.avx512_pack_weight(w)
    batch = cpu_kernels.avx512_linear(x, packed, b)
    threads = torch.get_num_threads()
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            for r in (0, 9, 36):
                assert torch.equal(cpu_kernels.avx512_linear(x[r:r + 1], packed, b)[0], batch[r])
            assert torch.equal(cpu_kernels.avx512_linear(x, packed, b), batch)
    finally:
        torch.set_num_threads(threads)


@needs_avx512
def test_pack_layout():
    """Panels of 48 columns, each k-major; a last panel of N % 48 columns."""
    n, k = 64, 5                                       # one 48-wide panel and one 16-wide
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    flat = cpu_kernels.avx512_pack_weight(w).reshape(-1)
    assert flat.shape == (n * k,)
    for col, kk in [(0, 0), (1, 0), (47, 4), (5, 3)]:
        assert flat[48 * kk + col] == w[col, kk]                   # panel 0: width 48
    for col, kk in [(48, 0), (63, 4), (50, 2)]:
        assert flat[48 * k + 16 * kk + (col - 48)] == w[col, kk]   # panel 1: width 16


@needs_avx512
def test_bad_inputs_are_refused_with_what_to_change():
    packed = cpu_kernels.avx512_pack_weight(torch.randn(32, 64))
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        cpu_kernels.avx512_linear(torch.randn(3, 64).to(torch.bfloat16), packed)
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        cpu_kernels.avx512_linear(torch.randn(3, 48), packed)                  # wrong K
    with pytest.raises(ValueError, match=r"bias must be float32 \[32\]"):
        cpu_kernels.avx512_linear(torch.randn(3, 64), packed, torch.zeros(16))
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cpu_kernels.avx512_pack_weight(torch.randn(40, 64))
    x = torch.randn(64, 3).T                                                   # not contiguous: copied
    assert cpu_kernels.avx512_linear(x, packed).shape == (3, 32)


@needs_avx512
@pytest.mark.parametrize("n,k,kernel", [(160, 96, True), (100, 40, False)], ids=["panels", "not-panels"])
def test_packed_gemm_routes_float32_by_rows(n, k, kernel, monkeypatch):
    """float32 weights with N % 16 == 0 go to the kernel up to AVX512_MAX_ROWS rows, and
    to oneDNN or F.linear beyond; other shapes never. Same results either way."""
    calls = []
    real = cpu_kernels.avx512_linear
    monkeypatch.setattr(cpu_kernels, "avx512_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    layer = on_cpu_platform(Linear(k, n))
    for rows in (1, AVX512_MAX_ROWS, AVX512_MAX_ROWS + 1, 300):
        x = torch.randn(rows, k)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == ([1, AVX512_MAX_ROWS] if kernel else [])
    packs = layer.forward_method.gemm._packs
    assert "avx512" in packs if kernel else "avx512" not in packs


def test_without_avx512_the_kernel_says_why_and_float32_uses_onednn():
    """Run in a fresh interpreter that pretends the CPU has no AVX-512."""
    script = """
import torch
from microvllm.platforms.cpu import kernels
kernels.cpu_flags = lambda: {"avx2"}
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels
from microvllm.platforms import get_platform
from microvllm.layers.linear import Linear
from microvllm.platforms.cpu.gemm import packing_available
reason = cpu_kernels.avx512_status()
assert reason is not None and "avx512f" in reason, reason
layer = Linear(64, 32)
get_platform("cpu").process_weights_after_loading(layer)
with torch.inference_mode():
    layer(torch.randn(4, 64))
assert set(layer._forward_method.gemm._packs) == ({"onednn"} if packing_available() else set())
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@needs_avx512
def test_float32_engine_tokens_do_not_change_with_the_kernel(tmp_path, monkeypatch):
    """A float32 engine generates the same greedy tokens with the kernel as without it
    (oneDNN and MKL), and the kernel is really used."""
    from microvllm.models.tiny import make_tiny_model
    from tests.engine.conftest import greedy_by_backend, varied_prompts

    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7)
    prompts = varied_prompts(512, count=6, seed=3, max_len=40)

    def generate():
        return greedy_by_backend(folder, prompts, ["auto"], dtype="float32")["auto"][1]

    calls = []
    # Decode steps would take the fast path, which calls the C function itself (its
    # own tests compare it with the modules): here every step goes through the modules.
    from microvllm.platforms.cpu import decode_fast_path
    monkeypatch.setattr(decode_fast_path, "unsupported_reason", lambda model: "off in this test")
    real = cpu_kernels.avx512_linear
    monkeypatch.setattr(cpu_kernels, "avx512_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens_on = generate()
    assert len(calls) > 100          # every projection of every decode step
    monkeypatch.setattr(cpu_kernels, "avx512_supports", lambda weight: False)
    calls.clear()
    tokens_off = generate()
    assert not calls and tokens_on == tokens_off
