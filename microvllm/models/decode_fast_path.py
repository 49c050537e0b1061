"""A decode step's decoder layers as one plain loop of C kernel calls: the CPU's answer to CUDA graphs.

In a decode step every operator is small (a few rows), so what it costs is mostly
the work around it: the module call, the wrapper's checks, a tensor allocation,
ctypes turning tensors into pointers. That is 20-60 us per operator, and a step of
SmolLM2-135M runs ~300 of them: a third of a bfloat16 step at batch 32, half of
it at batch 1. vLLM meets the same problem on a GPU, as kernel-launch overhead, and
answers it with CUDA graphs: it records a decode step's kernel launches once per
batch size and replays them all with one call.

A CPU has no graph to replay, but the same idea removes most of the cost: settle
everything that is the same for every layer once per step (buffers for every
intermediate, the attention metadata's pointers, which kernels), then run the layers
as a loop of the very C functions the modules' wrappers call, with raw pointers::

    once per step    buffers [T, ...] for x, qkv, qk, attn, h, gate_up, act (T = batch)
                     block table, seq_lens, slot mapping, cos / sin: checked, as pointers
    every layer      10 C calls, no tensor made, nothing checked again:

      rms_norm(h, residual)           -> x        [T, hidden]      residual += h, in place
      gemm(x, W_qkv)                  -> qkv      [T, (Hq + 2 Hkv) d]
      rope(qkv[:, :Hq + Hkv])         -> qk       [T, Hq + Hkv, d]  queries and keys rotated
      write_kv(qk[:, Hq:], qkv[:, Hq + Hkv:])     -> kv_cache       this step's keys, values
      paged_attention_decode(qk[:, :Hq], kv_cache) -> attn    [T, Hq d]
      gemm(attn, W_o)                 -> h        [T, hidden]
      rms_norm(h, residual)           -> x
      gemm(x, W_gate_up)              -> gate_up  [T, 2 I]
      silu_and_mul(gate_up)           -> act      [T, I]
      gemm(act, W_down)               -> h

Same kernels in the same order on the same inputs: the result is bit for bit what
``LlamaDecoderLayer`` computes (tests/models/test_decode_fast_path.py checks), and
``llama.py`` stays the definition of the model. Measured on a 2-core Sapphire Rapids
Xeon, SmolLM2-135M, interleaved steps of one engine: bfloat16 36 -> 20 ms per step at
batch 1 and 60 -> 42 ms at batch 32; float32 50 -> 37 ms and 113 -> 88 ms.

It applies to decode-only steps (every request computes one token) of up to
``AMX_MAX_ROWS`` (bfloat16) or ``AVX512_MAX_ROWS`` (float32) requests, on a CPU whose
projections have those kernels, with the ``cpu`` attention backend, for Llama and
Mistral layers (not Qwen3's per-head norms). Every other step runs the modules.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from microvllm import cpp_extension
from microvllm.attention import cpu_kernels as attention_kernels
from microvllm.attention.cpu_backend import CPUAttentionBackend
from microvllm.attention.metadata import AttentionMetadata
from microvllm.cpp_extension import DTYPE_CODES
from microvllm.layers import cpu_kernels
from microvllm.layers.linear import AMX_MAX_ROWS, AVX512_MAX_ROWS, Linear

# dtype -> (the PackedGemm pack whose kernel runs the projections, most rows it takes)
GEMM_KERNELS = {torch.bfloat16: ("amx", AMX_MAX_ROWS), torch.float32: ("avx512", AVX512_MAX_ROWS)}


def unsupported_reason(model) -> str | None:
    """None if ``model``'s decode steps can take the fast path here, else why not."""
    dtype = model.embed_tokens.weight.dtype
    if dtype not in GEMM_KERNELS:
        return f"{dtype} (the fast path runs float32 and bfloat16)"
    if model.embed_tokens.weight.device.type != "cpu":
        return "the model is not on a CPU"
    if model.qk_norm:
        return "per-head query / key norms (Qwen3) are not in the fast path's layer"
    for reason in (cpu_kernels.norm_rope_status(), cpu_kernels.activation_status(),
                   attention_kernels.kernel_status()):
        if reason is not None:
            return reason
    kind = GEMM_KERNELS[dtype][0]
    for layer in model.layers:
        if not isinstance(layer.self_attn.attn.backend, CPUAttentionBackend):
            return "the attention backend is not 'cpu'"
        for linear in _projections(layer):
            if kind not in linear.gemm.packings(linear.weight):
                return f"{linear.weight.dtype} {list(linear.weight.shape)} weights cannot use the {kind} kernel here"
    return None


def _projections(layer) -> tuple[Linear, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


class DecodeFastPath:
    """Runs a Llama model's decoder layers for a decode-only step (see the module doc)."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the decode fast path does not apply: {reason}")
        self.model = model
        self.dtype = model.embed_tokens.weight.dtype
        self.kind, self.max_rows = GEMM_KERNELS[self.dtype]
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden = model.config.hidden_size
        self.intermediate = model.layers[0].mlp.down_proj.weight.shape[1]
        gemm = cpu_kernels.load_amx().amx_linear if self.kind == "amx" else cpu_kernels.load_avx512().avx512_linear
        norm_rope, attention = cpu_kernels.load_norm_rope(), attention_kernels.load()
        # The C functions, all with the signatures their wrappers declare.
        self.kernels = SimpleNamespace(
            rms_norm=norm_rope.rms_norm, rope=norm_rope.rope, gemm=gemm,
            write_kv=attention.write_kv, paged_attention_decode=attention.paged_attention_decode,
            silu_and_mul=cpu_kernels.load_activation().silu_and_mul)
        # The same, each inside a named range, for when torch.profiler is on (bench --profile).
        names = {"gemm": f"microvllm::{self.kind}_linear"}
        self.profiled_kernels = SimpleNamespace(**{
            name: _profiled(names.get(name, f"microvllm::{name}"), fn)
            for name, fn in vars(self.kernels).items()})

    def applies(self, num_tokens: int, attn_metadata: list[AttentionMetadata]) -> bool:
        """Whether this step is one the fast path runs: decode-only, small enough, no autograd."""
        return (0 < num_tokens <= self.max_rows and not torch.is_grad_enabled()
                and all(m.num_decodes == m.num_reqs == num_tokens for m in attn_metadata))

    def __call__(self, hidden: torch.Tensor, cos_sin, kv_caches: list[torch.Tensor],
                 attn_metadata: list[AttentionMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, hidden]`` (the embeddings) through every decoder layer; returns
        ``(h, residual)`` as the layer loop in ``LlamaForCausalLM.forward`` leaves them."""
        k = self.profiled_kernels if torch._C._autograd._profiler_enabled() else self.kernels
        T, H, I, d = hidden.shape[0], self.hidden, self.intermediate, self.head_dim
        Hq, Hkv, code = self.num_heads, self.num_kv_heads, DTYPE_CODES[self.dtype]
        qkv_cols = (Hq + 2 * Hkv) * d

        def buffer(*shape):
            return torch.empty(*shape, dtype=self.dtype)
        residual, x, h = hidden.clone(), buffer(T, H), buffer(T, H)
        qkv, qk, attn = buffer(T, qkv_cols), buffer(T, Hq + Hkv, d), buffer(T, Hq * d)
        gate_up, act = buffer(T, 2 * I), buffer(T, I)
        cos, sin = (t.reshape(T, d // 2).to(self.dtype).contiguous() for t in cos_sin)
        groups = [self._step_metadata(m, qk, attn, kv_caches) for m in attn_metadata]
        row = qkv.element_size()   # bytes per element: offsets into qkv / qk rows

        for i, layer in enumerate(self.model.layers):
            self_attn, mlp = layer.self_attn, layer.mlp
            block_table, seq_lens, slots, max_blocks = groups[self.model.layout.layer_to_group[i]]
            kv_cache = kv_caches[i]
            num_slots = kv_cache.shape[1] * kv_cache.shape[2]
            norm = layer.input_layernorm
            if i == 0:   # the residual stream starts as the embeddings: normalise them
                k.rms_norm(code, residual.data_ptr(), None, norm.weight.data_ptr(), x.data_ptr(), T, H, norm.eps)
            else:        # residual += h (the previous MLP's output), normalised
                k.rms_norm(code, h.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(), x.data_ptr(),
                           T, H, norm.eps)
            self._gemm(k, self_attn.qkv_proj, x, qkv)
            k.rope(code, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qk.data_ptr(), T, Hq + Hkv, d, qkv_cols)
            bad = k.write_kv(qk.data_ptr() + Hq * d * row, qkv.data_ptr() + (Hq + Hkv) * d * row,
                             (Hq + Hkv) * d, qkv_cols, kv_cache.data_ptr(), slots.data_ptr(), T,
                             num_slots, Hkv * d, row)
            if bad >= 0:
                raise attention_kernels.bad_slot_error(slots, bad, num_slots)
            k.paged_attention_decode(code, qk.data_ptr(), (Hq + Hkv) * d, kv_cache.data_ptr(),
                                     block_table.data_ptr(), seq_lens.data_ptr(), attn.data_ptr(), T,
                                     Hq, Hkv, d, kv_cache.shape[2], kv_cache.shape[1], max_blocks,
                                     self_attn.attn.scale, self_attn.attn.sliding_window or 0)
            self._gemm(k, self_attn.o_proj, attn, h)
            norm = layer.post_attention_layernorm
            k.rms_norm(code, h.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(), x.data_ptr(),
                       T, H, norm.eps)
            self._gemm(k, mlp.gate_up_proj, x, gate_up)
            k.silu_and_mul(code, gate_up.data_ptr(), act.data_ptr(), T, I)
            self._gemm(k, mlp.down_proj, act, h)
        return h, residual

    def _gemm(self, k, linear: Linear, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out = x @ W.T (+ bias)`` through the kernel ``PackedGemm`` picks at these rows."""
        packed = linear.gemm.pack(linear.weight, self.kind)   # current: repacked if W changed
        bias = linear.bias.data_ptr() if linear.bias is not None else None
        k.gemm(x.data_ptr(), packed.data_ptr(), bias, out.data_ptr(), x.shape[0], out.shape[1], x.shape[1])

    @staticmethod
    def _step_metadata(metadata: AttentionMetadata, qk, attn, kv_caches):
        """One cache group's metadata, checked once for all its layers as the decode
        wrapper checks it every call, in the dtypes and layout the kernels read."""
        num_heads = attn.shape[1] // qk.shape[2]
        block_table, seq_lens = metadata.block_table.contiguous(), metadata.seq_lens.contiguous()
        attention_kernels.check_inputs(qk[:, :num_heads], kv_caches[0], block_table, seq_lens,
                                       attn.view(qk.shape[0], num_heads, qk.shape[2]))
        slots = metadata.slot_mapping.to(torch.int64).contiguous()
        return block_table, seq_lens, slots, block_table.shape[1]


def _profiled(name: str, fn):
    def call(*args):
        with cpp_extension.profiled(name):
            return fn(*args)
    return call

