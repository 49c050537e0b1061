"""Load a Hugging Face model folder into our model: config.json + *.safetensors.

Safetensors only (never pickle) and never remote code. Hugging Face keeps q/k/v and
gate/up as separate tensors; we keep them fused, so each checkpoint tensor is copied
into its slice of the fused parameter::

    qkv_proj.weight  [q_size + 2*kv_size, hidden]      gate_up_proj.weight [2*inter, hidden]
      rows 0 .. q_size           <- q_proj.weight        rows 0 .. inter    <- gate_proj.weight
      rows q_size .. +kv_size    <- k_proj.weight        rows inter .. 2*inter <- up_proj.weight
      rows .. end                <- v_proj.weight

Every parameter must be filled exactly once; anything missing, extra or of the
wrong shape is an error naming the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from microvllm.config import resolve_dtype
from microvllm.models.registry import resolve_model_class


def load_config(model_path: str | Path):
    """Read config.json with transformers (local files only, no remote code)."""
    from transformers import AutoConfig

    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist: pass model=None for "
                                "the embedded default model, or the path of a Hugging Face folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} is missing: a model folder needs "
                                "config.json and *.safetensors")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'} could not be read: {e}") from e


def load_model(model_path: str | Path, backend, dtype="float32", max_position: int | None = None,
               device: str | torch.device = "cpu"):
    """Build the model class named by config.json and fill it from the folder's safetensors.
    The platform then prepares it (``Platform.process_weights_after_loading``)."""
    config = load_config(model_path)
    model_cls = resolve_model_class(config, where=str(Path(model_path) / "config.json"))
    torch_dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = model_cls(config, backend, max_position=max_position)
    # Built on the meta device (no time spent on random init), then materialised.
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the tied output projection its own tensor
    model.rotary.build_table(device)  # buffers are not in the checkpoint
    load_weights(model, Path(model_path))
    model = model.to(torch_dtype).eval()
    return model, config


def _checkpoint_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {pickles}: pickle checkpoints are never loaded; convert them to safetensors)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors file in {folder}{hint}")
    return files


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # our parameter name -> rows filled (fused ones fill in parts)
    tied = getattr(model, "tie_word_embeddings", False)
    for file in _checkpoint_files(folder):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # truncated or corrupt header
            raise ValueError(f"{file} is not a readable safetensors file ({e}); "
                             "re-download or re-convert it") from e
        with handle as f:
            for hf_name in f.keys():
                if tied and hf_name == "lm_head.weight":
                    continue  # tied to embed_tokens: some checkpoints store a copy anyway
                if "rotary_emb.inv_freq" in hf_name:
                    continue  # a derived buffer some old checkpoints include
                try:
                    tensor = f.get_tensor(hf_name)
                except Exception as e:
                    raise ValueError(f"{file}: tensor {hf_name!r} could not be read ({e}); "
                                     "the file is truncated or corrupt") from e
                _copy_tensor(model, params, filled, hf_name, tensor, file)
    missing = [name for name, p in params.items() if filled.get(name, 0) != p.shape[0]]
    if missing:
        raise ValueError(f"{folder}: the checkpoint is missing tensors for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} (config.json and the "
                         "safetensors files do not describe the same model)")


def _our_name(model, hf_name: str) -> tuple[str, int | None]:
    """``model.layers.3.self_attn.k_proj.weight`` -> (``layers.3.self_attn.qkv_proj.weight``, 1)."""
    name = hf_name.removeprefix("model.")
    for fused, part, shard in model.stacked_params:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _copy_tensor(model, params, filled, hf_name, tensor, file) -> None:
    name, shard = _our_name(model, hf_name)
    if name not in params:
        raise ValueError(f"{file}: unexpected tensor {hf_name!r} {tuple(tensor.shape)}: "
                         f"this {type(model).__name__} has no such weight (wrong architecture "
                         "in config.json, or an unsupported variant)")
    param = params[name]
    if shard is None:
        offset, size = 0, param.shape[0]
    else:
        sizes = _shard_sizes(model, name, param)
        offset, size = sum(sizes[:shard]), sizes[shard]
    expected = (size, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{file}: tensor {hf_name!r} has shape {tuple(tensor.shape)} but "
                         f"config.json implies {expected}")
    with torch.no_grad():
        param[offset:offset + size].copy_(tensor)
    filled[name] = filled.get(name, 0) + size


def _shard_sizes(model, name, param) -> list[int]:
    if ".qkv_proj." in name:
        attn = model.get_submodule(name.rsplit(".qkv_proj.", 1)[0])
        return [attn.q_size, attn.kv_size, attn.kv_size]
    half = param.shape[0] // 2  # gate_up_proj
    return [half, half]
