"""What a step of the engine must cost at least, from the model's shapes alone.

Two limits bound any forward pass on this machine:

    compute   FLOPs / the rate of one large matrix product          (matmul_rate)
    memory    bytes that must be read / the rate of one large copy  (copy_bandwidth)

FLOPs of a step (every matrix product, multiply-add = 2 FLOPs)::

    2 x body parameters x tokens processed       every linear layer of every layer
  + 2 x vocab x hidden  x rows that get logits   lm_head, only where a token is sampled
  + 4 x heads x head_dim x visible (query, key) pairs x layers      QK^T and PV

Bytes a step must read: the weights once (body + lm_head), plus, for every request
in the batch, the K and V of every position it attends to, in every layer.

A mixture of experts (``layers/fused_moe/``) prices its experts apart from the body: each
token computes with k of E experts (FLOPs: 2 x expert parameters x k/E per token), and a
step reads the experts its tokens touched, E(1 - (1 - k/E)^T) of them for T tokens if the
router spread tokens evenly (a real router is less even, so fewer are touched).

The step's floor is max(compute, memory): a step can overlap the two, never beat
either. Python, kernel launches, small ops and cache misses all come on top.
``StepCost`` is what `microvllm bench throughput` sums over a recorded trace.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from microvllm.platforms.cpu.gemm import packing_available

EMBEDDING_NAMES = ("embed_tokens.weight", "lm_head.weight", "wte.weight")


@dataclass(frozen=True)
class ModelCost:
    """The shapes that price a forward pass, read from a Hugging Face folder."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    body_params: int          # every parameter except the input embedding and lm_head
    embedding_params: int     # input embedding (the lm_head too when tied)
    lm_head_params: int       # vocab x hidden, tied or not
    element_size: int         # bytes per weight / KV element in the run's dtype
    sliding_window: int | None = None
    expert_params: int = 0      # a mixture of experts: every expert of every layer (not in body)
    num_experts: int = 0
    experts_per_token: int = 0  # k, config.json's num_experts_per_tok

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: torch.dtype) -> "ModelCost":
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        body = embedding = experts = 0
        for shape_name, numel in _safetensors_numels(folder):
            if shape_name.endswith(EMBEDDING_NAMES):
                embedding += numel
            elif ".experts." in shape_name:
                experts += numel
            else:
                body += numel
        return cls(num_layers=config["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
                   hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                   body_params=body, embedding_params=embedding,
                   lm_head_params=config["vocab_size"] * config["hidden_size"],
                   element_size=torch.finfo(dtype).bits // 8,
                   sliding_window=config.get("sliding_window"), expert_params=experts,
                   num_experts=config.get("num_experts") or config.get("num_local_experts") or 0,
                   experts_per_token=config.get("num_experts_per_tok") or 0)

    @property
    def num_params(self) -> int:
        return self.body_params + self.embedding_params + self.expert_params

    def experts_touched(self, tokens: int) -> float:
        """Expected fraction of the experts that ``tokens`` tokens route to, were the router
        uniform: 1 - (1 - k/E)^T (0 for a dense model)."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** tokens

    @property
    def weight_bytes(self) -> int:
        """Weights a step reads in full: the body and lm_head (embedding rows are a lookup;
        a mixture of experts reads the experts its tokens touched on top: ``step_cost``)."""
        return (self.body_params + self.lm_head_params) * self.element_size

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    def visible_pairs(self, query_len: int, context_len: int) -> int:
        """(query, key) pairs a chunk of ``query_len`` tokens ending at ``context_len`` attends
        to: query row at position p sees keys 0..p, or the last ``sliding_window`` of them."""
        first, last = context_len - query_len + 1, context_len       # keys seen by each row
        window = self.sliding_window
        if window is None or last <= window:
            return (first + last) * query_len // 2
        below = max(0, min(last, window) - first + 1)                # rows not yet capped
        return ((first + first + below - 1) * below // 2 if below else 0) + window * (query_len - below)

    def attention_flops(self, query_len: int, context_len: int) -> float:
        return 4.0 * self.num_heads * self.head_dim * self.num_layers * \
            self.visible_pairs(query_len, context_len)

    def step_cost(self, chunks: list[tuple[int, int]], num_logit_rows: int) -> "StepCost":
        """``chunks``: (tokens computed this step, tokens computed before) per request."""
        tokens = sum(q for q, _ in chunks)
        linear = 2.0 * self.body_params * tokens + 2.0 * self.lm_head_params * num_logit_rows
        if self.num_experts:
            linear += 2.0 * self.expert_params * self.experts_per_token / self.num_experts * tokens
        attention = sum(self.attention_flops(q, before + q) for q, before in chunks)
        window = self.sliding_window
        attended = sum(min(before + q, window) if window else before + q for q, before in chunks)
        weights = self.weight_bytes if num_logit_rows else self.body_params * self.element_size
        weights += self.expert_params * self.experts_touched(tokens) * self.element_size
        return StepCost(tokens=tokens, logit_rows=num_logit_rows, linear_flops=linear,
                        attention_flops=attention,
                        bytes_read=weights + attended * self.kv_bytes_per_token())


@dataclass
class StepCost:
    tokens: int
    logit_rows: int
    linear_flops: float
    attention_flops: float
    bytes_read: float

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    def floor_s(self, flop_rate: float, bandwidth: float) -> float:
        return max(self.flops / flop_rate, self.bytes_read / bandwidth)

    def compute_bound(self, flop_rate: float, bandwidth: float) -> bool:
        return self.flops / flop_rate >= self.bytes_read / bandwidth


def trace_step_costs(trace, cost: ModelCost) -> list[StepCost]:
    """One `StepCost` per recorded step of a ``Trace`` (``LLM(..., trace=True)``)."""
    steps = []
    for step in trace:
        chunks = [(r.num_scheduled_tokens, r.num_computed_tokens_before) for r in step.scheduled]
        logit_rows = sum(len(t) > 0 for t in step.new_tokens.values())
        steps.append(cost.step_cost(chunks, logit_rows))
    return steps


def _safetensors_numels(folder: Path):
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors file")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                numel = 1
                for d in f.get_slice(name).get_shape():
                    numel *= d
                yield name, numel


# -------------------------------------------------------------- machine rates
def cpu_description() -> str:
    """The CPU model, its core count and which bfloat16 matmul units it has (Linux), e.g.
    "Intel(R) Xeon(R) Processor @ 2.60GHz, 2 cores, bf16 units: AMX". Without AMX or
    AVX512-BF16, bfloat16 matrix products are emulated and far slower than float32."""
    import os

    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    units = [label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"))
             if flag in flags]
    bf16 = ", ".join(units) if units else ("none" if flags else "unknown")
    return f"{name}, {os.cpu_count()} cores, bf16 units: {bf16}"


def matmul_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` product in ``dtype``, best of ``repeats`` (after a
    warm-up), through the faster of two GEMMs: ``torch.mm``, and oneDNN's with one operand
    packed once (what ``PackedGemm`` runs for large inputs). Neither is always the
    ceiling: in float32 torch.mm is Intel's MKL, which on an AMD EPYC (Zen 4) ran ~15 %
    below oneDNN's packed GEMM; on a Sapphire Rapids Xeon MKL was the faster."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    products = [lambda: torch.mm(a, b, out=out)]
    if packing_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b)   # y = a @ b.T: the same FLOPs
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s moved by one large copy (each byte read once and written once), best of
    ``repeats``. A step that must *read* N bytes needs at least N / this."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2.0 * nbytes / best


# The prefill budget of a step for a CPU server: the token count whose projections take
# about STEP_TARGET_S at the machine's measured GEMM rate, a power of two within the bounds.
STEP_TARGET_S = 0.5
BUDGET_BOUNDS = (256, 2048)


def serving_token_budget(cost: ModelCost, flop_rate: float, step_s: float = STEP_TARGET_S) -> int:
    """``max_num_batched_tokens`` for a server on this CPU, sized from the step it makes.

    A step's cost is mostly its projections, 2 x body parameters FLOPs per token (the
    experts' active share too). Every request decoding in a step waits for the whole
    step, so the budget bounds the inter-token latency a prompt's prefill inflicts on
    them: measured with ``vllm bench serve`` (64 prompts of 128 tokens, 4/s, float32) on
    the embedded SmolLM2-135M on 2 EPYC cores, a budget of 1024 gave ITL p99 0.98 s,
    512 0.75 s, 256 0.65 s; TTFT p99 1.75, 1.7-1.9 and 3.2 s (the smaller the budget,
    the more steps a burst of prompts takes, each paying for the decodes once more).
    Half a second of projections per step is the middle of that trade. Rounded to the
    nearest power of two on a log scale, so that the rate measurement's noise (~10 %)
    cannot flip it: it flips only where the exact count is ~1.41x a power of two. (Rounded
    down, the embedded model on that machine, 518 tokens, flipped between 256 and 512
    from one start to the next.)
    """
    per_token = 2.0 * (cost.body_params + cost.expert_params * (
        cost.experts_per_token / cost.num_experts if cost.num_experts else 0.0))
    tokens = flop_rate * step_s / per_token
    low, high = BUDGET_BOUNDS
    return int(min(max(2 ** round(math.log2(max(tokens, 1.0))), low), high))
