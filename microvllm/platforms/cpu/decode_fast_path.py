"""A decode step in one C++ call for its layers: the CPU's answer to CUDA graphs.

In a decode step every operator is small (a few rows), so what it costs is mostly
the work around it: the module call, the wrapper's checks, a tensor allocation,
ctypes turning tensors into pointers. That is 20-60 us per operator, and a step of
SmolLM2-135M runs ~300 of them: a third of a bfloat16 step at batch 32, half of it
at batch 1. vLLM meets the same problem on a GPU, as kernel-launch overhead, and
answers it with CUDA graphs: it records a decode step's kernel launches once per
batch size and replays them all with one call (for decode-only, "uniform decode"
batches in ``cudagraph_mode`` FULL_DECODE_ONLY; ``vllm/compilation/cuda_graph.py``).

A CPU has no graph to replay, but the same idea removes the cost: settle everything
that is the same for every layer once per step (buffers for every intermediate, the
attention metadata, which kernels), then run the layers as a loop that calls the very
C functions the modules' CPU versions call. The loop is ``csrc/decode_layers.cpp``::

    once per model   Layer records: each layer's weight pointers (packed for the GEMM
                     kernel), norm weights, its KV cache, eps, scale, sliding window
    once per step    buffers [T, ...] for residual, x, h, qkv, qk, attn, gate_up, act
                     (T = batch); per cache group: block table and seq_lens, checked, and
                     the slot mapping (write_kv checks each slot as it writes)
    one C call       decode_layers(): for each layer, 10 kernel calls

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
``LlamaForCausalLM.forward`` computes with the CPU platform's ops
(tests/platforms/test_decode_fast_path.py checks), and ``llama.py`` stays the definition
of the model. Like vLLM's ``CUDAGraphWrapper``, it is applied by the model runner
(``ModelRunner.run_model``), never inside the model; ``enforce_eager=True`` turns it
off. (Python calling the same C functions through ctypes spends ~15 us per call on
arguments; hence a C loop. Notebook 11 measures the step with it on and off.)

It applies to decode-only steps (every request computes one token) of up to
``AMX_MAX_ROWS`` or ``DPBF16_MAX_ROWS`` (bfloat16: AMX, or AVX512-BF16 without it) or
``VEC_MAX_ROWS`` (float32) requests, on a CPU whose projections have those kernels (or,
for quantized weights, all of one format with a kernel in ``quantized_linear.cpp``: GGUF
Q4_1 or Q8_0, int8, up to ``MAX_FUSED_ROWS`` requests), with
the ``cpu`` attention backend, for Llama and Mistral layers (not Qwen3's per-head norms,
nor mixtures of experts).
Every other step runs the model.
"""

from __future__ import annotations

import ctypes

import torch

from microvllm.attention.metadata import AttentionMetadata
from microvllm.distributed import get_tensor_model_parallel_world_size
from microvllm.layers.linear import Linear
from microvllm.platforms.cpu import attention as attention_kernels, kernels, quantized_gemm
from microvllm.platforms.cpu.attention_backend import CPUAttentionBackend
from microvllm.platforms.cpu.gemm import (
    AMX_MAX_ROWS,
    DPBF16_MAX_ROWS,
    VEC_MAX_ROWS,
    PackedGemm,
    PackedLinear,
    tensor_version,
)
from microvllm.platforms.cpu.kernels import DTYPE_CODES

# dtype -> the PackedGemm packs whose kernel can run the projections, in order of preference,
# with the most rows each takes (the first that the weights have here is used)
GEMM_KERNELS = {torch.bfloat16: (("amx", AMX_MAX_ROWS), ("dpbf16", DPBF16_MAX_ROWS)),
                torch.float32: (("vec", VEC_MAX_ROWS),)}
# Quantized projections (layers/quantization/): weight format -> the C function that runs
# them, on the weights as stored (float32 activations; its signature is the GEMM's: for int8
# the "packed weight" is a pair of pointers, the int8 rows and their scales).
QUANTIZED_GEMMS = {"Q4_1": "q4_1_linear", "Q8_0": "q8_0_linear", "int8": "int8_linear_pair"}
# What decode_layers() times with ``seconds`` (its enum, in order).
KERNEL_KINDS = ("gemm", "attention", "write_kv", "rms_norm", "rope", "silu_and_mul")


# ctypes mirrors of decode_fast_path.cpp's structs, field for field.
class Kernels(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("rms_norm", "rope", "gemm", "write_kv", "paged_attention_decode", "silu_and_mul")]


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in
                ("dtype", "element_bytes", "hidden", "intermediate", "num_heads", "num_kv_heads",
                 "head_dim", "block_size", "num_blocks")]


class Layer(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                  "gate_up_bias", "down", "down_bias", "kv_cache")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float),
                   ("sliding_window", ctypes.c_int), ("group", ctypes.c_int)])


class Group(ctypes.Structure):
    _fields_ = [("block_table", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("max_blocks", ctypes.c_int)]


class Buffers(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("residual", "x", "h", "qkv", "qk", "attn", "gate_up", "act", "cos", "sin")]


def unsupported_reason(model) -> str | None:
    """None if ``model``'s decode steps can take the fast path here, else why not."""
    dtype = model.norm.weight.dtype   # the activations' (a quantized embedding is not)
    if get_tensor_model_parallel_world_size() > 1:
        # The C loop runs whole layers: it has no all-reduce after o_proj and down_proj,
        # so on a shard it would compute partial sums and wrong tokens.
        return "tensor parallelism (the C layer loop does not all-reduce between ranks)"
    if dtype not in GEMM_KERNELS:
        return f"{dtype} (the fast path runs float32 and bfloat16)"
    if model.norm.weight.device.type != "cpu":
        return "the model is not on a CPU"
    if getattr(model, "is_hybrid", False):
        return "linear-attention layers (a hybrid model) are not in the fast path's layer loop"
    if model.qk_norm:
        return "per-head query / key norms (Qwen3) are not in the fast path's layer"
    if getattr(model, "is_mixture_of_experts", False):
        return "mixture-of-experts layers are not in the fast path's layer (it runs one dense MLP)"
    for library in ("norm_rope", "activation", "paged_attention", "decode_layers"):
        reason = kernels.status(library)
        if reason is not None:
            return reason
    kind = gemm_kind(model)
    if kind in QUANTIZED_GEMMS.values():
        if dtype != torch.float32 or quantized_gemm.status() is not None:
            return f"{kind} runs float32 activations here ({quantized_gemm.status() or dtype})"
    elif kind is None:
        return "the projections mix quantized formats (or one the layer loop has no kernel for)"
    for layer in model.layers:
        if not isinstance(layer.self_attn.attn.backend, CPUAttentionBackend):
            return "the attention backend is not 'cpu'"
        if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
            return "the layer's two norms have different eps"
        for linear in _projections(layer):
            if kind in QUANTIZED_GEMMS.values():
                if not isinstance(linear.forward_method, quantized_gemm.QuantizedLinear):
                    return "the quantized projections do not run the CPU platform's kernels"
                continue
            gemm = packed_gemm(linear)
            if gemm is None:
                return "the projections do not run the CPU platform's packed GEMM"
            if kind not in gemm.packings(linear.weight):
                return (f"{linear.weight.dtype} {list(linear.weight.shape)} weights cannot use "
                        f"the {kind} kernel here")
    return None


def gemm_kind(model) -> str | None:
    """What runs the layers' projections: a ``PackedGemm`` kind ("amx", "dpbf16", "vec") for float
    weights, the C function of a quantized format, or None if the projections mix formats."""
    formats = {quantized_gemm.weight_format(linear) if linear.quant_method is not None else "float"
               for layer in model.layers for linear in _projections(layer)}
    if formats == {"float"}:
        choices = [kind for kind, _ in GEMM_KERNELS.get(model.norm.weight.dtype, ())]
        linear = model.layers[0].self_attn.qkv_proj
        gemm = packed_gemm(linear)
        here = gemm.packings(linear.weight) if gemm is not None else []
        return next((kind for kind in choices if kind in here), choices[0] if choices else None)
    return QUANTIZED_GEMMS.get(formats.pop()) if len(formats) == 1 else None


def packed_gemm(linear: Linear) -> PackedGemm | None:
    """The packed GEMM the platform bound to this ``Linear`` (its packs are the fast path's
    weights: one copy, shared), or None if it runs ``forward_native``."""
    version = linear.forward_method
    return version.gemm if isinstance(version, PackedLinear) else None


def _projections(layer) -> tuple[Linear, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _address(fn) -> int:
    """A ctypes function's address in its library, to hand to C as a function pointer."""
    return ctypes.cast(fn, ctypes.c_void_p).value


class DecodeFastPath:
    """Runs a Llama model's forward pass for a decode-only step (see the module doc)."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the decode fast path does not apply: {reason}")
        self.model = model
        self.dtype = model.norm.weight.dtype
        self.kind = gemm_kind(model)
        self.quantized = self.kind in QUANTIZED_GEMMS.values()
        self.max_rows = (quantized_gemm.MAX_FUSED_ROWS if self.quantized
                         else dict(GEMM_KERNELS[self.dtype])[self.kind])
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden = model.config.hidden_size
        self.intermediate = model.layers[0].mlp.down_proj.in_features
        if self.quantized:
            gemm = getattr(kernels.load("quantized_linear"), self.kind)
        else:
            name = f"{self.kind}_linear"   # a PackedGemm kind's library and C function: amx_linear, ...
            gemm = getattr(kernels.load(name), name)
        norm_rope, attention = kernels.load("norm_rope"), kernels.load("paged_attention")
        # The C functions the modules' CPU versions call, as function pointers.
        self.kernels = Kernels(
            rms_norm=_address(norm_rope.rms_norm), rope=_address(norm_rope.rope), gemm=_address(gemm),
            write_kv=_address(attention.write_kv),
            paged_attention_decode=_address(attention.paged_attention_decode),
            silu_and_mul=_address(kernels.load("activation").silu_and_mul))
        self.seconds = None   # per KERNEL_KINDS when timing (bench throughput --profile)
        # Every tensor a Layer record points into; the records are remade when one changes.
        self.tensors = [t for layer in model.layers for t in
                        (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                         *(p for linear in _projections(layer)
                           for p in (linear.weight, linear.bias, getattr(linear, "weight_scale", None))))
                        if t is not None]
        self.records, self.records_key = None, None

    def applies(self, num_tokens: int, attn_metadata: list[AttentionMetadata]) -> bool:
        """Whether this step is one the fast path runs: decode-only, small enough, no autograd."""
        return (0 < num_tokens <= self.max_rows and not torch.is_grad_enabled()
                and all(m.num_decodes == m.num_reqs == num_tokens for m in attn_metadata))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        """``LlamaForCausalLM.forward`` for a decode-only step (same arguments, same
        result): the embeddings and the final norm by the model's own modules, every
        decoder layer in one C call."""
        model = self.model
        hidden = model.embed_tokens(input_ids)
        cos_sin = model.rotary.cos_sin(positions)
        h, residual = self._layers_in_c(hidden, cos_sin, kv_caches, attn_metadata)
        hidden, _ = model.norm(h, residual)
        return hidden

    def _layers_in_c(self, hidden: torch.Tensor, cos_sin, kv_caches: list[torch.Tensor],
                     attn_metadata: list[AttentionMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, hidden]`` (the embeddings) through every decoder layer; returns
        ``(h, residual)`` as the layer loop in ``LlamaForCausalLM.forward`` leaves them."""
        T, d, Hq, Hkv = hidden.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        cache = kv_caches[0]

        def buffer(*shape):
            return torch.empty(*shape, dtype=self.dtype)
        residual, x, h = hidden.clone(), buffer(T, self.hidden), buffer(T, self.hidden)
        qkv, qk, attn = buffer(T, (Hq + 2 * Hkv) * d), buffer(T, Hq + Hkv, d), buffer(T, Hq * d)
        gate_up, act = buffer(T, 2 * self.intermediate), buffer(T, self.intermediate)
        cos, sin = (t.reshape(T, d // 2).to(self.dtype).contiguous() for t in cos_sin)
        # (record, tensors it points into) per cache group: kept here, alive through the call
        groups = [self._group(m, qk, attn, cache) for m in attn_metadata]
        buffers = Buffers(*(t.data_ptr() for t in (residual, x, h, qkv, qk, attn, gate_up, act, cos, sin)))
        shape = Shape(DTYPE_CODES[self.dtype], hidden.element_size(), self.hidden, self.intermediate,
                      Hq, Hkv, d, cache.shape[2], cache.shape[1])
        key = [(t.data_ptr(), tensor_version(t)) for t in self.tensors] + [c.data_ptr() for c in kv_caches]
        if key != self.records_key:
            self.records, self.records_key = self._layers(kv_caches), key
        layers = self.records
        seconds = (ctypes.c_double * len(KERNEL_KINDS))() if self.seconds is not None else None
        with kernels.profiled("microvllm::decode_fast_path"):
            bad = kernels.load("decode_layers").decode_layers(
                ctypes.byref(self.kernels), ctypes.byref(shape), layers, len(layers),
                (Group * len(groups))(*(g for g, _ in groups)), ctypes.byref(buffers), T, seconds)
        if bad >= 0:   # write_kv refused token `bad`'s slot (in some cache group)
            num_slots = cache.shape[1] * cache.shape[2]
            slots = next(s for _, (_, _, s) in groups if not 0 <= int(s[bad]) < num_slots)
            raise attention_kernels.bad_slot_error(slots, bad, num_slots)
        if seconds is not None:
            for kind, value in zip(KERNEL_KINDS, seconds):
                self.seconds[kind] = self.seconds.get(kind, 0.0) + value
        return h, residual

    def _layers(self, kv_caches) -> ctypes.Array:
        """Every layer's record (remade only when a weight or cache changed:
        a weight changed in place gets its pack remade, as the modules' ``PackedGemm`` would)."""
        first = kv_caches[0]
        if any(c.shape != first.shape or c.dtype != self.dtype or not c.is_contiguous() for c in kv_caches):
            raise ValueError(f"every layer's KV cache must be a contiguous {self.dtype} "
                             f"{list(first.shape)} tensor")

        def ptr(tensor):
            return tensor.data_ptr() if tensor is not None else None

        records, self.pairs = [], []   # pairs: int8's (weight, scales) pointer pairs, kept alive here
        for i, layer in enumerate(self.model.layers):
            weights = []   # (packed weight, bias) of qkv, o, gate_up, down
            for linear in _projections(layer):
                if self.kind == QUANTIZED_GEMMS["int8"]:
                    self.pairs.append((ctypes.c_void_p * 2)(linear.weight.data_ptr(), linear.weight_scale.data_ptr()))
                    weights += [ctypes.addressof(self.pairs[-1]), ptr(linear.bias)]
                    continue
                weight = linear.weight if self.quantized else packed_gemm(linear).pack(linear.weight, self.kind)
                weights += [ptr(weight), ptr(linear.bias)]
            attn = layer.self_attn.attn
            records.append(Layer(
                ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight), *weights,
                ptr(kv_caches[i]), layer.input_layernorm.eps, attn.scale, attn.sliding_window or 0,
                self.model.layout.layer_to_group[i]))
        return (Layer * len(records))(*records)

    @staticmethod
    def _group(metadata: AttentionMetadata, qk, attn, kv_cache):
        """One cache group's metadata, checked once for all its layers as the modules'
        wrappers check it at every call; returns the record and the tensors it points into."""
        T, num_heads = qk.shape[0], attn.shape[1] // qk.shape[2]
        block_table, seq_lens = metadata.block_table.contiguous(), metadata.seq_lens.contiguous()
        attention_kernels.check_inputs(qk[:, :num_heads], kv_cache, block_table, seq_lens,
                                       attn.view(T, num_heads, qk.shape[2]))
        slots = metadata.slot_mapping.to(torch.int64).contiguous()   # write_kv checks each slot
        record = Group(block_table.data_ptr(), seq_lens.data_ptr(), slots.data_ptr(), block_table.shape[1])
        return record, (block_table, seq_lens, slots)
