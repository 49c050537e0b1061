"""Engine settings, validated at the door.

Every check here runs before any model is loaded or any request admitted, and its
message names the setting, the value, and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from microvllm.attention.selector import AUTO, available_backends

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV cache when num_kv_blocks is not given
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


def resolve_dtype(dtype) -> torch.dtype:
    """``"bfloat16"`` (or ``torch.bfloat16``) -> ``torch.bfloat16``; anything else not in
    ``DTYPES`` is refused."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class EngineConfig:
    model: str | Path | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    """A backend name (``attention.selector``), or ``"auto"``: the platform's default
    (on a CPU, ``"cpu"`` where its kernel builds, else ``"torch"``)."""
    enforce_eager: bool = False
    """Run the model exactly as the notebooks write it: every layer's ``forward_native``,
    no compiled kernel, no packed weights, no decode fast path (vLLM's name: there it
    turns CUDA graphs off). Same greedy tokens, slower."""
    dtype: str = "float32"
    """A name in ``DTYPES``, or ``"auto"``: the platform's (float32 on a CPU, bfloat16 on CUDA)."""
    device: str = "auto"
    """``"cpu"``, ``"cuda"``, or ``"auto"``: CUDA where ``torch.cuda.is_available()``."""
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    """On CUDA: the fraction of the GPU's free memory this engine may use (weights,
    activations and KV cache); the KV cache gets what the rest leaves. Unused on a CPU."""
    seed: int = 0
    structured_outputs_backend: str = "auto"
    """Which backend compiles structured outputs: ``"xgrammar"`` (vLLM's default; every
    kind), ``"course"`` (the course's regex DFA: regex and choice), or ``"auto"``
    (xgrammar where it is installed)."""
    max_logprobs: int = 20
    """The most ``logprobs`` / ``prompt_logprobs`` one request may ask for (vLLM's default,
    20); -1 allows up to the vocabulary size."""
    tensor_parallel_size: int = 1
    """Split the model over this many worker processes (ranks) with torch.distributed;
    1 runs it in this process (``executor/``). The heads, the MLP and the vocabulary are
    split: see ``verify_with_model_config``."""
    trace: bool = False
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    debug_invariants: bool = False
    """Call ``check_invariants()`` after every step (slow; for tests and the fuzzer)."""
    generation_config: str = "auto"
    """Where ``LLM.get_default_sampling_params()`` reads defaults: ``"auto"`` (the model's
    generation_config.json), ``"vllm"`` (plain ``SamplingParams()``) or a folder."""
    profiler_config: dict | None = None
    """vLLM's ``{"profiler": "torch", "torch_profiler_dir": ...}`` for ``start_profile()``
    (see ``microvllm/profiler.py`` for the default folder)."""
    components: dict[str, type] | None = None
    """Replace engine components with your own classes, e.g. ``{"block_pool": MyBlockPool}``
    (the course's exercises plug in here); the names are the keys of ``COMPONENTS``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_components(self.components)
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (1, 2, 4, 8, 16, 32...)")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
            if self.num_kv_blocks < 2:
                raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: the pool needs at least 2 blocks "
                                 "(block 0 is the reserved null block)")
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
            if self.max_num_batched_tokens < self.block_size:
                raise ValueError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than one block "
                    f"(block_size={self.block_size}): raise it to at least {self.block_size}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use 'auto' or one of {sorted(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not supported; choose one of {DEVICES}")
        fraction = self.gpu_memory_utilization
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization={fraction!r} must be a fraction in (0, 1], e.g. 0.9")
        if not isinstance(self.attention_backend, str):
            raise TypeError(f"attention_backend={self.attention_backend!r} must be a backend name such as 'torch'")
        if self.attention_backend != AUTO and self.attention_backend not in available_backends():
            raise ValueError(f"attention_backend={self.attention_backend!r} is not known; "
                             f"choose {AUTO!r} or one of {available_backends()}")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager={self.enforce_eager!r} must be True or False")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed={self.seed!r} must be an int")
        _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an int >= 0, or -1 for no limit")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_model_len is not None and self.max_num_batched_tokens is not None:
            self._check_chunking()  # else finalize() checks it, once the model is known

    def _check_chunking(self) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len "
                f"(a prompt is scheduled whole), but {self.max_num_batched_tokens} < {self.max_model_len}: "
                "raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill")

    def finalize(self, max_position_embeddings: int, attention_backend: str,
                 device: str | None = None, dtype: str | None = None) -> None:
        """Fill the defaults that depend on the model and the platform (what ``"auto"``
        became for the backend, the device and the dtype), then check the combination.
        The engine calls it once, before anything is built from the config."""
        self.attention_backend = attention_backend
        self.device = device or self.device
        self.dtype = dtype or self.dtype
        if self.max_model_len is None:
            self.max_model_len = max_position_embeddings
        elif self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_position_embeddings}: lower max_model_len")
        if self.max_num_batched_tokens is None:
            # Chunked prefill lets a small budget serve any prompt; without it the
            # whole longest prompt must fit in one step.
            self.max_num_batched_tokens = 1024 if self.enable_chunked_prefill else self.max_model_len
        self._check_chunking()

    def verify_with_model_config(self, hf_config) -> None:
        """Refuse a ``tensor_parallel_size`` the model cannot be split by, from config.json,
        before any worker process starts (vLLM: ``ModelConfig.verify_with_parallel_config``):
        the query heads, the KV heads (or the ranks, when there are fewer KV heads) and the
        MLP's intermediate size must divide evenly. The vocabulary need not: it is padded."""
        from microvllm.layers.linear import divide, shard_heads

        tp = self.tensor_parallel_size
        shard_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        divide(hf_config.intermediate_size, tp, "intermediate_size")


# What ``components=`` can replace, and where the engine builds each one.
COMPONENTS = {
    "detokenizer": "IncrementalDetokenizer, one per request (engine/output_processor.py)",
    "block_pool": "BlockPool, the KV block allocator (core/kv_cache_manager.py)",
    "kv_cache_manager": "KVCacheManager, the scheduler's door to the cache (engine/engine.py)",
    "scheduler": "Scheduler (engine/engine.py)",
    "model_runner": "ModelRunner (worker/worker.py)",
    "block_table": "BlockTable, the runner's persistent block tables (worker/model_runner.py)",
    "sampler": "Sampler (worker/model_runner.py)",
    "token_trie": "TokenTrie, the course backend's token masks for structured outputs (structured_output/)",
}


def _check_components(components) -> None:
    if components is None:
        return
    if not isinstance(components, dict):
        raise TypeError(f"components={components!r} must be a dict such as {{'block_pool': MyBlockPool}}")
    for name, cls in components.items():
        if name not in COMPONENTS:
            raise ValueError(f"components has an unknown name {name!r}; the replaceable components "
                             f"are: {', '.join(COMPONENTS)}")
        if not isinstance(cls, type):
            raise TypeError(f"components[{name!r}] must be a class (the one your exercise defines, "
                            f"replacing the engine's {COMPONENTS[name]}), got {cls!r}")


def component(config, name: str, default: type) -> type:
    """The class to build for ``name``: ``config.components[name]`` if given, else ``default``."""
    if name not in COMPONENTS:
        raise KeyError(f"{name!r} is not a replaceable component: add it to COMPONENTS")
    return (getattr(config, "components", None) or {}).get(name, default)


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
