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

    def compare(seq_lens, what, *, window=None, query_lens=None, fused_query=False, **batch):
        query, kv_cache, metadata = _batch(seq_lens, query_lens=query_lens, **batch)
        head_dim = query.shape[-1]
        scale = head_dim ** -0.5
        expected = paged_attention_torch(query, kv_cache, metadata, scale=scale, sliding_window=window)
        if fused_query:
            query, out, canary = _engine_layouts(query)
        else:
            out, canary = torch.full_like(query, float("nan")), None
        got = decode_attention(query, kv_cache, metadata, scale=scale, sliding_window=window, out=out)
        got = out if got is None else got
        n = metadata.num_actual_tokens
        where = (f"{what}: seq_lens {seq_lens}, {query.shape[1]} query heads / {kv_cache.shape[3]} KV heads, "
                 f"head_dim {head_dim}, block_size 16, {str(query.dtype).replace('torch.', '')}"
                 + (f", sliding_window {window}" if window else ""))
        if canary is not None and not canary.isnan().all():
            raise CheckFailure("your kernel wrote outside `out`", input=where + f"; query strides "
                               f"{tuple(query.stride())}, out strides {tuple(out.stride())}",
                               got=f"{int((~canary.isnan()).sum())} values written past the end of out",
                               hint="store with out's strides (stride_out_token, stride_out_head), not the "
                                    "query's: in the engine the query is a view into the fused QKV "
                                    "projection and out is a tensor of its own, so their layouts differ")
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
        Case("the query and out in different layouts (the query a view into the fused QKV, as in the engine)",
             lambda: compare([3, 20, 35], "layouts", heads=(4, 2), seed=6, fused_query=True)),
    ]
    return run_checks("check_decode_kernel", cases, quiet=quiet)


def _engine_layouts(query: torch.Tensor):
    """The engine's layouts: the query a view into a fused [tokens, (H + 2 * KV) * D] projection
    (rows strided by the whole QKV width), out a compact tensor of its own. Out sits at the start
    of a NaN buffer as long as the fused one, so a kernel that stores with the query's strides
    writes into that buffer's tail (the canary) instead of past the end of any allocation."""
    num_tokens, num_heads, head_dim = query.shape
    width = 2 * num_heads * head_dim   # the query's heads, then room for the keys and values
    fused = torch.full((num_tokens, width), float("nan"), dtype=query.dtype, device=query.device)
    fused_query = fused[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    fused_query.copy_(query)
    backing = torch.full((num_tokens * width,), float("nan"), dtype=query.dtype, device=query.device)
    out = backing[:query.numel()].view_as(query)
    return fused_query, out, backing[query.numel():]


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
    # Off by one in the mask: the query's own key left out, or a window one key short.
    off_by_one = [(dict(last=-1), "it matches attention that leaves out the newest key (the query's own): "
                                  "keys up to AND including query_pos = seq_len - 1 are visible (<=, not <)"),
                  (dict(first=1), "it matches attention that leaves out the oldest visible key: first_key "
                                  "itself (0, or query_pos - SLIDING_WINDOW + 1 in a window) is visible "
                                  "(>=, not >)")]
    for shift, hint in off_by_one:
        wrong = _decode_with_shifted_mask(query, kv_cache, metadata, scale, window, **shift)
        if torch.allclose(got.float(), wrong[:n].float(), **tol):
            return hint
    # Right within one page, wrong across pages: what carries from page to page is wrong.
    reference = paged_attention_torch(query, kv_cache, metadata, scale=scale, sliding_window=window)[:n]
    row_error = (got.float()[:n] - reference.float()).abs().flatten(1).amax(dim=1)
    qsl, seq_lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
    block_size = kv_cache.shape[2]
    pages = {qsl[i]: -(-seq_lens[i] // block_size) for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1}
    one_page = [row_error[row] <= tol["atol"] for row, num in pages.items() if num <= 1 and row < n]
    several = [row_error[row] <= tol["atol"] for row, num in pages.items() if num > 1 and row < n]
    if one_page and several and all(one_page) and not any(several):
        return ("requests whose keys fit in one page are right, those over several pages are wrong: the "
                "fault is in what carries from one page to the next. When the running max grows, the sums "
                "so far must be rescaled: alpha = exp(m - m_new); l = l * alpha + sum(p); acc = acc * alpha "
                "+ sum(p[:, None] * v); then m = m_new")
    return ("check the online softmax: m_new = max(m, max(s)); p = exp(s - m_new); alpha = exp(m - m_new); "
            "l = l * alpha + sum(p); acc = acc * alpha + sum(p[:, None] * v); out = acc / l; and that "
            "kv_head = head // NUM_QUERIES_PER_KV")


def _decode_with_shifted_mask(query, kv_cache, metadata, scale, window, *, first=0, last=0):
    """Decode attention whose visible keys are [first_key + first, query_pos + last]: the
    reference for a mask that is off by one at either end."""
    from microvllm.attention.torch_ref import gather_context

    group = query.shape[1] // kv_cache.shape[3]
    out = torch.zeros_like(query)
    qsl, seq_lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        if qsl[i + 1] == qsl[i]:
            continue
        query_pos = seq_len - 1
        lo = (max(query_pos - window + 1, 0) if window else 0) + first
        hi = query_pos + last
        if hi < lo:
            continue   # no key visible: zeros
        keys, values = gather_context(kv_cache, metadata.block_table[i], seq_len)
        keys = keys[lo:hi + 1].repeat_interleave(group, dim=1).float().transpose(0, 1)     # [h, k, d]
        values = values[lo:hi + 1].repeat_interleave(group, dim=1).float().transpose(0, 1)
        q = query[qsl[i]].float()[:, None, :]                                               # [h, 1, d]
        probs = torch.softmax((q @ keys.transpose(1, 2)) * scale, dim=-1)
        out[qsl[i]] = (probs @ values)[:, 0].to(query.dtype)
    return out


def decode_kernel_preflight(attention_backend: str | None) -> str | None:
    """Before the engine launches a learner's decode kernel (a registered backend whose
    ``_decode_attention`` is not the package's): run ``check_decode_kernel`` on it, quietly.
    None when it passes (or there is no such kernel); else what to say instead of running.

    A kernel that stores with the wrong strides writes past the end of its output tensor;
    compiled, or in Triton's interpreter, that corrupts memory and the Jupyter kernel dies
    ("double free or corruption") instead of printing a report."""
    from microvllm.attention.selector import BUILTIN_BACKENDS, get_attention_backend_class

    if not attention_backend or attention_backend in BUILTIN_BACKENDS or attention_backend == "auto":
        return None
    backend = get_attention_backend_class(attention_backend)()
    kernel = getattr(backend, "_decode_attention", None)
    if kernel is None or not getattr(backend, "use_decode_kernel", True):
        return None
    from microvllm.attention.triton_kernels import decode

    if kernel is decode.decode_attention:
        return None
    result = check_decode_kernel(kernel, quiet=True)
    if result.passed:
        return None
    if result.not_implemented:
        todo = next(c.message for c in result.cases if c.status == "todo")
        return f"not implemented yet: {todo}\nFinish the exercise above, then run this cell again."
    first = result.failures[0]
    return ("✗ not run: your decode kernel fails check_decode_kernel, and launching the engine with it "
            "could write outside its tensors and crash the Jupyter kernel.\n"
            f"  ✗ {first.name}\n" + "".join(f"      {line}\n" for line in first.lines)
            + "Fix the kernel until check_decode_kernel passes, then run this cell again.")
