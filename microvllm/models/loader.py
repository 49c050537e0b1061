"""Load a Hugging Face model folder into our model: config.json + *.safetensors.

Safetensors only (never pickle) and never remote code. Hugging Face keeps q/k/v and
gate/up as separate tensors; we keep them fused, so each checkpoint tensor is copied
into its slice of the fused parameter::

    qkv_proj.weight  [q_size + 2*kv_size, hidden]      gate_up_proj.weight [2*inter, hidden]
      rows 0 .. q_size           <- q_proj.weight        rows 0 .. inter    <- gate_proj.weight
      rows q_size .. +kv_size    <- k_proj.weight        rows inter .. 2*inter <- up_proj.weight
      rows .. end                <- v_proj.weight

With tensor parallelism each rank reads the whole checkpoint tensor and keeps its part:
the loader hands it to the parameter's ``weight_loader`` (set by the sharded layer, as in
vLLM: ``layers/linear.py``, ``layers/vocab_parallel_embedding.py``), with the shard id
(``"q"``, ``"k"``, ``"v"``; 0, 1 for gate, up) for a fused parameter.

Every parameter must be filled exactly once; anything missing, extra or of the
wrong shape is an error naming the file and the tensor.

Quantized weights (``layers/quantization/``): a folder standing for a GGUF file
(``gguf_loader.py``) loads with ``GGUFConfig``, each matrix in the file's own format;
``quantization="int8"`` reads the float checkpoint, then quantizes each layer. Either way the
layers get their methods before anything is allocated, and the same weight loaders copy rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from microvllm.config import resolve_dtype
from microvllm.distributed import get_tensor_model_parallel_world_size
from microvllm.layers.fused_moe.layer import expert_param_name, moe_layers
from microvllm.layers.linear import check_shape
from microvllm.layers.quantization import check_quantization, quantize_layers
from microvllm.layers.quantization.int8 import Int8Config
from microvllm.models.gguf_loader import gguf_quant_config, gguf_tensors, gguf_weights_file
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
               device: str | torch.device = "cpu", hf_config=None, quantization: str | None = None):
    """Build the model class named by config.json and fill it from the folder's safetensors
    (or, for a folder standing for a GGUF file, from that file: ``gguf_loader.py``).
    The platform then prepares it (``Platform.process_weights_after_loading``). ``hf_config``:
    config.json already read (a tensor-parallel worker gets the engine's, and need not
    import transformers' config machinery again). ``quantization``: "int8" quantizes the
    float checkpoint as it loads (``layers/quantization/``); a GGUF file is always "gguf"."""
    config = hf_config if hf_config is not None else load_config(model_path)
    model_cls = resolve_model_class(config, where=str(Path(model_path) / "config.json"))
    torch_dtype = resolve_dtype(dtype)
    quant_config = _quant_config(Path(model_path), quantization, model_cls, config, torch_dtype)
    with torch.device("meta"):
        model = model_cls(config, backend, max_position=max_position)
    if quant_config is not None:   # each Linear / embedding gets its format's method
        quantize_layers(model, quant_config)
    # Built on the meta device (no time spent on random init), then materialised.
    # to_empty makes new Parameters, without the weight_loader attributes the layers set.
    weight_loaders = {name: p.weight_loader for name, p in model.named_parameters()
                      if hasattr(p, "weight_loader")}
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the tied output projection its own tensor
    for name, param in model.named_parameters():
        if name in weight_loaders:
            param.weight_loader = weight_loaders[name]
    model.rotary.build_table(device)  # buffers are not in the checkpoint
    for experts in moe_layers(model).values():   # built on "meta": their device is known only now
        experts.choose_impl()
    gguf_file = gguf_weights_file(Path(model_path))
    if gguf_file is not None:
        fill_weights(model, gguf_tensors(model, gguf_file, quant_config, lambda n: _our_name(model, n)[0]),
                     gguf_file)
    else:
        load_weights(model, Path(model_path))
    model = model.to(torch_dtype).eval()   # quantized weights (integer tensors) stay as they are
    if quant_config is not None:
        quant_config.process_weights_after_loading(model)
    return model, config


def _quant_config(path: Path, quantization: str | None, model_cls, hf_config, dtype: torch.dtype):
    """The ``QuantizationConfig`` the model loads with, or None for plain float weights."""
    gguf_file = gguf_weights_file(path)
    quantization = check_quantization(quantization, is_gguf=gguf_file is not None)
    if quantization is not None and getattr(model_cls, "is_mixture_of_experts", False):
        raise ValueError(f"quantization={quantization!r}: {model_cls.__name__}'s experts have no "
                         "quantized path here; load the float checkpoint (quantization=None)")
    if quantization is not None and get_tensor_model_parallel_world_size() > 1:
        raise ValueError(f"quantization={quantization!r} runs in one process: use tensor_parallel_size=1")
    if quantization == "gguf":
        return gguf_quant_config(gguf_file, lambda n: _our_name(model_cls, n)[0], hf_config, dtype)
    if quantization == "int8":
        return Int8Config(dtype)
    return None


def _checkpoint_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" (found {pickles}: pickle checkpoints are never loaded; convert them to safetensors)"
                if pickles else "")
        raise FileNotFoundError(f"no *.safetensors file in {folder}{hint}")
    return files


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    params = dict(model.named_parameters())
    # our parameter name -> the shard ids filled (None for an unfused parameter)
    filled: dict[str, set] = {}
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
    check_filled(model, params, filled, folder)


def fill_weights(model: torch.nn.Module, tensors, where) -> None:
    """Fill every parameter from ``(Hugging Face name, tensor)`` pairs (a GGUF file's)."""
    params = dict(model.named_parameters())
    filled: dict[str, set] = {}
    for hf_name, tensor in tensors:
        _copy_tensor(model, params, filled, hf_name, tensor, where)
    check_filled(model, params, filled, where)


def check_filled(model, params, filled, where) -> None:
    """Raise, naming them, if some parameters were not filled (or a fused one only in part)."""
    expected = _expected_shards(model, params)
    missing = [name for name in params if filled.get(name, set()) != expected[name]]
    if missing:
        raise ValueError(f"{where}: the checkpoint is missing tensors for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} (config.json and the "
                         "checkpoint do not describe the same model)")


def _our_name(model, hf_name: str) -> tuple[str, int | str | None]:
    """``model.layers.3.self_attn.k_proj.weight`` -> (``layers.3.self_attn.qkv_proj.weight``, "k");
    one expert's matrix ``model.layers.1.mlp.experts.3.gate_proj.weight`` ->
    (``layers.1.mlp.experts.w13_weight``, (3, "w1")) (``layers/fused_moe/layer.py``)."""
    name = hf_name.removeprefix("model.")
    for theirs, ours in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(theirs, ours)
    expert = expert_param_name(name)
    if expert is not None:
        return expert
    for fused, part, shard in model.stacked_params:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _expected_shards(model, params) -> dict[str, set]:
    """Which shard ids must fill each parameter: all of its parts for a fused one (every
    expert's matrices for stacked experts: the module says), else {None}."""
    parts: dict[str, set] = {}
    for fused, _, shard in model.stacked_params:
        parts.setdefault(fused, set()).add(shard)
    expected = {}
    for name in params:
        prefix, _, short = name.rpartition(".")
        module = model.get_submodule(prefix) if prefix else model
        if hasattr(module, "checkpoint_shards"):
            expected[name] = module.checkpoint_shards(short)
        else:
            expected[name] = next((ids for fused, ids in parts.items() if f".{fused}." in name), {None})
    return expected


def _copy_tensor(model, params, filled, hf_name, tensor, file) -> None:
    """Hand the whole checkpoint tensor to the parameter's ``weight_loader``, which copies
    the part this rank holds (vLLM's scheme; a parameter without one is copied whole)."""
    name, shard = _our_name(model, hf_name)
    if name not in params:
        raise ValueError(f"{file}: unexpected tensor {hf_name!r} {tuple(tensor.shape)}: "
                         f"this {type(model).__name__} has no such weight (wrong architecture "
                         "in config.json, or an unsupported variant)")
    param = params[name]
    weight_loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        with torch.no_grad():
            if shard is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard)
    except ValueError as e:
        raise ValueError(f"{file}: tensor {hf_name!r} {e}") from e
    filled.setdefault(name, set()).add(shard)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """A parameter every rank holds whole (norms): copy the checkpoint tensor as it is."""
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)
