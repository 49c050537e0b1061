"""The float32 vector linear kernel (``csrc/vec_linear.cpp``: one source for AVX-512, AVX2
and NEON) against float64 math and torch.

Fresh random inputs per test (seeded by the test's name). The row counts and shapes
cover each target's micro-kernel (8 rows on AVX-512 and NEON, 4 on AVX2), every width
of a last panel (1 or 2 vectors) and a last k block that is partial. Skipped where the
build has no vector unit (``MICROVLLM_CPU_ISA=portable``); a build that fails is a
failure (``needs_kernel``). The other x86 targets this CPU can run are built and
checked too, and the portable fallback everywhere."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from microvllm import envs
from microvllm.layers.linear import Linear
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels, kernels
from microvllm.platforms.cpu.gemm import VEC_MAX_ROWS
from tests.attention.cases import seed_for
from tests.platforms.conftest import needs_kernel, on_cpu_platform

# A portable build loads (its functions are stubs) but has no vector unit: skip. A build
# that fails is left to needs_kernel, which fails the test.
NO_VECTOR_UNIT = kernels.status("vec_linear") is None and cpu_kernels.vec_status() is not None
VEC_MARKS = [needs_kernel("vec_linear"),
             pytest.mark.skipif(NO_VECTOR_UNIT, reason=f"vec_linear: {cpu_kernels.vec_status()}")]


def needs_vec(test):
    for mark in VEC_MARKS:
        test = mark(test)
    return test


# 3, 4, 5 straddle AVX2's 4-row micro-kernel; 7, 8, 9 the 8-row one; 33 and 64 many chunks.
ROWS = [1, 3, 4, 5, 7, 8, 9, 32, 33, 64]
# (N, K): 160 and 176 between them end in a one- and a two-vector panel on every target
# (N % 48 = 16, 32; N % 24 = 16, 8; N % 12 = 4, 8); K 40, 200 and 600 end in a partial
# k block (KC is 128, 256 or 512 inputs: 24 KiB of a panel); 1536 is whole blocks.
SHAPES = [(16, 32), (160, 40), (176, 200), (48, 600), (960, 576), (576, 1536)]
UNIT_ROUNDOFF = 2.0 ** -24


def random_case(request, rows, n, k, bias):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def check_against_float64(x, w, b, got):
    """Within the textbook bound for a float32 dot product of length K summed in any
    order, (K + 1)·u·Σ|x·w| (+ one rounding of the bias add): a wrong index or a lost
    block would be off by O(1)."""
    k = x.shape[1]
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    bound = (k + 2) * UNIT_ROUNDOFF * (x.double().abs() @ w.double().abs().T
                                       + (b.double().abs() if b is not None else 0))
    err = (got.double() - exact).abs()
    worst = err.argmax()
    assert (err <= bound).all(), f"error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"


@needs_vec
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
@pytest.mark.parametrize("rows", ROWS, ids=[f"M{m}" for m in ROWS])
def test_matches_float64_math(rows, n, k, bias, request):
    x, w, b = random_case(request, rows, n, k, bias)
    got = cpu_kernels.vec_linear(x, cpu_kernels.vec_pack_weight(w), b)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    check_against_float64(x, w, b, got)


@needs_vec
def test_rows_do_not_depend_on_the_batch(request):
    """Each output is one FMA chain in k order, whatever the row count, the row's place
    in a row chunk or the thread count: a request's logits are the same bits alone or
    in a batch of 37."""
    x, w, b = random_case(request, 37, 960, 576, bias=True)
    packed = cpu_kernels.vec_pack_weight(w)
    batch = cpu_kernels.vec_linear(x, packed, b)
    threads = torch.get_num_threads()
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            for r in (0, 9, 36):
                assert torch.equal(cpu_kernels.vec_linear(x[r:r + 1], packed, b)[0], batch[r])
            assert torch.equal(cpu_kernels.vec_linear(x, packed, b), batch)
    finally:
        torch.set_num_threads(threads)


@needs_vec
def test_pack_layout():
    """Panels of P = 3 vectors of columns (48, 24 or 12), each k-major; a last panel of
    N % P columns."""
    panel, lanes = cpu_kernels.vec_panel(), cpu_kernels.vec_lanes()
    assert panel == 3 * lanes and lanes in (4, 8, 16)
    n, k = panel + lanes, 5                            # one whole panel and a one-vector one
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    flat = cpu_kernels.vec_pack_weight(w).reshape(-1)
    assert flat.shape == (n * k,)
    for col, kk in [(0, 0), (1, 0), (panel - 1, 4), (5, 3)]:
        assert flat[panel * kk + col] == w[col, kk]                        # panel 0
    for col, kk in [(panel, 0), (n - 1, 4), (panel + 2, 2)]:
        assert flat[panel * k + lanes * kk + (col - panel)] == w[col, kk]  # panel 1: one vector


@needs_vec
def test_bad_inputs_are_refused_with_what_to_change():
    lanes = cpu_kernels.vec_lanes()
    packed = cpu_kernels.vec_pack_weight(torch.randn(32, 64))
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        cpu_kernels.vec_linear(torch.randn(3, 64).to(torch.bfloat16), packed)
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        cpu_kernels.vec_linear(torch.randn(3, 48), packed)                  # wrong K
    with pytest.raises(ValueError, match=r"bias must be float32 \[32\]"):
        cpu_kernels.vec_linear(torch.randn(3, 64), packed, torch.zeros(16))
    with pytest.raises(ValueError, match=f"N % {lanes} == 0"):
        cpu_kernels.vec_pack_weight(torch.randn(lanes + 2, 64))
    x = torch.randn(64, 3).T                                                # not contiguous: copied
    assert cpu_kernels.vec_linear(x, packed).shape == (3, 32)


@needs_vec
@pytest.mark.parametrize("n,k,kernel", [(160, 96, True), (102, 40, False)], ids=["panels", "not-panels"])
def test_packed_gemm_routes_float32_by_rows(n, k, kernel, monkeypatch):
    """float32 weights with N a multiple of the lanes go to the kernel up to VEC_MAX_ROWS
    rows, and to oneDNN or F.linear beyond; other shapes never (102 is no multiple of 4,
    8 or 16). Same results either way."""
    calls = []
    real = cpu_kernels.vec_linear
    monkeypatch.setattr(cpu_kernels, "vec_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    layer = on_cpu_platform(Linear(k, n))
    for rows in (1, VEC_MAX_ROWS, VEC_MAX_ROWS + 1, 300):
        x = torch.randn(rows, k)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == ([1, VEC_MAX_ROWS] if kernel else [])
    packs = layer.forward_method.gemm._packs
    assert "vec" in packs if kernel else "vec" not in packs


def run_with_target(isa: str, script: str) -> str:
    """Run ``script`` in a fresh interpreter whose kernels are built for ``isa``; its stdout."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[2], env={**os.environ, "MICROVLLM_CPU_ISA": isa})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_without_a_vector_unit_the_kernel_says_why_and_float32_uses_onednn():
    """A portable build (no intrinsics) has no vector kernel: its status says so, and
    float32 projections take oneDNN."""
    script = """
import torch
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels, kernels
from microvllm.platforms import get_platform
from microvllm import envs
from microvllm.layers.linear import Linear
from microvllm.platforms.cpu.gemm import packing_available
reason = cpu_kernels.vec_status()
assert reason is not None and "no vector unit (MICROVLLM_CPU_ISA=portable)" in reason, reason
assert kernels.load("vec_linear").vec_linear_panel() == 0 and not cpu_kernels.vec_supports(torch.randn(48, 8))
layer = Linear(64, 32)
get_platform("cpu").process_weights_after_loading(layer)
with torch.inference_mode():
    layer(torch.randn(4, 64))
assert set(layer._forward_method.gemm._packs) == ({"onednn"} if packing_available() else set())
print("ok")
"""
    assert run_with_target("portable", script) == "ok"


# Each x86 target's lanes; built (in a fresh interpreter with MICROVLLM_CPU_ISA set) where
# the chosen target lets this CPU run it (isa_flags: an AVX2 test run never runs AVX-512).
TARGET_LANES = {"avx512": 16, "avx2": 8}


@needs_kernel("vec_linear")
@pytest.mark.parametrize("isa", list(TARGET_LANES))
def test_each_x86_target_builds_and_matches_float64_math(isa, request):
    if kernels.machine() != "x86_64" or not kernels._X86_NEEDS[isa] <= kernels.isa_flags():
        pytest.skip(f"MICROVLLM_CPU_ISA={isa} cannot run here (target {envs.cpu_isa()})")
    assert kernels.build(kernels.CSRC / "vec_linear.cpp", isa=isa).exists()
    seed = seed_for(request.node.name)
    script = f"""
import torch
from microvllm.platforms.cpu import gemm_kernels as cpu_kernels
from tests.platforms.test_vec_linear import check_against_float64
assert cpu_kernels.vec_status() is None, cpu_kernels.vec_status()
assert cpu_kernels.vec_panel() == 3 * {TARGET_LANES[isa]}, cpu_kernels.vec_panel()
g = torch.Generator().manual_seed({seed})
for rows in (1, 3, 4, 5, 8, 9, 33, 64):
    for n, k in {SHAPES}:
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
        b = torch.randn(n, generator=g)
        check_against_float64(x, w, b, cpu_kernels.vec_linear(x, cpu_kernels.vec_pack_weight(w), b))
print("ok")
"""
    assert run_with_target(isa, script) == "ok"


@needs_vec
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
    real = cpu_kernels.vec_linear
    monkeypatch.setattr(cpu_kernels, "vec_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens_on = generate()
    assert len(calls) > 100          # every projection of every decode step
    monkeypatch.setattr(cpu_kernels, "vec_supports", lambda weight: False)
    calls.clear()
    tokens_off = generate()
    assert not calls and tokens_on == tokens_off
