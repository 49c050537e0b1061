"""``PEFTHelper``: what a peft adapter folder says about itself (vLLM: ``vllm/lora/peft_helper.py``).

A peft folder, as ``PeftModel.save_pretrained`` writes it::

    my-adapter/
    ├── adapter_config.json          {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
    │                                 "use_rslora": false, "bias": "none", ...}
    └── adapter_model.safetensors    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight [r, in]
                                     base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight [out, r]

The adapter adds ``scaling * B @ A @ x`` to a target layer's output, with
``scaling = lora_alpha / r`` (or ``lora_alpha / sqrt(r)`` with rsLoRA: ``use_rslora``).

Only plain LoRA on the linear layers is served here; whatever else peft can write (a
trained bias, DoRA, fully trained extra modules, per-layer ranks) is refused with what
to change, before anything runs.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

# The projections a LoRA may target, by their Hugging Face names (what peft writes).
SUPPORTED_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class PEFTHelper:
    r: int
    lora_alpha: float
    target_modules: list[str]
    use_rslora: bool = False
    bias: str = "none"
    modules_to_save: list[str] | None = None
    use_dora: bool = False
    fan_in_fan_out: bool = False
    layers_to_transform: list[int] | int | None = None
    rank_pattern: dict | None = None
    alpha_pattern: dict | None = None

    @property
    def scaling(self) -> float:
        """What ``B @ A @ x`` is multiplied by: ``alpha / r``, or ``alpha / sqrt(r)`` (rsLoRA)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_dict(cls, config: dict) -> "PEFTHelper":
        """``ValueError`` saying what is wrong for anything that is not a LoRA config: this is
        a file a client may choose (``/v1/load_lora_adapter``), so no other error escapes."""
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG_NAME} holds a JSON {type(config).__name__}, not an object: it should be "
                             f"the adapter's LoraConfig, as PeftModel.save_pretrained writes it")
        rank, alpha = config.get("r"), config.get("lora_alpha", 8)
        if not isinstance(rank, int) or isinstance(rank, bool):
            found = f"r={rank!r}" if "r" in config else 'no "r"'
            raise ValueError(f"{CONFIG_NAME} has {found}: it needs \"r\", the adapter's rank, an integer "
                             f"(the adapter's LoraConfig, as PeftModel.save_pretrained writes it)")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"{CONFIG_NAME} has lora_alpha={alpha!r}: it must be a number")
        try:
            return cls._from_dict(config)
        except (TypeError, AttributeError) as error:   # a field of the wrong JSON type
            raise ValueError(f"{CONFIG_NAME} is not a LoRA config this engine can read ({error}): it should be "
                             f"the adapter's LoraConfig, as PeftModel.save_pretrained writes it") from None

    @classmethod
    def _from_dict(cls, config: dict) -> "PEFTHelper":
        peft_type = config.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ValueError(f"peft_type={peft_type!r}: only LoRA adapters (peft_type 'LORA') are supported")
        target = config.get("target_modules")
        if isinstance(target, str):
            # peft also accepts a regex over the full module names: we could not tell which
            # layers it meant without the model, so ask for the list instead.
            target = [target] if target in SUPPORTED_LORA_MODULES else None
        if not target:
            raise ValueError(f"target_modules={config.get('target_modules')!r} in {CONFIG_NAME}: give the "
                             f"list of module names the adapter targets (some of {list(SUPPORTED_LORA_MODULES)})")
        return cls(r=int(config["r"]), lora_alpha=float(config.get("lora_alpha", 8)), target_modules=list(target),
                   use_rslora=bool(config.get("use_rslora", False)), bias=config.get("bias", "none") or "none",
                   modules_to_save=config.get("modules_to_save"), use_dora=bool(config.get("use_dora", False)),
                   fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
                   layers_to_transform=config.get("layers_to_transform"),
                   rank_pattern=config.get("rank_pattern") or None, alpha_pattern=config.get("alpha_pattern") or None)

    @classmethod
    def from_local_dir(cls, lora_path: str | Path) -> "PEFTHelper":
        """Read ``lora_path/adapter_config.json``; a folder without one is refused."""
        path = Path(lora_path)
        if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
            raise ValueError(f"lora_path={str(lora_path)!r} is not a peft adapter folder: it needs "
                             f"{CONFIG_NAME} and {WEIGHTS_NAME} (what PeftModel.save_pretrained writes)")
        try:
            config = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
        except ValueError as error:   # not JSON, or not UTF-8
            raise ValueError(f"{CONFIG_NAME} in {str(lora_path)!r} is not JSON ({error}): write it again with "
                             f"PeftModel.save_pretrained") from None
        return cls.from_dict(config)

    def validate_legal(self, max_lora_rank: int) -> None:
        """Refuse, saying what to change, what this engine does not serve."""
        problems = []
        if self.r < 1 or self.r > max_lora_rank:
            problems.append(f"r={self.r} is above max_lora_rank={max_lora_rank}: start the engine with "
                            f"max_lora_rank >= {self.r}" if self.r > 0 else f"r={self.r} must be >= 1")
        if self.bias != "none":
            problems.append(f"bias={self.bias!r}: LoRA biases are not supported; train with bias='none'")
        if self.modules_to_save:
            problems.append(f"modules_to_save={self.modules_to_save}: fully trained extra modules are not "
                            f"supported; train without modules_to_save")
        if self.use_dora:
            problems.append("use_dora=True: DoRA is not supported; train a plain LoRA (use_dora=False)")
        if self.fan_in_fan_out:
            problems.append("fan_in_fan_out=True (Conv1D-style weights) is not supported")
        if self.layers_to_transform is not None:
            problems.append(f"layers_to_transform={self.layers_to_transform}: an adapter on some layers only is "
                            f"not supported; target every layer")
        if self.rank_pattern or self.alpha_pattern:
            problems.append("rank_pattern / alpha_pattern: per-module ranks or alphas are not supported; "
                            "use one r and one lora_alpha")
        unknown = [m for m in self.target_modules if m not in SUPPORTED_LORA_MODULES]
        if unknown:
            problems.append(f"target_modules {unknown} are not layers LoRA can wrap here; target some of "
                            f"{list(SUPPORTED_LORA_MODULES)}")
        if problems:
            raise ValueError("this LoRA adapter cannot be served:\n  " + "\n  ".join(problems))


def adapter_digest(lora_path: str | Path) -> str:
    """What the adapter *is*: the sha256 (64 hex digits) of its two files, each with its
    name, read in 1 MiB pieces (O(the files' size), once per adapter)::

        sha256( "adapter_config.json"       || sha256(its bytes)
             || "adapter_model.safetensors" || sha256(its bytes) )

    The prefix cache keys an adapter's blocks by it (``core/kv_cache_utils.py``), so two
    folders, or one folder's files before and after they were replaced, never share KV,
    while the same files under any name or id do."""
    digest = hashlib.sha256()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        file_digest = hashlib.sha256()
        with open(Path(lora_path) / name, "rb") as file:
            while chunk := file.read(1 << 20):
                file_digest.update(chunk)
        digest.update(name.encode() + file_digest.digest())
    return digest.hexdigest()
