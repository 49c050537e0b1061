"""Benchmark the Triton paged-attention kernels: ``python -m microvllm bench attention``.

For the attention shape of a real 8B model (32 query heads, 8 KV heads, head dim
128) and a grid of batch sizes and context lengths, time on a CUDA GPU:

    triton    the unified kernel through the backend (paged KV cache)
    decode    the teaching decode-only kernel (decode shapes only)
    torch     the torch reference, request by request (the correctness oracle)
    sdpa      torch.nn.functional.scaled_dot_product_attention on the same K/V
              copied into dense [batch, kv_heads, context, head_dim] tensors

Decode is bound by memory bandwidth: every step reads the whole KV cache of the
batch once. So next to the time we print the bandwidth the Triton kernel achieves,
``bytes that must move / time``, as a fraction of what a plain device-to-device
copy reaches on the same GPU. Prefill is bound by arithmetic: we print TFLOP/s.

On a machine without CUDA it says so and returns 0. ``random_paged_batch`` is
also what the tests and notebook 06 use to build inputs.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from microvllm.attention import get_attention_backend
from microvllm.attention.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128   # Llama-3-8B / Mistral-7B attention


def random_paged_batch(query_lens: list[int], seq_lens: list[int], *, num_heads: int,
                       num_kv_heads: int, head_dim: int, block_size: int,
                       dtype=torch.float32, device="cpu", seed: int = 0,
                       num_padding_tokens: int = 0, poison: bool = True):
    """Random ``(query, kv_cache, metadata)`` for requests with these chunk and sequence
    lengths, their pages scattered over the pool in random order.

    As in the engine, block 0 is the null block: no request's pages are there, and unused
    block-table entries point at it. With ``poison`` every cache slot that holds no token
    of any request (the null block, a free block, the unused tail of each last page) is
    NaN: a kernel that reads anything it should not returns NaN.
    ``num_padding_tokens`` adds query rows that belong to no request."""
    assert len(query_lens) == len(seq_lens)
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2           # + the null block (0) and a free block, never used
    pool = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
    pool.pop()                                      # the free block
    width = max([1, *blocks_per_req])
    table = [[pool.pop() for _ in range(n)] + [0] * (width - n) for n in blocks_per_req]

    def slots(i: int, positions: range) -> list[int]:  # -1: a position before the sequence
        return [table[i][p // block_size] * block_size + p % block_size if p >= 0 else -1
                for p in positions]

    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                           generator=gen, device=device, dtype=dtype)
    if poison:
        live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for i, s in enumerate(seq_lens):
            live[slots(i, range(s))] = True
        kv_cache.view(2, -1, num_kv_heads, head_dim)[:, ~live.to(device)] = float("nan")

    slot_mapping = [slot for i, (q, s) in enumerate(zip(query_lens, seq_lens))
                    for slot in slots(i, range(s - q, s))]
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens + num_padding_tokens, num_heads, head_dim,
                        generator=gen, device=device, dtype=dtype)
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=list(seq_lens))
    return query, kv_cache, metadata


def dense_equivalent(query, kv_cache, metadata: AttentionMetadata):
    """The same batch as dense tensors for SDPA, when every request has the same
    chunk and sequence length: ``q [batch, heads, query_len, head_dim]`` and
    ``k, v [batch, kv_heads, seq_len, head_dim]`` (pages gathered in logical order)."""
    batch, seq_len = metadata.num_reqs, metadata.max_seq_len
    query_len = metadata.max_query_len
    num_pages = -(-seq_len // kv_cache.shape[2])
    pages = metadata.block_table[:, :num_pages].long()                # [batch, pages]

    def gather(cache):  # [blocks, block_size, kv_heads, d] -> [batch, kv_heads, seq, d]
        return cache[pages].flatten(1, 2)[:, :seq_len].transpose(1, 2)  # one copy, a view

    q = query[:batch * query_len].view(batch, query_len, *query.shape[1:]).transpose(1, 2)
    return q, gather(kv_cache[0]), gather(kv_cache[1])


def sdpa(q, k, v, *, scale: float):
    """Dense causal attention; the query rows are the last of each sequence, so for
    a chunk shorter than the context the causal mask is bottom-right aligned."""
    query_len, seq_len = q.shape[2], k.shape[2]
    mask = None
    if 1 < query_len < seq_len:
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(
            seq_len - query_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          is_causal=query_len == seq_len > 1, enable_gqa=True)


def time_cuda(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after one warm-up run
    (which also compiles the Triton kernel)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), repeats=10)
    return 2 * nbytes / (ms / 1e3)


def bytes_moved(batch: int, query_len: int, seq_len: int, element_size: int) -> int:
    """The least memory traffic of attention: read Q, every cached K and V once, write O."""
    kv = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM
    q_and_out = 2 * batch * query_len * NUM_HEADS * HEAD_DIM
    return (kv + q_and_out) * element_size


def flops(batch: int, query_len: int, seq_len: int) -> float:
    """Multiply-adds of Q @ K^T and P @ V over the causally visible keys (x2 = FLOPs)."""
    visible = query_len * (seq_len - query_len) + query_len * (query_len + 1) / 2
    return 4 * batch * visible * NUM_HEADS * HEAD_DIM


def bench_case(backend, decode_attention, kind: str, batch: int, context: int, args,
               copy_bw: float) -> None:
    dtype = getattr(torch, args.dtype)
    element_size = torch.finfo(dtype).bits // 8
    query_len = 1 if kind == "decode" else context
    cache_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element_size
    q_bytes = batch * query_len * NUM_HEADS * HEAD_DIM * element_size
    # The paged cache and its dense copy for SDPA; q, two outputs and their float32
    # copies for the error check. Keep 20% of the free memory as headroom.
    needed = 2 * cache_bytes + 3 * q_bytes + 2 * q_bytes * 4 // element_size
    free, _ = torch.cuda.mem_get_info()
    if needed > 0.8 * free:
        print(f"{kind:8}{batch:>6}{context:>8}   skipped: needs {needed / 2**30:.1f} GiB, "
              f"{free / 2**30:.1f} GiB free")
        return
    query, kv_cache, metadata = random_paged_batch(
        [query_len] * batch, [context] * batch, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, block_size=args.block_size, dtype=dtype, device="cuda",
        poison=False)
    scale = HEAD_DIM ** -0.5
    q, k, v = dense_equivalent(query, kv_cache, metadata)
    reference = get_attention_backend("torch")

    def triton_fn():
        return backend.forward(query, kv_cache, metadata, scale=scale)

    def sdpa_fn():
        return sdpa(q, k, v, scale=scale)

    def reference_fn():
        return reference.forward(query, kv_cache, metadata, scale=scale)

    triton_ms = time_cuda(triton_fn, args.repeats)
    sdpa_ms = time_cuda(sdpa_fn, args.repeats)
    decode_ms = (time_cuda(lambda: decode_attention(query, kv_cache, metadata, scale=scale),
                           args.repeats) if kind == "decode" else float("nan"))
    # The reference materialises [heads, query_len, context] float32 scores per request.
    ref_bytes = NUM_HEADS * query_len * context * 4 * 3
    torch_ms = (time_cuda(reference_fn, max(1, args.repeats // 5))
                if not args.no_reference and ref_bytes < 0.25 * free else float("nan"))
    error = (triton_fn().float() - sdpa_fn().transpose(1, 2).flatten(0, 1).float()).abs().max()

    bandwidth = bytes_moved(batch, query_len, context, element_size) / (triton_ms / 1e3)
    tflops = flops(batch, query_len, context) / (triton_ms / 1e3) / 1e12
    times = "".join(f"{ms:>10.3f}" if ms == ms else f"{'-':>10}"   # NaN: not measured
                    for ms in (triton_ms, decode_ms, torch_ms, sdpa_ms))
    print(f"{kind:8}{batch:>6}{context:>8}{times}{bandwidth / 1e9:>9.0f}"
          f"{bandwidth / copy_bw:>8.0%}{tflops:>8.1f}{error.item():>10.1e}")
    query = kv_cache = q = k = v = None   # free them (the timed closures above hold the names)
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microvllm bench attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kinds", default="decode,prefill")
    parser.add_argument("--decode-batches", default="1,16,64,256")
    parser.add_argument("--prefill-batches", default="1,4,16")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the (slow) torch reference")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench attention times GPU kernels and needs a CUDA GPU; this machine has "
              "none, so there is nothing to measure.")
        return 0

    from microvllm.attention.triton_kernels.decode import decode_attention  # imports triton
    backend = get_attention_backend("triton")
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bw / 1e9:.0f} GB/s; "
          f"{NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head dim {HEAD_DIM}, "
          f"{args.dtype}, block size {args.block_size}; times in ms (median)")
    print(f"{'kind':8}{'batch':>6}{'context':>8}{'triton':>10}{'decode':>10}{'torch':>10}"
          f"{'sdpa':>10}{'GB/s':>9}{'of copy':>8}{'TFLOP/s':>8}{'max|err|':>10}")
    contexts = [int(c) for c in args.contexts.split(",")]
    for kind in args.kinds.split(","):
        batches = args.decode_batches if kind == "decode" else args.prefill_batches
        for batch in [int(b) for b in batches.split(",")]:
            for context in contexts:
                bench_case(backend, decode_attention, kind, batch, context, args, copy_bw)
    return 0
