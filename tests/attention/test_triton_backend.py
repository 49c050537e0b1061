"""The Triton backend as the engine sees it: registry, interface, dispatch, refusals,
the clear error when Triton cannot run, and the benchmark's CPU path."""

import inspect
import subprocess
import sys

import pytest
import torch

from microvllm.attention import available_backends, get_attention_backend, triton_kernels
from microvllm.attention.torch_ref import TorchReferenceBackend
from microvllm.attention.triton_backend import TritonAttentionBackend
from microvllm.bench import attention as bench
from tests.attention.cases import assert_matches, batch_lengths, make_batch, seed_for


def test_registered_as_triton():
    assert "triton" in available_backends()
    assert isinstance(get_attention_backend("triton"), TritonAttentionBackend)


@pytest.mark.parametrize("method", ["write_kv", "forward"])
def test_same_signatures_as_the_torch_backend(method):
    def shape(fn):  # names, kinds and defaults; annotations may differ
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert shape(getattr(TritonAttentionBackend, method)) == \
        shape(getattr(TorchReferenceBackend, method))


@pytest.mark.parametrize("kind,use_decode_kernel,window", [
    ("mixed", False, None), ("decode", True, 7), ("decode", False, None)])
def test_backend_step_matches_torch_backend(request, kind, use_decode_kernel, window):
    """One engine step: write this step's K/V into the cache, then attend; padding
    rows past the real tokens come back as zeros, as from the reference."""
    query_lens, seq_lens = batch_lengths(kind, 16)
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, heads="4:1", head_dim=32,
                                           seed=seed_for(request.node.name),
                                           num_padding_tokens=3)
    new_kv = torch.randn(2, metadata.num_actual_tokens, *kv_cache.shape[3:],
                         device=kv_cache.device)
    triton_backend = TritonAttentionBackend(use_decode_kernel=use_decode_kernel)
    torch_backend = get_attention_backend("reference")
    outputs = []
    for backend in (triton_backend, torch_backend):
        cache = kv_cache.clone()
        backend.write_kv(new_kv[0], new_kv[1], cache, metadata.slot_mapping)
        outputs.append(backend.forward(query, cache, metadata, scale=0.2, sliding_window=window))
    assert_matches(outputs[0], outputs[1], query.shape[0])
    assert torch.equal(outputs[0][-3:], torch.zeros_like(outputs[0][-3:]))


@pytest.mark.parametrize("change,message", [
    (dict(block_size=8), "block_size=8"),
    (dict(block_size=24), "block_size=24"),
    (dict(cache_dtype=torch.float16), "allocate the cache"),
    (dict(window=0), "sliding_window=0"),
    (dict(dtype=torch.float64), "supports float32, float16 and bfloat16"),
])
def test_refuses_unsupported_inputs_with_what_to_change(change, message):
    query = torch.randn(2, 4, 16, dtype=change.get("dtype", torch.float32))
    kv_cache = torch.zeros(2, 4, change.get("block_size", 16), 2, 16,
                           dtype=change.get("cache_dtype", query.dtype))
    metadata = make_batch([1, 1], [3, 4])[2]
    with pytest.raises(ValueError, match=message):
        get_attention_backend("triton").forward(query, kv_cache, metadata, scale=1.0,
                                                sliding_window=change.get("window"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter refuses bf16 on CPU only")
def test_refuses_bfloat16_in_the_interpreter():
    query, kv_cache, metadata = make_batch([1], [3], dtype="bf16")
    with pytest.raises(ValueError, match="interpreter computes bfloat16 wrongly"):
        get_attention_backend("triton").forward(query, kv_cache, metadata, scale=1.0)


# ---- when Triton cannot run --------------------------------------------------------

@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_clear_error_when_triton_was_imported_without_the_interpreter(no_gpu, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels, "_triton_imported", lambda: True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 before triton is first "
                                           "imported") as error:
        TritonAttentionBackend()
    assert "restart the kernel" in str(error.value)


def test_clear_error_when_triton_is_not_installed(monkeypatch):
    monkeypatch.setattr(triton_kernels, "_triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="pip install"):
        get_attention_backend("triton")


def test_switches_the_interpreter_on_when_triton_is_not_imported_yet(no_gpu, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels, "_triton_imported", lambda: False)
    triton_kernels.ensure_triton_can_run()
    assert triton_kernels._interpreter_on()


def test_clear_error_when_kernels_were_compiled_for_a_missing_gpu(no_gpu):
    def kernel():  # stands for a @triton.jit function defined without the interpreter
        pass
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_kernels.check_kernel_can_run(kernel)


@pytest.mark.parametrize("installed,cuda,imported,interpreter,runs", [
    (False, True, False, False, False),
    (True, True, True, False, True),
    (True, False, True, True, True),
    (True, False, False, False, True),    # the caller may switch the interpreter on
    (True, False, True, False, False),
])
def test_triton_unavailable_reason(installed, cuda, imported, interpreter, runs):
    reason = triton_kernels.triton_unavailable_reason(
        triton_installed=installed, cuda_available=cuda, triton_imported=imported,
        interpreter_on=interpreter)
    assert (reason is None) == runs


def test_importing_microvllm_does_not_import_triton():
    code = ("import sys, microvllm, microvllm.attention, microvllm.bench.attention\n"
            "import microvllm.attention.triton_backend\n"
            "microvllm.attention.available_backends()\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the benchmark -----------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() runs the benchmark")
def test_bench_says_it_needs_a_gpu(capsys):
    assert bench.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("query_len,seq_len", [(1, 40), (24, 24), (8, 40)],
                         ids=["decode", "prefill", "chunk"])
def test_bench_dense_inputs_are_the_same_attention(request, query_len, seq_len):
    """SDPA on the dense copy computes what the reference computes on the pages,
    so the benchmark compares like with like."""
    query, kv_cache, metadata = make_batch([query_len] * 3, [seq_len] * 3, heads="4:1",
                                           seed=seed_for(request.node.name))
    expected = get_attention_backend("reference").forward(query, kv_cache, metadata, scale=0.3)
    q, k, v = bench.dense_equivalent(query, kv_cache, metadata)
    dense = bench.sdpa(q, k, v, scale=0.3).transpose(1, 2).flatten(0, 1)
    torch.testing.assert_close(dense, expected, rtol=1e-5, atol=1e-5)
