"""Checks for exercise 06: the Triton decode kernel, against the torch reference.

Triton-Puzzles style: every case builds a random paged batch (pages scattered over the
pool, free cache slots poisoned with NaN, an output buffer full of NaN) and compares the
kernel with ``paged_attention_torch``. On a CPU the kernel runs in Triton's interpreter,
so the shapes are tiny. When the output is wrong, it is also compared with a few
"typical mistake" references (no scale, no window) to say what is probably missing.
"""

from __future__ import annotations

import torch

from microvllm.checks.report import Case, CheckFailure, CheckResult, run_checks

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _batch(seq_lens, *, heads=(2, 2), head_dim=16, dtype=torch.float32, seed=0, query_lens=None):
    from microvllm.bench.attention import random_paged_batch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    query_lens = query_lens if query_lens is not None else [1] * len(seq_lens)
    return random_paged_batch(query_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1],
                              head_dim=head_dim, block_size=16, dtype=dtype, device=device, seed=seed)


def check_decode_kernel(decode_attention, *, quiet: bool = False) -> CheckResult:
    """Check a ``decode_attention(query, kv_cache, metadata, *, scale, sliding_window, out)``."""
    from microvllm.attention.torch_ref import paged_attention_torch

    def compare(seq_lens, what, *, window=None, query_lens=None, **batch):
        query, kv_cache, metadata = _batch(seq_lens, query_lens=query_lens, **batch)
        head_dim = query.shape[-1]
        scale = head_dim ** -0.5
        expected = paged_attention_torch(query, kv_cache, metadata, scale=scale, sliding_window=window)
        out = torch.full_like(query, float("nan"))
        got = decode_attention(query, kv_cache, metadata, scale=scale, sliding_window=window, out=out)
        got = out if got is None else got
        n = metadata.num_actual_tokens
        where = (f"{what}: seq_lens {seq_lens}, {query.shape[1]} query heads / {kv_cache.shape[3]} KV heads, "
                 f"head_dim {head_dim}, block_size 16, {str(query.dtype).replace('torch.', '')}"
                 + (f", sliding_window {window}" if window else ""))
        nan_rows = got[:n].isnan().flatten(1).any(1).nonzero().flatten().tolist()
        if nan_rows:
            raise CheckFailure("the output has NaN", input=where, got=f"NaN in token rows {nan_rows}",
                               hint="NaN means a row was never written, or a masked (poisoned) cache slot "
                                    "was read: load K/V with mask=visible & dim_mask, other=0.0, and set "
                                    "the scores of invisible keys to -inf")
        tol = TOLERANCE[query.dtype]
        if torch.allclose(got[:n].float(), expected[:n].float(), **tol):
            return
        error = (got[:n].float() - expected[:n].float()).abs()
        worst = int(error.flatten(1).max(1).values.argmax())
        hint = _diagnose(got[:n], query, kv_cache, metadata, scale, window, tol)
        raise CheckFailure("the output differs from the torch reference", input=where,
                           expected=f"max |error| <= {tol['atol']}",
                           got=f"max |error| {float(error.max()):.3g} (worst at token row {worst})", hint=hint)

    cases = [
        Case("one request, one partial page", lambda: compare([5], "one request")),
        Case("ragged decodes over several pages (GQA 2:1)",
             lambda: compare([1, 16, 37, 50], "a batch", heads=(4, 2), seed=1)),
        Case("multi-query attention and a head_dim that is not a power of two",
             lambda: compare([3, 33], "MQA", heads=(4, 1), head_dim=24, seed=2)),
        Case("a sliding window that starts at many offsets in a page",
             lambda: compare(list(range(5, 23)), "window", window=5, heads=(2, 1), seed=3)),
        Case("a request with no token this step and one with seq_len 0",
             lambda: compare([17, 5, 0, 1], "empty rows", query_lens=[1, 0, 1, 1], seed=4)),
        Case("float16 inputs (accumulate in float32)",
             lambda: compare([9, 40], "float16", dtype=torch.float16, heads=(4, 2), seed=5)),
    ]
    return run_checks("check_decode_kernel", cases, quiet=quiet)


def _diagnose(got, query, kv_cache, metadata, scale, window, tol) -> str:
    from microvllm.attention.torch_ref import paged_attention_torch

    n = metadata.num_actual_tokens
    mistakes = [
        (dict(scale=1.0, sliding_window=window), "it matches attention WITHOUT the 1/sqrt(head_dim) scale: "
                                                 "multiply the scores by `scale`"),
        (dict(scale=scale, sliding_window=None), "it matches attention WITHOUT the sliding window: mask keys "
                                                 "before query_pos - SLIDING_WINDOW + 1"),
    ]
    for kwargs, hint in mistakes:
        if kwargs == dict(scale=scale, sliding_window=window):
            continue
        wrong = paged_attention_torch(query, kv_cache, metadata, **kwargs)
        if torch.allclose(got.float(), wrong[:n].float(), **tol):
            return hint
    return ("check the online softmax: m_new = max(m, max(s)); p = exp(s - m_new); alpha = exp(m - m_new); "
            "l = l * alpha + sum(p); acc = acc * alpha + sum(p[:, None] * v); out = acc / l; and that "
            "kv_head = head // NUM_QUERIES_PER_KV")
