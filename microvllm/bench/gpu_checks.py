"""The correctness half of ``python -m microvllm bench gpu``: the engine on one device
against the engine on the CPU (greedy token ids, float32), and the Triton kernels
against the torch reference on fresh random inputs. Every function takes the
device, so the tests run them on a CPU (the kernels in Triton's interpreter)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from microvllm.bench.attention import random_paged_batch

ARCHS = ("llama", "mistral", "qwen3")


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"  {'ok  ' if self.passed else 'FAIL'} {self.name:44} {self.detail}"


def greedy_ids(folder, prompts: list[list[int]], max_tokens: int, **settings) -> list[list[int]]:
    from microvllm import LLM, SamplingParams

    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=64, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_parity(device: str, *, archs=ARCHS, num_prompts: int = 6, max_tokens: int = 16,
                  folder: Path | None = None) -> list[Check]:
    """For each tiny model: greedy ids on ``device`` (with its decode-step runner, and with
    ``enforce_eager``) equal the CPU engine's (``enforce_eager``, the torch backend), float32."""
    from microvllm.models.tiny import make_tiny_model

    root = Path(folder or tempfile.mkdtemp(prefix="microvllm-bench-gpu-"))
    g = torch.Generator().manual_seed(0)
    checks = []
    for arch in archs:
        model = make_tiny_model(root / arch, arch, seed=7, tokenizer=False)
        # Lengths around a block boundary, and a batch that pads to a captured size.
        prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist()
                   for n in torch.randint(1, 40, (num_prompts,), generator=g)]
        expected = greedy_ids(model, prompts, max_tokens, device="cpu", dtype="float32",
                              enforce_eager=True, attention_backend="torch")
        for eager in (False, True):
            got = greedy_ids(model, prompts, max_tokens, device=device, dtype="float32", enforce_eager=eager)
            same = sum(a == b for a, b in zip(got, expected))
            checks.append(Check(f"{arch} on {device}{' (enforce_eager)' if eager else ''} = cpu",
                                same == len(prompts), f"{same}/{len(prompts)} requests identical"))
    return checks


# (query_lens, seq_lens, sliding_window): decodes, chunks, a mix; GQA in every one
KERNEL_CASES = [
    ([1] * 8, [1, 15, 16, 17, 33, 64, 100, 7], None),
    ([5, 16, 1, 30], [5, 40, 70, 30], None),
    ([1, 1, 9, 3], [50, 20, 40, 3], 8),
]


def kernel_parity(device: str, dtype: torch.dtype = torch.float32, *, cases=KERNEL_CASES,
                  num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64,
                  seed: int = 123) -> list[Check]:
    """The Triton unified and decode kernels and ``write_kv`` against the torch reference
    on fresh random paged batches (unused cache slots NaN: a stray read shows)."""
    from microvllm.attention.torch_ref import TorchReferenceBackend
    from microvllm.attention.triton_backend import TritonAttentionBackend

    triton_backend, reference = TritonAttentionBackend(), TorchReferenceBackend()
    from microvllm.attention.triton_kernels.decode import decode_attention

    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    checks = []
    for index, (query_lens, seq_lens, window) in enumerate(cases):
        query, kv_cache, metadata = random_paged_batch(
            query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=16, dtype=dtype, device=device, seed=seed + index)
        scale = head_dim ** -0.5
        want = reference.forward(query, kv_cache, metadata, scale=scale, sliding_window=window).float()
        got = triton_backend.forward(query, kv_cache, metadata, scale=scale, sliding_window=window).float()
        error = (got - want).abs().max().item()
        checks.append(Check(f"unified kernel, case {index} ({dtype})", error <= tolerance, f"max|err| {error:.1e}"))
        if max(query_lens) == 1:
            got = decode_attention(query, kv_cache, metadata, scale=scale, sliding_window=window).float()
            error = (got - want).abs().max().item()
            checks.append(Check(f"decode kernel, case {index} ({dtype})", error <= tolerance,
                                f"max|err| {error:.1e}"))
    # write_kv: the same slots as the reference's index_copy_, padding (-1) skipped.
    key = torch.randn(6, num_kv_heads, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    slots = torch.tensor([3, 17, -1, 40, 63, -1], device=device)
    ours = torch.zeros(2, 4, 16, num_kv_heads, head_dim, device=device, dtype=dtype)
    theirs = ours.clone()
    triton_backend.write_kv(key, value, ours, slots)
    keep = slots >= 0
    reference.write_kv(key[keep], value[keep], theirs, slots[keep])
    checks.append(Check(f"write_kv ({dtype})", torch.equal(ours, theirs), "slot -1 writes nothing"))
    return checks
