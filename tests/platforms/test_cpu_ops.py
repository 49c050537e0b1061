"""The CPU platform's versions of RMSNorm, RoPE and SiLU-and-mul (``platforms/cpu/ops.py``:
``csrc/norm_rope.cpp``, ``csrc/activation.cpp``), bound to the ops as the worker binds them,
against each op's ``forward_native`` on fresh random inputs (seeded by the test's name)."""

import pytest
import torch

from microvllm.layers.activation import SiluAndMul
from microvllm.layers.layernorm import RMSNorm
from microvllm.layers.rotary_embedding import ApplyRotaryEmb, rotate
from microvllm.platforms.cpu import kernels, ops as cpu_kernels
from tests.attention.cases import seed_for
from tests.platforms.conftest import on_cpu_platform

pytestmark = pytest.mark.skipif(
    kernels.status("norm_rope") is not None or kernels.status("activation") is not None,
    reason=f"kernels unavailable: {kernels.status('norm_rope') or kernels.status('activation')}")
DTYPES = [torch.float32, torch.bfloat16]


def randn(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def assert_rounding_close(got, want):
    """float32: equal to float rounding. bfloat16: at most one bf16 step apart, and
    almost always identical (only a sum of squares added in another order differs)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    step = want.float().abs() * 2 ** -7 + 1e-30
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (100, 24), (3, 1000)])
def test_rms_norm_matches_the_torch_code(rows, hidden, dtype, request):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    norm = on_cpu_platform(RMSNorm(hidden, eps=1e-5).to(dtype))
    assert norm.implementation == "rms_norm_forward"
    with torch.no_grad():
        norm.weight.copy_(randn(g, hidden, dtype=dtype))
    x = randn(g, rows, hidden, dtype=dtype, scale=3.0)
    with torch.inference_mode():
        assert_rounding_close(norm(x), norm.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_residual_add_updates_the_stream_in_place(dtype, request):
    """``norm(x, residual)``: the residual becomes exactly ``residual + x`` (rounded to
    the dtype, as torch's add rounds), in place, and the output is its norm."""
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    norm = on_cpu_platform(RMSNorm(576).to(dtype))
    x, residual = randn(g, 9, 576, dtype=dtype), randn(g, 9, 576, dtype=dtype, scale=4.0)
    expected_residual = residual + x
    with torch.inference_mode():
        out, new_residual = norm(x, residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, expected_residual)
    assert_rounding_close(out, norm.forward_native(expected_residual))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_rope_matches_the_torch_code_on_a_qkv_view(tokens, dtype, request):
    """The query and key heads are a strided view of the fused QKV output; bfloat16
    results are bit-identical (every product and sum is rounded where torch rounds)."""
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = randn(g, tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    view = qkv[:, :heads + kv_heads]
    op = on_cpu_platform(ApplyRotaryEmb())
    assert op.implementation == "rope_forward"
    with torch.inference_mode():
        got, want = op(view, cos, sin), rotate(view, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3072), (7, 80), (70, 48), (2, 3, 32)], ids=str)
def test_silu_and_mul_matches_the_torch_code(shape, dtype, request):
    g = torch.Generator().manual_seed(seed_for(request.node.name))
    gate_up = randn(g, *shape, dtype=dtype, scale=4.0)
    op = on_cpu_platform(SiluAndMul())
    assert op.implementation == "silu_and_mul_forward"
    with torch.inference_mode():
        got = op(gate_up)
        assert got.shape == (*shape[:-1], shape[-1] // 2)
        assert_rounding_close(got, op.forward_native(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_at_the_extremes(dtype):
    """Where exp(-gate) overflows (silu -> 0, not NaN) or vanishes (silu -> gate)."""
    gate = torch.tensor([-1000.0, -200.0, -88.5, -20.0, 0.0, 20.0, 200.0, 1000.0])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)]).to(dtype).unsqueeze(0)
    op = on_cpu_platform(SiluAndMul())
    with torch.inference_mode():
        got, want = op(gate_up).float(), op.forward_native(gate_up).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-30)


def test_other_dtypes_and_autograd_take_the_torch_code():
    half = torch.randn(2, 8, dtype=torch.float16)
    assert not cpu_kernels.applies(half, torch.ones(8, dtype=torch.float16))
    x = torch.randn(2, 8, requires_grad=True)
    norm = on_cpu_platform(RMSNorm(8))
    with torch.enable_grad():
        assert not cpu_kernels.applies(x, norm.weight)
        norm(x).sum().backward()                      # the torch code: gradients flow
    assert x.grad is not None and norm.weight.grad is not None
    half_norm = on_cpu_platform(RMSNorm(8).to(torch.float16))
    assert torch.equal(half_norm(half), half_norm.forward_native(half))
    silu = on_cpu_platform(SiluAndMul())
    odd = torch.randn(2, 7)                            # no even split: the torch code's error
    with pytest.raises(RuntimeError):
        silu(odd)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        cpu_kernels.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        cpu_kernels.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, residual=torch.randn(3, 8))


@pytest.mark.parametrize("family", ["llama", "qwen3"])   # qwen3: the per-head q/k norm too
def test_bfloat16_engine_tokens_do_not_change_with_the_kernels(family, tmp_path):
    """The same attention backend ("torch") with the platform's ops and with
    ``enforce_eager=True`` (every op's forward_native): the same greedy tokens."""
    from microvllm.models.tiny import make_tiny_model
    from tests.engine.conftest import greedy_by_backend, varied_prompts

    folder = make_tiny_model(tmp_path / family, family, seed=7)
    prompts = varied_prompts(512, count=6, seed=5, max_len=40)

    def generate(enforce_eager):
        return greedy_by_backend(folder, prompts, ["torch"], dtype="bfloat16",
                                 enforce_eager=enforce_eager)["torch"][1]

    assert generate(enforce_eager=True) == generate(enforce_eager=False)


@pytest.mark.skipif("avx512bw" not in kernels.cpu_flags(), reason="this CPU runs the portable loops already")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_portable_loops_agree_with_the_avx512_ones(dtype, request):
    """CPUs without AVX-512 run each kernel's portable loops: built here with AVX-512 off,
    they must give what the AVX-512 build gives (rope bit for bit; the norm and silu
    within a rounding step, where a sum's order or exp's last bit differs)."""
    import ctypes

    from microvllm.platforms.cpu.kernels import CSRC, DTYPE_CODES

    def portable(name):   # no intrinsics: vec512.h's paths drop out
        return ctypes.CDLL(str(kernels.build(CSRC / f"{name}.cpp", isa="portable")))

    g = torch.Generator().manual_seed(seed_for(request.node.name))
    rows, hidden, heads, head_dim, d = 37, 40, 5, 24, 56   # row lengths that leave masked tails
    code, ptr = DTYPE_CODES[dtype], ctypes.c_void_p
    built = {"avx512": (kernels.load("norm_rope"), kernels.load("activation")),
             "portable": (portable("norm_rope"), portable("activation"))}
    x, weight = randn(g, rows, hidden, dtype=dtype, scale=3.0), randn(g, hidden, dtype=dtype)
    residual = randn(g, rows, hidden, dtype=dtype)
    qkv = randn(g, rows, heads + 2, head_dim, dtype=dtype)
    cos, sin = randn(g, rows, head_dim // 2, dtype=dtype), randn(g, rows, head_dim // 2, dtype=dtype)
    gate_up = randn(g, rows, 2 * d, dtype=dtype, scale=4.0)
    results = {}
    for name, (nr, act) in built.items():
        res, normed = residual.clone(), torch.empty_like(x)
        nr.rms_norm(code, ptr(x.data_ptr()), ptr(res.data_ptr()), ptr(weight.data_ptr()),
                    ptr(normed.data_ptr()), rows, hidden, ctypes.c_float(1e-5))
        rotated = torch.empty(rows, heads, head_dim, dtype=dtype)
        nr.rope(code, ptr(qkv.data_ptr()), ptr(cos.data_ptr()), ptr(sin.data_ptr()),
                ptr(rotated.data_ptr()), rows, heads, head_dim, ctypes.c_int64((heads + 2) * head_dim))
        act_out = torch.empty(rows, d, dtype=dtype)
        act.silu_and_mul(code, ptr(gate_up.data_ptr()), ptr(act_out.data_ptr()), rows, d)
        results[name] = res, normed, rotated, act_out
    (res_a, normed_a, rot_a, act_a), (res_p, normed_p, rot_p, act_p) = results["avx512"], results["portable"]
    assert torch.equal(res_a, res_p) and torch.equal(res_a, residual + x)
    assert_rounding_close(normed_a, normed_p)
    assert_rounding_close(act_a, act_p)
    if dtype == torch.bfloat16:
        assert torch.equal(rot_a, rot_p)
    else:
        torch.testing.assert_close(rot_a, rot_p, rtol=1e-5, atol=1e-6)
