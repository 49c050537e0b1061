"""Tiny random models for tests and notebooks: real architectures, ~200k parameters.

``make_tiny_model(folder, "mistral")`` writes a complete Hugging Face folder —
config.json, model.safetensors (seeded random weights, built by transformers' own
model class), generation_config.json and a small byte-level BPE tokenizer — so the
whole engine, text prompts included, runs on it offline in milliseconds per step.
The weights are drawn with a large ``initializer_range`` so that logits are peaked:
greedy parity tests then compare clear winners, not near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen3_5")


def tiny_config(arch: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    if arch == "llama":
        config = LlamaConfig(**{**common, **overrides})
    elif arch == "mistral":
        config = MistralConfig(**{**common, "sliding_window": 8, "head_dim": 16, **overrides})
    elif arch == "qwen3":
        config = Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": True, **overrides})
    elif arch == "qwen3_moe":   # 8 experts, top-2; layer 0 dense (mlp_only_layers), layer 1 sparse
        config = Qwen3MoeConfig(**{**common, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                                   "mlp_only_layers": [0], "norm_topk_prob": True, **overrides})
    elif arch == "mixtral":     # 4 experts, top-2, every layer sparse; Mistral's sliding window
        config = MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "sliding_window": 8, "head_dim": 16,
                                  **overrides})
    elif arch == "qwen3_5":     # a hybrid: 3 Gated DeltaNet layers, then 1 gated full attention (x2)
        from transformers import Qwen3_5TextConfig
        config = Qwen3_5TextConfig(**{**common, "num_hidden_layers": 8, "head_dim": 16,
                                      "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                      "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                      "linear_conv_kernel_dim": 4, **overrides})
        config.architectures = ["Qwen3_5ForCausalLM"]
    else:
        raise ValueError(f"arch={arch!r}: choose one of {ARCHITECTURES}")
    return config


def make_tiny_model(folder: str | Path, arch: str = "llama", seed: int = 0, *,
                    tokenizer: bool = True, added_tokens: tuple[str, ...] = (), **overrides) -> Path:
    """Write a tiny random ``arch`` model (+ tokenizer, with ``added_tokens`` as one token
    each: ``build_tiny_tokenizer``) into ``folder`` and return it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    from transformers.utils import logging as hf_logging

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr would clutter notebooks
    try:
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(folder)
    if tokenizer:
        from microvllm.models.tiny_tokenizer import build_tiny_tokenizer
        build_tiny_tokenizer(folder, vocab_size=config.vocab_size, added_tokens=added_tokens)
    return folder
