"""``LLM.start_profile()`` / ``stop_profile()``: a torch.profiler trace of what runs between.

Where the trace goes, first match wins::

    profiler_config={"torch_profiler_dir": "..."}   (vLLM's LLM argument)
    $VLLM_TORCH_PROFILER_DIR                         (vLLM's older environment variable)
    ./microvllm_profile                              (default)

Each ``stop_profile()`` writes one Chrome trace, ``<dir>/microvllm_trace_<time>.json``:
open it in https://ui.perfetto.dev or chrome://tracing. Everything runs in this one
process, so the file is complete when ``stop_profile()`` returns.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PROFILE_DIR = "microvllm_profile"


def profile_dir(profiler_config: dict | None) -> Path:
    """The folder traces are written to (see the module docstring)."""
    config = profiler_config or {}
    profiler = config.get("profiler", "torch")
    if profiler != "torch":
        raise ValueError(f"profiler_config['profiler']={profiler!r}: only 'torch' (torch.profiler) is available")
    folder = config.get("torch_profiler_dir") or os.environ.get("VLLM_TORCH_PROFILER_DIR") or DEFAULT_PROFILE_DIR
    return Path(folder).expanduser()


class TorchProfiler:
    """One profiling session at a time over the CPU activity of this process."""

    def __init__(self, profiler_config: dict | None):
        self.folder = profile_dir(profiler_config)
        self.profile = None

    def start(self) -> None:
        import torch.profiler

        if self.profile is not None:
            raise RuntimeError("start_profile() was called twice: call stop_profile() first")
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                              record_shapes=True)
        self.profile.__enter__()

    def stop(self) -> Path:
        """Stop and write the trace; returns its path."""
        if self.profile is None:
            raise RuntimeError("stop_profile() without start_profile(): start a profile first")
        profile, self.profile = self.profile, None
        profile.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"microvllm_trace_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.json"
        profile.export_chrome_trace(str(path))
        logger.info("profile trace written to %s", path)
        return path
