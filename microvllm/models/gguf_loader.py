"""``LLM(model="<file>.gguf")``: a GGUF file run in its own formats (vLLM's convention).

A GGUF file (llama.cpp's) holds the config, the tokenizer and the weights. The first
time a file is used, its config and tokenizer are written, with transformers, to a small
folder in the cache, beside a link to the file; the weights are never converted::

    $MICROVLLM_CACHE/gguf/<name>-<key of path, size, mtime>/
        config.json  generation_config.json  tokenizer.json ...   (read once from the file)
        model.gguf -> the file itself                             (the weights, read each load)

So everything that reads a model folder (the tokenizer, the generation defaults) works
as for a Hugging Face folder, and the loader finds ``model.gguf`` there instead of
``*.safetensors``. Each weight keeps its GGUF type (``layers/quantization/gguf.py``): the
matrices go to ``GGUFConfig``'s methods as their raw bytes; norms are read as float32.

GGUF names -> Hugging Face names (then ``loader.py`` fuses q/k/v and gate/up as usual)::

    token_embd.weight          model.embed_tokens.weight
    output_norm.weight         model.norm.weight          output.weight   lm_head.weight
    blk.N.attn_norm.weight     model.layers.N.input_layernorm.weight
    blk.N.ffn_norm.weight      model.layers.N.post_attention_layernorm.weight
    blk.N.attn_{q,k,v}.weight  model.layers.N.self_attn.{q,k,v}_proj.weight
    blk.N.attn_output.weight   model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_{gate,up,down}   model.layers.N.mlp.{gate,up,down}_proj.weight
    blk.N.attn_{q,k}_norm      model.layers.N.self_attn.{q,k}_norm.weight   (Qwen3)

llama.cpp's converter permutes the rows of a Llama's q and k projections (its RoPE
rotates adjacent pairs, Hugging Face's rotates halves); the loader undoes it, as
transformers does. The permutation moves whole rows, so it applies to packed blocks too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

from microvllm.envs import cache_dir
from microvllm.layers.quantization.gguf import FLOAT_TYPES, GGUF_TYPES, GGUFConfig, dequantize
from microvllm.models.gguf_file import GGUFIndex

logger = logging.getLogger(__name__)

GGUF_WEIGHTS = "model.gguf"     # the link, inside the prepared folder
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_ARCHITECTURES = ("llama",)   # q, k rows permuted by llama.cpp's converter
_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_(q|k)_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
]
SUPPORTED = sorted(GGUF_TYPES) + list(FLOAT_TYPES)


def is_gguf_file(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def gguf_weights_file(folder: Path) -> Path | None:
    """The GGUF file a prepared folder stands for, or None for a Hugging Face folder."""
    link = Path(folder) / GGUF_WEIGHTS
    return link if link.exists() else None


def hf_name(gguf_name: str) -> str:
    for pattern, replacement in _NAMES:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, replacement, gguf_name)
    raise ValueError(f"tensor {gguf_name!r} has no counterpart in microvllm's models")


def prepare_gguf_folder(gguf_file: Path) -> Path:
    """The cache folder standing for ``gguf_file`` (made on first use; see the module doc)."""
    gguf_file = Path(gguf_file).expanduser().resolve()
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "gguf" / f"{gguf_file.stem}-{key}"
    if (target / "config.json").is_file() and (target / GGUF_WEIGHTS).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        _write_config_and_tokenizer(gguf_file, tmp)
        (tmp / GGUF_WEIGHTS).symlink_to(gguf_file)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_config_and_tokenizer(gguf_file: Path, folder: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    reader = GGUFReader(str(gguf_file))
    field = reader.fields.get("general.architecture")
    arch = None if field is None else field.contents()
    if arch not in ARCHITECTURES:
        raise ValueError(f"{gguf_file}: general.architecture={arch!r} is not supported; microvllm runs "
                         f"GGUF files of {sorted(ARCHITECTURES)} models")
    names = {t.name for t in reader.tensors}
    try:
        config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as e:
        raise ValueError(f"{gguf_file}: transformers could not read its config ({e})") from e
    config.architectures = [ARCHITECTURES[arch]]
    config.tie_word_embeddings = "output.weight" not in names
    config.save_pretrained(folder)
    generation = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if getattr(config, k, None) is not None}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if "tokenizer.ggml.tokens" in reader.fields:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        tokenizer.save_pretrained(folder)
    else:
        logger.warning("%s has no tokenizer: prompts must be given as token ids", gguf_file.name)


def tensor_types(gguf_file: Path, our_name: Callable[[str], str], hf_config) -> dict[str, str]:
    """``{layer name in the model: GGUF type}`` for every matrix of the file (the
    ``GGUFConfig``): the parts of a fused layer (q/k/v, gate/up) must share a type, or the
    layer is loaded as float32. ``our_name``: a Hugging Face parameter name -> the model's
    (``loader.py`` fuses q/k/v). Raises ValueError for a type microvllm cannot compute on."""
    types: dict[str, set[str]] = {}
    index = GGUFIndex(gguf_file)
    for tensor in index.tensors:
        kind = tensor.type_name
        if len(tensor.shape) < 2:
            continue    # norms and biases: read as float32 whatever they are stored in
        if kind not in SUPPORTED:
            raise ValueError(
                f"{gguf_file}: tensor {tensor.name!r} is stored as {kind}; microvllm computes on "
                f"{', '.join(SUPPORTED)} GGUF tensors. Re-quantize the file with llama.cpp (e.g. "
                f"`llama-quantize --allow-requantize {gguf_file.name} out.gguf Q4_1`, or Q8_0), or "
                "pass the Hugging Face folder of the model instead")
        name = our_name(hf_name(tensor.name))
        types.setdefault(name.removesuffix(".weight"), set()).add(kind)
    index.close()
    result = {}
    for layer, kinds in types.items():
        if len(kinds) > 1:
            logger.warning("%s: the parts of %s are stored as %s: loaded as float32", gguf_file.name,
                           layer, sorted(kinds))
        result[layer] = kinds.pop() if len(kinds) == 1 else "F32"
    if getattr(hf_config, "tie_word_embeddings", False) and "embed_tokens" in result:
        result["lm_head"] = result["embed_tokens"]
    return result


def gguf_quant_config(gguf_file: Path, our_name: Callable[[str], str], hf_config,
                      dtype: torch.dtype) -> GGUFConfig:
    return GGUFConfig(tensor_types(gguf_file, our_name, hf_config), dtype)


def gguf_tensors(model, gguf_file: Path, quant_config: GGUFConfig,
                 our_name: Callable[[str], str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` for every weight of ``gguf_file``, as ``model`` (its
    layers given their GGUF methods) takes them: raw rows for a layer that keeps the file's
    type, float32 otherwise; q and k rows back in Hugging Face's order."""
    config = model.config
    index = GGUFIndex(gguf_file)
    permute = index.fields.get("general.architecture") in PERMUTED_ARCHITECTURES
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for tensor in index.tensors:
                name = hf_name(tensor.name)
                if name == "lm_head.weight" and model.tie_word_embeddings:
                    continue
                yield name, _as_loaded(tensor, name, quant_config, our_name, config, permute)
    finally:
        tensor = None   # noqa: F841  (drop the last view of the file before unmapping it)
        index.close()


def _as_loaded(tensor, name: str, quant_config: GGUFConfig, our_name, config, permute: bool) -> torch.Tensor:
    kind = tensor.type_name
    keep = quant_config.tensor_types.get(our_name(name).removesuffix(".weight")) == kind and kind in GGUF_TYPES
    data = torch.from_numpy(tensor.data)
    if kind == "F16":
        data = data.view(torch.uint8).reshape(data.shape[0], -1) if keep else data.float()
    elif kind in GGUF_TYPES and not keep:   # a fused layer of mixed types: float32
        data = dequantize(data.reshape(-1, data.shape[-1]), kind, int(tensor.shape[0]))
    if permute and ".self_attn.q_proj." in name:
        data = _reverse_permute(data, config.num_attention_heads)
    elif permute and ".self_attn.k_proj." in name:
        data = _reverse_permute(data, config.num_key_value_heads)
    return data


def _reverse_permute(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows ``0, d/2, 1, d/2+1, ...`` back
    to ``0, 1, ..., d-1`` (transformers' ``_reverse_permute_weights``)."""
    dim = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, dim, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
