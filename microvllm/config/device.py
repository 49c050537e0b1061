"""``DeviceConfig``: where the model runs and with which code (vLLM: ``vllm/config/device.py``;
vLLM keeps ``enforce_eager`` in its ``ModelConfig`` and the backend in ``AttentionConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceConfig:
    """device             "cpu" or "cuda" ("auto" is settled by then)
    attention_backend  a registered backend name ("auto" is settled by then)
    enforce_eager      run the plain model code the notebooks show: every layer's
                       ``forward_native``, no compiled kernel, no decode-step runner. The
                       platform is the one reader (``platforms/interface.py``)."""

    device: str = "cpu"
    attention_backend: str = "torch"
    enforce_eager: bool = False
