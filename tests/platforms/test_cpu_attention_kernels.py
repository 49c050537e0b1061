"""The C++ CPU decode kernel and the "cpu" backend equal the torch reference on fresh
random inputs (tolerances in cases.py), and the build is cached, isolated and safe.

Decode-only batches use a NaN-poisoned cache (cases.py): the kernel reads pages in
place, so any slot it should not read would turn its output into NaN. Mixed batches
are not poisoned, because their prefill chunks go through the SDPA path, which
gathers whole pages (see test_torch_sdpa.py)."""

import subprocess
import sys

import pytest
import torch

from microvllm.attention.selector import get_attention_backend
from microvllm.attention.torch_ref import paged_attention_torch
from microvllm.bench.attention import random_paged_batch
from microvllm.platforms.cpu import attention as cpu_kernels
from microvllm.platforms.cpu.attention_backend import CPUAttentionBackend
from tests.attention.cases import HEADS, WINDOWS, assert_matches, batch_lengths, make_batch, seed_for

pytestmark = pytest.mark.skipif(cpu_kernels.kernel_status() is not None,
                                reason=f"CPU kernel unavailable: {cpu_kernels.kernel_status()}")


def decode_inputs(metadata):
    n = metadata.num_reqs
    return metadata.block_table[:n].contiguous(), metadata.seq_lens[:n].contiguous()


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_kernel_matches_reference(dtype, heads, window, block_size, request):
    query_lens, seq_lens = batch_lengths("decode", max(block_size, 4))
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, heads=heads, block_size=block_size,
                                           dtype=dtype, seed=seed_for(request.node.name))
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25,
                                     sliding_window=WINDOWS[window])
    block_table, lens = decode_inputs(metadata)
    out = torch.full_like(query, float("nan"))  # rows the kernel forgets stay NaN
    cpu_kernels.paged_attention_decode(query, kv_cache, block_table, lens, scale=0.25,
                                       sliding_window=WINDOWS[window], out=out)
    assert_matches(out, expected, len(query_lens))


@pytest.mark.parametrize("head_dim", [64, 128, 24])  # the two compiled sizes and the run-time one
def test_decode_kernel_head_dims_and_long_contexts(head_dim, request):
    """Realistic shapes: SmolLM2's 9:3 heads, contexts up to several hundred tokens."""
    seed = seed_for(request.node.name)
    seq_lens = torch.randint(1, 700, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    query, kv_cache, metadata = random_paged_batch([1] * 12, seq_lens, num_heads=9, num_kv_heads=3,
                                                   head_dim=head_dim, block_size=16, seed=seed)
    expected = paged_attention_torch(query, kv_cache, metadata, scale=head_dim ** -0.5)
    got = cpu_kernels.paged_attention_decode(query, kv_cache, *decode_inputs(metadata),
                                             scale=head_dim ** -0.5)
    assert_matches(got, expected, 12)
    # The same queries as a view of a fused QKV output (rows apart): read in place, same result.
    qkv = torch.cat([query, torch.full((12, 6, head_dim), float("nan"), dtype=query.dtype)], dim=1)
    view = qkv[:, :9]
    assert not view.is_contiguous()
    assert torch.equal(cpu_kernels.paged_attention_decode(view, kv_cache, *decode_inputs(metadata),
                                                          scale=head_dim ** -0.5), got)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("ordered", [True, False], ids=["decodes-first", "any-order"])
def test_backend_matches_reference(kind, ordered, request):
    query_lens, seq_lens = batch_lengths(kind, 16)
    if ordered:  # the runner's promise: decodes first
        order = sorted(range(len(query_lens)), key=lambda i: query_lens[i] != 1)
        query_lens, seq_lens = [query_lens[i] for i in order], [seq_lens[i] for i in order]
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, heads="4:1",
                                           seed=seed_for(request.node.name), poison=False)
    if ordered:
        metadata.num_decodes = sum(q == 1 for q in query_lens)
    backend = get_attention_backend("cpu")
    for window in WINDOWS.values():
        expected = paged_attention_torch(query, kv_cache, metadata, scale=0.25, sliding_window=window)
        got = backend.forward(query, kv_cache, metadata, scale=0.25, sliding_window=window)
        assert_matches(got, expected, len(query))


def test_rejects_inputs_it_cannot_take():
    query, kv_cache, metadata = make_batch([1, 1], [5, 20], heads="2:1")
    block_table, lens = decode_inputs(metadata)
    cases = [
        (dict(query=query.double()), TypeError, "supports"),
        (dict(kv_cache=kv_cache.half()), TypeError, "share a dtype"),
        (dict(seq_lens=lens.long()), TypeError, "int32"),
        (dict(query=query.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "heads are contiguous"),
        (dict(seq_lens=lens + 100), ValueError, "block_table holds"),
        (dict(kv_cache=kv_cache[..., :8].contiguous()), ValueError, "kv_cache must be"),
    ]
    for change, error, words in cases:
        args = dict(query=query, kv_cache=kv_cache, block_table=block_table, seq_lens=lens)
        args.update(change)
        with pytest.raises(error, match=words):
            cpu_kernels.paged_attention_decode(**args, scale=0.25)


def test_build_is_cached_and_falls_back_without_a_compiler(tmp_path):
    """Run in a fresh interpreter: it points the cache somewhere new and breaks the compiler."""
    script = f"""
import os, time
os.environ["MICROVLLM_CACHE"] = {str(tmp_path)!r}
from microvllm.platforms import get_platform
from microvllm.platforms.cpu import kernels
source = kernels.CSRC / "paged_attention.cpp"
first = kernels.build(source)
assert first.is_relative_to({str(tmp_path)!r}), first
mtime = first.stat().st_mtime_ns
assert kernels.build(source) == first and first.stat().st_mtime_ns == mtime   # cached: not rebuilt
kernels.load("paged_attention")
import torch
tiny = torch.tensor([1e-39]) / 8          # denormal results survive: no flush-to-zero
assert tiny.item() != 0.0, "loading the kernel switched the process to flush denormals"
os.environ["MICROVLLM_CACHE"] = {str(tmp_path / "other")!r}
os.environ["CXX"] = "/nonexistent/c++"
kernels.load.cache_clear(); kernels.status.cache_clear()
reason = kernels.status("paged_attention")
assert reason is not None and "/nonexistent/c++" in reason, reason
assert get_platform("cpu").resolve_attention_backend("auto") == "torch"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_cpu_backend_says_what_to_do_when_the_kernel_is_missing(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernel_status", lambda: "no C++ compiler found")
    with pytest.raises(RuntimeError, match="attention_backend='torch'"):
        CPUAttentionBackend()


@pytest.mark.parametrize("threads", [1, 8], ids=["task-per-request", "task-per-kv-head"])
def test_both_ways_of_splitting_work_match_the_reference(threads, request):
    """The kernel splits work by request when there is a request per thread, else by KV
    head too: 3 requests on 1 thread, and on 8 threads, take the two paths."""
    query, kv_cache, metadata = make_batch([1, 1, 1], [3, 70, 33], heads="4:1", head_dim=32,
                                           dtype="f32", seed=seed_for(request.node.name))
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)   # the kernel reads OpenMP's thread count, which torch sets
    try:
        got = cpu_kernels.paged_attention_decode(query, kv_cache, *decode_inputs(metadata), scale=0.2)
    finally:
        torch.set_num_threads(before)
    assert_matches(got, expected, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_matches_the_torch_code(dtype, block_size, request):
    """Keys and values taken as views of a fused QKV output (rows apart, heads contiguous),
    written to scattered slots: the same cache as two index_copy_ calls, bit for bit."""
    from microvllm.attention.torch_ref import write_kv_torch

    g = torch.Generator().manual_seed(seed_for(request.node.name))
    num_blocks, kv_heads, head_dim, tokens = 12, 3, 64, 9
    qkv = torch.randn(tokens, 9 + 2 * kv_heads, head_dim, generator=g).to(dtype)
    key, value = qkv[:, 9:9 + kv_heads], qkv[:, 9 + kv_heads:]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    expected = cache.clone()
    write_kv_torch(key, value, expected, slots)
    cpu_kernels.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_write_kv_refuses_a_slot_outside_the_cache():
    cache = torch.zeros(2, 4, 16, 1, 8)
    rows = torch.ones(2, 1, 8)
    with pytest.raises(IndexError, match=r"slot_mapping\[1\] = 64 is outside the cache's 64 slots"):
        cpu_kernels.write_kv(rows, rows, cache, torch.tensor([3, 64]))
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_kernels.write_kv(rows, rows, cache, torch.tensor([3]))


needs_prefill_kernel = pytest.mark.skipif(not cpu_kernels.prefill_supported(64),
                                          reason="the prefill kernel needs an AVX-512 build")
PREFILL_HEADS = {"9:3": (9, 3), "4:1": (4, 1), "mha": (2, 2)}


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("heads", list(PREFILL_HEADS))
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_kernel_matches_reference(dtype, heads, window, block_size, request):
    """Fresh prompts and chunks over cached context, of lengths that end inside a
    16-query tile and a 16-key tile, over a NaN-poisoned cache: reading any slot outside
    a request's context would put NaN in the output."""
    from tests.attention.cases import DTYPES
    num_heads, num_kv_heads = PREFILL_HEADS[heads]
    query_lens, seq_lens = [1, 16, 37, 6, 70], [1, 16, 37, 38, 100]
    query, kv_cache, metadata = random_paged_batch(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
        block_size=block_size, dtype=DTYPES[dtype], seed=seed_for(request.node.name))
    expected = paged_attention_torch(query, kv_cache, metadata, scale=0.125,
                                     sliding_window=WINDOWS[window])
    out = torch.full_like(query, float("nan"))
    cpu_kernels.paged_attention_prefill(query, kv_cache, metadata.block_table, metadata.query_start_loc,
                                        metadata.seq_lens, out, scale=0.125,
                                        sliding_window=WINDOWS[window])
    assert_matches(out, expected, sum(query_lens))


@needs_prefill_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_long_prompts(head_dim, request):
    seed = seed_for(request.node.name)
    lens = torch.randint(100, 400, (3,), generator=torch.Generator().manual_seed(seed)).tolist()
    query, kv_cache, metadata = random_paged_batch(lens, lens, num_heads=9, num_kv_heads=3,
                                                   head_dim=head_dim, block_size=16, seed=seed)
    expected = paged_attention_torch(query, kv_cache, metadata, scale=head_dim ** -0.5)
    out = cpu_kernels.paged_attention_prefill(query, kv_cache, metadata.block_table,
                                              metadata.query_start_loc, metadata.seq_lens,
                                              torch.empty_like(query), scale=head_dim ** -0.5)
    assert_matches(out, expected, sum(lens))


@needs_prefill_kernel
def test_cpu_backend_sends_prefill_chunks_to_the_kernel(monkeypatch, request):
    """A mixed step in the runner's order (decodes first): decodes through the decode
    kernel, prefill chunks through the prefill kernel, all rows equal to the reference."""
    calls = []
    real = cpu_kernels.paged_attention_prefill
    monkeypatch.setattr(cpu_kernels, "paged_attention_prefill",
                        lambda *a, **kw: calls.append(len(a[4])) or real(*a, **kw))
    query_lens, seq_lens = [1, 1, 20, 33], [30, 7, 20, 50]
    query, kv_cache, metadata = random_paged_batch(query_lens, seq_lens, num_heads=9, num_kv_heads=3,
                                                   head_dim=64, block_size=16,
                                                   seed=seed_for(request.node.name), poison=False)
    metadata.num_decodes = 2
    got = get_attention_backend("cpu").forward(query, kv_cache, metadata, scale=0.125)
    assert calls == [2]                                   # the two prefill chunks, one call
    assert_matches(got, paged_attention_torch(query, kv_cache, metadata, scale=0.125), sum(query_lens))


@needs_prefill_kernel
def test_prefill_kernel_refuses_inputs_it_cannot_take():
    query, kv_cache, metadata = random_paged_batch([5], [5], num_heads=2, num_kv_heads=1,
                                                   head_dim=64, block_size=16)
    args = (query, kv_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
            torch.empty_like(query))
    with pytest.raises(ValueError, match="block_table holds"):
        cpu_kernels.paged_attention_prefill(*args[:4], metadata.seq_lens + 100, args[5], scale=1.0)
    with pytest.raises(TypeError, match="int32"):
        cpu_kernels.paged_attention_prefill(*args[:4], metadata.seq_lens.long(), args[5], scale=1.0)
    with pytest.raises(ValueError, match="head_dim=24"):
        q24 = torch.randn(5, 2, 24)
        cpu_kernels.paged_attention_prefill(q24, kv_cache[..., :24].contiguous(), *args[2:5],
                                            torch.empty_like(q24), scale=1.0)


@needs_prefill_kernel
@pytest.mark.parametrize("dtype,longest,kernel", [(torch.float32, 600, True), (torch.bfloat16, 300, True),
                                                  (torch.bfloat16, 600, False)])
def test_low_precision_long_chunks_go_to_sdpa(dtype, longest, kernel, monkeypatch):
    """float32 chunks always take the kernel; bfloat16 ones only up to
    LOW_PRECISION_PREFILL_MAX tokens (SDPA's bfloat16 matmuls win on longer ones)."""
    from microvllm.platforms.cpu import attention_backend as cpu_backend
    assert cpu_backend.LOW_PRECISION_PREFILL_MAX < 600
    calls = []
    real = cpu_kernels.paged_attention_prefill
    monkeypatch.setattr(cpu_kernels, "paged_attention_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    query, kv_cache, metadata = random_paged_batch([1, longest], [9, longest], num_heads=2, num_kv_heads=1,
                                                   head_dim=64, block_size=16, dtype=dtype, poison=False)
    metadata.num_decodes = 1
    got = get_attention_backend("cpu").forward(query, kv_cache, metadata, scale=0.125)
    assert bool(calls) == kernel
    assert_matches(got, paged_attention_torch(query, kv_cache, metadata, scale=0.125), len(query))
