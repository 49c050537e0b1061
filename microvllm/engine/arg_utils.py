"""``EngineArgs``: every engine setting in one dataclass, as vLLM's ``vllm.engine.arg_utils``.

The same settings reach the engine three ways, all through this class::

    LLM(model, max_num_seqs=8, ...)           keyword arguments   -> EngineArgs(...)
    --max-num-seqs 8 on a command line        EngineArgs.add_cli_args / from_cli_args
    LLMEngine.from_engine_args(engine_args)   the engine itself
                        |
                        v
    engine_args.create_engine_config()  ->  EngineConfig (validated, microvllm's own)

``create_engine_config`` is where vLLM options that mean something else on one CPU
process are translated (each says what it does in one log line) or refused with a
reason: ``gpu_memory_utilization``, ``trust_remote_code``,
``tokenizer``, ``disable_log_stats``, ``dtype="auto"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microvllm.config import DEFAULT_KV_CACHE_BYTES, EngineConfig

logger = logging.getLogger(__name__)

# vLLM's spellings of a dtype. "auto" stays "auto": the platform settles it (float32 on a
# CPU, where bfloat16 is slower without AMX and the parity tests run; bfloat16 on CUDA).
DTYPE_ALIASES = {"float": "float32", "half": "float16"}

# vLLM engine options that microvllm does not implement: named as such, not "unknown".
VLLM_ONLY_ENGINE_OPTIONS = (
    "pipeline_parallel_size", "data_parallel_size", "data_parallel_rank", "data_parallel_size_local",
    "data_parallel_address", "data_parallel_rpc_port", "data_parallel_backend", "decode_context_parallel_size",
    "distributed_executor_backend", "quantization", "kv_cache_dtype", "swap_space", "cpu_offload_gb",
    "load_format", "config_format", "download_dir", "revision", "tokenizer_revision", "code_revision",
    "tokenizer_mode", "hf_config_path", "hf_overrides", "hf_token", "skip_tokenizer_init",
    "enable_prompt_embeds", "speculative_config", "enable_lora", "enable_lora_bias", "max_loras",
    "max_lora_rank", "max_cpu_loras", "lora_dtype", "fully_sharded_loras", "enable_sleep_mode",
    "compilation_config", "cuda_graph_sizes", "max_seq_len_to_capture", "num_gpu_blocks_override",
    "num_lookahead_slots", "logprobs_mode", "limit_mm_per_prompt", "mm_processor_kwargs",
    "mm_processor_cache_gb", "disable_mm_preprocessor_cache", "interleave_mm_strings", "media_io_kwargs",
    "task", "runner", "convert", "served_model_name", "override_generation_config",
    "structured_outputs_config", "guided_decoding_backend", "reasoning_parser", "kv_transfer_config",
    "kv_events_config", "worker_cls", "worker_extension_cls", "logits_processors",
    "logits_processor_pattern", "scheduling_policy", "scheduler_cls", "async_scheduling",
    "enable_expert_parallel", "enable_eplb", "enable_dbo", "disable_custom_all_reduce", "rope_scaling",
    "rope_theta", "allowed_local_media_path", "allowed_media_domains", "seed_everything",
    "max_parallel_loading_workers", "prefix_caching_hash_algo", "disable_sliding_window",
    "disable_cascade_attn", "max_num_partial_prefills", "max_long_partial_prefills",
    "long_prefill_token_threshold", "disable_chunked_mm_input", "disable_hybrid_kv_cache_manager",
    "model_loader_extra_config", "ignore_patterns", "pooler_config", "override_pooler_config",
    "model_impl", "override_attention_dtype", "calculate_kv_scales", "mamba_cache_dtype",
    "additional_config", "use_tqdm_on_load", "pt_load_map_location", "stream_interval",
    "kv_sharing_fast_prefill", "otlp_traces_endpoint", "collect_detailed_traces",
    "show_hidden_metrics_for_version", "aggregate_engine_logging", "safetensors_load_strategy",
)


def _cli(help: str, **extra) -> dict:
    return {"help": help, **extra}


@dataclass
class EngineArgs:
    """The engine's settings (vLLM's names where vLLM has the setting).

    Fields whose metadata says ``cli=False`` (dicts, classes) are keyword-only: they
    have no command-line flag.
    """

    model: str | None = field(default=None, metadata=_cli(
        "a Hugging Face model folder, or a hub id found in the local Hugging Face cache "
        "(never downloaded); default: the embedded SmolLM2-135M-Instruct"))
    tokenizer: str | None = field(default=None, metadata=_cli(
        "must be None or the model itself: the model folder's tokenizer is used"))
    trust_remote_code: bool = field(default=False, metadata=_cli(
        "refused when true: microvllm runs only its own model code"))
    dtype: str = field(default="auto", metadata=_cli(
        "float32, bfloat16 or float16; auto = float32 on a CPU, bfloat16 on CUDA"))
    device: str = field(default="auto", metadata=_cli(
        "cpu, cuda, or auto (cuda where torch.cuda.is_available())"))
    seed: int = field(default=0, metadata=_cli("seed of the shared sampling generator"))
    structured_outputs_backend: str = field(default="auto", metadata=_cli(
        "what compiles structured outputs: xgrammar, course (regex and choice), or auto"))
    max_logprobs: int = field(default=20, metadata=_cli(
        "the most logprobs (or prompt_logprobs) a request may ask for; -1: up to the vocabulary"))
    max_model_len: int | None = field(default=None, metadata=_cli(
        "longest prompt + output in tokens (default: the model's max_position_embeddings)"))
    block_size: int = field(default=16, metadata=_cli("tokens per KV cache block (a power of two)"))
    num_kv_blocks: int | None = field(default=None, metadata=_cli(
        "KV cache blocks (default: sized from kv_cache_memory_bytes)"))
    kv_cache_memory_bytes: int = field(default=DEFAULT_KV_CACHE_BYTES, metadata=_cli(
        "KV cache budget in bytes when num_kv_blocks is not given"))
    gpu_memory_utilization: float | None = field(default=None, metadata=_cli(
        "on CUDA: the fraction of free GPU memory the engine may use (default 0.9); on a CPU: "
        "the fraction of kv_cache_memory_bytes (1 GiB by default) the KV cache may use"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_cli(
        "token budget of one engine step"))
    max_num_seqs: int = field(default=64, metadata=_cli("most requests in one step"))
    enable_prefix_caching: bool = field(default=True, metadata=_cli("reuse the KV of shared prompt prefixes"))
    enable_chunked_prefill: bool = field(default=True, metadata=_cli(
        "split long prompts over several steps"))
    attention_backend: str = field(default="auto", metadata=_cli(
        "attention backend name: auto, torch, cpu, triton, ..."))
    tensor_parallel_size: int = field(default=1, metadata=_cli(
        "split the model over this many worker processes (torch.distributed); 1: this process"))
    enforce_eager: bool = field(default=False, metadata=_cli(
        "run the plain model code the notebooks show: no C++ kernels, no packed weights, "
        "no decode fast path (same tokens, slower)"))
    disable_log_stats: bool = field(default=False, metadata=_cli(
        "accepted for vLLM scripts: microvllm logs no periodic stats"))
    generation_config: str = field(default="auto", metadata=_cli(
        "where get_default_sampling_params() reads defaults: auto (the model's "
        "generation_config.json), vllm (SamplingParams()), or a folder"))
    trace: bool = field(default=False, metadata=_cli("record every engine step (llm.trace)", cli=False))
    debug_invariants: bool = field(default=False, metadata=_cli(
        "check the block pool and scheduler after every step (slow)", cli=False))
    profiler_config: dict | None = field(default=None, metadata=_cli(
        "vLLM's {'profiler': 'torch', 'torch_profiler_dir': ...} for start_profile()", cli=False))
    components: dict[str, type] | None = field(default=None, metadata=_cli(
        "replace engine components with your classes (the course's exercises)", cli=False))

    # ---------------------------------------------------------------- CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one ``--flag`` per setting (``--max-num-seqs``, ``--enable-prefix-caching`` /
        ``--no-enable-prefix-caching``, ...); returns ``parser`` as vLLM's does."""
        hints = typing.get_type_hints(EngineArgs)
        for f in dataclasses.fields(EngineArgs):
            if not f.metadata.get("cli", True):
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=f.metadata["help"])
            else:
                base = next(t for t in (typing.get_args(kind) or (kind,)) if t is not type(None))
                parser.add_argument(flag, type=base, default=f.default, help=f.metadata["help"],
                                    metavar=f.name.upper() if base is str else None)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The settings found in parsed ``args`` (other attributes are ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})

    # ------------------------------------------------------------- config
    def create_engine_config(self) -> EngineConfig:
        """Translate vLLM's options for one CPU process, then build a validated ``EngineConfig``."""
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)
                                  if hasattr(self, f.name)}
        values["dtype"] = self._resolve_dtype()
        values.pop("gpu_memory_utilization")  # None here: EngineConfig's default (0.9)
        if self._on_gpu():
            self._check_fraction()
            if self.gpu_memory_utilization is not None:
                values["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            values["kv_cache_memory_bytes"] = self._kv_cache_budget()
        self._check_process_options()
        return EngineConfig(**values)

    def _resolve_dtype(self):
        return DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype

    def _on_gpu(self) -> bool:
        """Will the engine run on CUDA? (``device="cuda"`` without a GPU fails later, in
        ``get_platform``, with what to change.)"""
        import torch

        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    def _check_fraction(self) -> None:
        fraction = self.gpu_memory_utilization
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"gpu_memory_utilization={fraction!r} must be a fraction in (0, 1], "
                             "e.g. 0.5 for half of the KV cache budget")

    def _kv_cache_budget(self) -> int:
        fraction = self.gpu_memory_utilization
        if fraction is None:
            return self.kv_cache_memory_bytes
        self._check_fraction()
        budget = int(fraction * self.kv_cache_memory_bytes)
        logger.info("gpu_memory_utilization=%s: no GPU here; the KV cache may use %s of "
                    "kv_cache_memory_bytes = %.0f MiB", fraction, fraction, budget / 2**20)
        return max(budget, 1)

    def _check_process_options(self) -> None:
        if self.trust_remote_code:
            raise ValueError("trust_remote_code=True: microvllm never runs code from a model folder; "
                             "it runs its own Llama, Mistral and Qwen3 code. Remove trust_remote_code")
        if self.tokenizer is not None and (self.model is None or
                                           Path(str(self.tokenizer)) != Path(str(self.model))):
            raise ValueError(f"tokenizer={self.tokenizer!r}: microvllm uses the tokenizer in the model "
                             "folder; remove tokenizer= (or copy its files into the model folder)")
        if self.disable_log_stats:
            logger.info("disable_log_stats=True: microvllm logs no periodic stats; nothing to turn off")


def check_engine_options(options: dict) -> None:
    """Refuse an unknown keyword of ``LLM()`` with a message that says what it is: a
    vLLM option microvllm does not implement, or a typo (with the closest name)."""
    import difflib

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(options) - known)
    if not unknown:
        return
    described = []
    for name in unknown:   # every one at once: fixing them one run at a time is slow
        if name in VLLM_ONLY_ENGINE_OPTIONS:
            described.append(f"{name!r} (a vLLM option that microvllm does not implement)")
        else:
            close = difflib.get_close_matches(name, known, n=1)
            described.append(f"{name!r} ({f'did you mean {close[0]!r}?' if close else 'not a vLLM or microvllm option: a typo?'})")
    which = "an unknown argument" if len(unknown) == 1 else f"{len(unknown)} unknown arguments"
    raise TypeError(f"LLM() got {which}: {'; '.join(described)}: remove {'it' if len(unknown) == 1 else 'them'}. "
                    f"Valid arguments: {', '.join(sorted(known))}")


# vLLM's name for the same settings when they build an AsyncLLM.
AsyncEngineArgs = EngineArgs
