"""Write a GGUF file from a (tiny) Hugging Face Llama folder, as llama.cpp's converter would.

Tests and notebook 16 need GGUF files without a download: ``write_gguf`` takes a folder
``make_tiny_model`` wrote and stores its weights in the GGUF types asked for, quantized
with the ``gguf`` package's own numpy code (the reference implementation of the formats)::

    write_gguf(folder, "tiny.gguf", weight_type="Q4_1", embedding_type="Q8_0")
        token_embd  Q8_0       blk.N.attn_q/k/v/output, ffn_gate/up/down   Q4_1
        output      Q8_0 (absent when the embedding is tied)
        norms       F32        + llama.* config keys, + the tokenizer (a byte-level BPE)

q and k rows are permuted as llama.cpp permutes them (``permute`` below), so that the
loader's reverse permutation is exercised as with a real file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GGUF_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
    parts = hf_name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{GGUF_NAMES[parts[-2]]}.{parts[-1]}"
    return f"{GGUF_NAMES[parts[0]]}.{parts[-1]}"


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(folder: str | Path, path: str | Path, weight_type: str = "Q4_1",
               embedding_type: str = "Q8_0", types: dict[str, str] | None = None) -> Path:
    """Write ``folder``'s Llama model to the GGUF file ``path`` (types by GGML name:
    "Q4_1", "Q8_0", "F16", "F32", ...); ``types``: other types for some tensors, by a part
    of their GGUF name (``{"attn_k": "Q8_0"}``, as llama.cpp's mixed quantizations do).
    Returns ``path``."""
    import gguf
    from safetensors.numpy import load_file

    folder, path = Path(folder), Path(path)
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get(
        "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if weight_type == "Q4_1" else gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, folder, config)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for name, tensor in tensors.items():
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        data = tensor.astype(np.float32)
        if ".q_proj." in name:
            data = permute(data, heads)
        elif ".k_proj." in name:
            data = permute(data, kv_heads)
        kind = "F32" if data.ndim == 1 else embedding_type if "embed_tokens" in name or "lm_head" in name \
            else weight_type
        kind = next((t for part, t in (types or {}).items() if part in gguf_name(name)), kind)
        qtype = gguf.GGMLQuantizationType[kind]
        stored = data if kind == "F32" else data.astype(np.float16) if kind == "F16" \
            else gguf.quants.quantize(data, qtype)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, folder: Path, config: dict) -> None:
    """The folder's byte-level BPE (tokenizer.json) as GGUF's "gpt2" tokenizer keys."""
    file = folder / "tokenizer.json"
    if not file.exists():
        return
    model = json.loads(file.read_text())
    vocab = dict(model["model"]["vocab"])
    for added in model.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [None] * config["vocab_size"]
    for token, index in vocab.items():
        if index < len(tokens):
            tokens[index] = token
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    special = {a["id"] for a in model.get("added_tokens", [])}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = model["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.get("bos_token_id") or 1)
    writer.add_eos_token_id(config.get("eos_token_id") or 2)
    writer.add_pad_token_id(config.get("pad_token_id") or 0)
    config_file = folder / "tokenizer_config.json"
    template = json.loads(config_file.read_text()).get("chat_template") if config_file.exists() else None
    if template:
        writer.add_chat_template(template)
