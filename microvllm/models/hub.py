"""``model=``: a folder, a hub id from the local Hugging Face cache, or None.

    None                                  -> the embedded SmolLM2-135M-Instruct (default_model.py)
    "path/to/folder"                      -> that folder (config.json + *.safetensors)
    "path/to/file.gguf"                   -> a cache folder standing for the file: its config
                                             and tokenizer, and a link to it (gguf_loader.py)
    "HuggingFaceTB/SmolLM2-135M-Instruct" -> $HF_HOME/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/
                                             snapshots/<commit>/   (local files only)

A hub id is looked up in the cache ``huggingface_hub`` uses (``HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) and never downloaded: microvllm
runs offline. When the model is not there, the error says how to put it there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# "org/name" (letters, digits, - _ .), as the hub spells repository ids.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(model) -> Path:
    """The local folder that ``model`` names (see the module docstring)."""
    if model is None:
        from microvllm.models.default_model import default_model_path
        return default_model_path()
    path = Path(str(model)).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf" and path.is_file():
        from microvllm.models.gguf_loader import prepare_gguf_folder
        return prepare_gguf_folder(path)
    if HUB_ID.match(str(model)) and not path.exists():
        return hub_cache_path(str(model))
    raise FileNotFoundError(f"model={str(model)!r} is not a folder: pass model=None for the embedded "
                            "default model, the path of a Hugging Face model folder (config.json + "
                            "*.safetensors) or of a .gguf file, or a hub id such as 'org/name' that is in the local "
                            "Hugging Face cache")


def hub_cache_path(repo_id: str) -> Path:
    """The cached snapshot folder of ``repo_id``; FileNotFoundError (with the fix) if absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model={repo_id!r} is not in the local Hugging Face cache ({cache}), and microvllm never "
            f"downloads. On a machine with internet run\n    hf download {repo_id}\n"
            "then copy its hub cache folder here (or point HF_HOME at it), or pass the model "
            "folder's path; model=None runs the embedded SmolLM2-135M-Instruct") from None


def hub_cache_dir() -> Path:
    """``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (read now,
    not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "huggingface"
    return Path(home).expanduser() / "hub"
