"""The CPU platform's pre-packed matmul (``platforms/cpu/gemm.py``), bound to ``Linear``,
against ``F.linear`` (``Linear.forward_native``)."""

import pytest
import torch
import torch.nn.functional as F

from microvllm.layers.linear import Linear
from microvllm.platforms.cpu import gemm_kernels
from microvllm.platforms.cpu.gemm import (
    AMX_MAX_ROWS,
    DPBF16_MAX_ROWS,
    FLOAT32_MIN_ROWS,
    VEC_MAX_ROWS,
    PackedGemm,
    PackedLinear,
    bfloat16_onednn_available,
    float32_max_rows,
    packing_available,
)
from tests.platforms.conftest import on_cpu_platform

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(dtype, rows, bias):
    torch.manual_seed(rows)
    layer = on_cpu_platform(Linear(96, 160, bias=bias).to(dtype))
    assert isinstance(layer._forward_method, PackedLinear)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        out = layer(x)
        chosen = layer._forward_method.gemm._choose(x, layer.weight, layer.bias)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), **TOL[dtype])
    onednn = packing_available() and (bfloat16_onednn_available() if dtype == torch.bfloat16
                                      else FLOAT32_MIN_ROWS <= rows <= (float32_max_rows() or rows))
    vec = dtype == torch.float32 and rows <= VEC_MAX_ROWS and gemm_kernels.vec_supports(layer.weight)
    amx = dtype == torch.bfloat16 and rows <= AMX_MAX_ROWS and gemm_kernels.amx_supports(layer.weight)
    dpbf16 = (dtype == torch.bfloat16 and rows <= DPBF16_MAX_ROWS and not gemm_kernels.amx_supports(layer.weight)
              and gemm_kernels.dpbf16_supports(layer.weight))
    assert chosen == ("vec" if vec else "amx" if amx else "dpbf16" if dpbf16 else "onednn" if onednn else None)


def test_the_float32_bound_holds_where_mkl_runs_on_intel_and_nowhere_else_on_x86(monkeypatch):
    from microvllm.platforms.cpu import gemm, kernels

    monkeypatch.setattr(kernels, "machine", lambda: "x86_64")
    for vendor, bound in (("GenuineIntel", gemm.FLOAT32_MAX_ROWS), ("AuthenticAMD", None),
                          ("", gemm.FLOAT32_MAX_ROWS)):
        monkeypatch.setattr(gemm, "cpu_vendor", lambda vendor=vendor: vendor)
        assert float32_max_rows() == bound, vendor
    monkeypatch.setattr(kernels, "machine", lambda: "aarch64")
    assert float32_max_rows() == gemm.FLOAT32_MAX_ROWS


def test_keeps_leading_dims():
    layer = on_cpu_platform(Linear(32, 48))
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])


def test_repacks_when_the_weight_changes():
    """A checkpoint loaded in place, or a cast to another dtype, must not leave a stale pack."""
    layer = on_cpu_platform(Linear(64, 64, bias=False))
    x = torch.randn(8, 64)
    with torch.inference_mode():
        layer(x)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 64))          # in place: same storage, new values
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), **TOL[torch.float32])
    layer.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(xb), F.linear(xb, layer.weight), **TOL[torch.bfloat16])


def test_autograd_takes_the_plain_path():
    layer = on_cpu_platform(Linear(16, 8))
    x = torch.randn(4, 16, requires_grad=True)
    assert layer._forward_method.gemm._choose(x, layer.weight, layer.bias) is None
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_shared_weight_gemm():
    """``PackedGemm`` on a weight it does not own (the tied embedding used as lm_head)."""
    embedding = torch.nn.Embedding(300, 48)
    gemm = PackedGemm()
    hidden = torch.randn(6, 48)
    with torch.inference_mode():
        torch.testing.assert_close(gemm(hidden, embedding.weight),
                                   hidden @ embedding.weight.T, **TOL[torch.float32])


@pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN linear ops")
def test_loaded_models_come_prepacked(tmp_path):
    """The platform packs every projection and the (tied) output projection when it binds
    them after loading, so step 1 packs nothing; the packs are the ones the calls then use
    (same key: no second pack)."""
    from microvllm.attention import get_attention_backend
    from microvllm.models.loader import load_model
    from microvllm.models.tiny import make_tiny_model

    model, _ = load_model(make_tiny_model(tmp_path / "llama", "llama"), get_attention_backend("torch"))
    on_cpu_platform(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.lm_head in linears
    gemms = [m._forward_method.gemm for m in linears]
    assert gemms and all(g._packs for g in gemms)
    before = [{kind: id(pack) for kind, pack in g._packs.items()} for g in gemms]
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    with torch.inference_mode():
        layer(torch.randn(8, layer.in_features))
    assert [{kind: id(pack) for kind, pack in g._packs.items()} for g in gemms] == before
