"""``EngineArgs``: every engine setting in one dataclass, as vLLM's ``vllm.engine.arg_utils``.

The same settings reach the engine three ways, all through this class::

    LLM(model, max_num_seqs=8, ...)           keyword arguments   -> EngineArgs(...)
    --max-num-seqs 8 on a command line        EngineArgs.add_cli_args / from_cli_args
    LLMEngine.from_engine_args(engine_args)   the engine itself
                        |
                        v
    engine_args.create_engine_config()  ->  EngineConfig: every "auto" settled, frozen
                                            (microvllm/config/ draws its tree)

This class is the one place an option is listed: its default, its doc, its flag and
its checks. ``create_engine_config`` is where vLLM options that mean something else on
one CPU process are translated (each says what it does in one log line) or refused with
a reason: ``gpu_memory_utilization``, ``trust_remote_code``, ``tokenizer``,
``disable_log_stats``, ``dtype="auto"``.

``trace``, ``debug_invariants`` and ``components`` are the course's hooks: options of
``LLM`` like the others, but not settings of the engine; ``Engine.from_engine_args``
passes them beside the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path

from microvllm.config import (
    DEFAULT_KV_CACHE_BYTES,
    DEVICES,
    DTYPES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from microvllm.config.cache import MAMBA_CACHE_MODES
from microvllm.config.components import check_components
from microvllm.config.model import is_hybrid
from microvllm.config.parallel import DISTRIBUTED_EXECUTOR_BACKENDS
from microvllm.config.structured_outputs import BACKENDS as STRUCTURED_OUTPUT_BACKENDS
from microvllm.layers.linear import divide, shard_heads
from microvllm.layers.quantization import check_quantization
from microvllm.models.gguf_loader import gguf_weights_file
from microvllm.models.hub import resolve_model_path
from microvllm.models.loader import load_config
from microvllm.models.registry import moe_dims, resolve_model_class
from microvllm.platforms import Platform, get_platform
from microvllm.reasoning import ReasoningParserManager

logger = logging.getLogger(__name__)

# vLLM's spellings of a dtype. "auto" stays "auto": the platform settles it (float32 on a
# CPU, where bfloat16 is slower without AMX and the parity tests run; bfloat16 on CUDA).
DTYPE_ALIASES = {"float": "float32", "half": "float16"}

# vLLM engine options that microvllm does not implement: named as such, not "unknown".
VLLM_ONLY_ENGINE_OPTIONS = (
    "pipeline_parallel_size", "data_parallel_size_local",
    "data_parallel_address", "data_parallel_rpc_port", "data_parallel_backend", "decode_context_parallel_size",
    "kv_cache_dtype", "swap_space", "cpu_offload_gb",
    "load_format", "config_format", "download_dir", "revision", "tokenizer_revision", "code_revision",
    "tokenizer_mode", "hf_config_path", "hf_overrides", "hf_token", "skip_tokenizer_init",
    "enable_prompt_embeds", "enable_lora_bias", "lora_dtype", "fully_sharded_loras", "enable_sleep_mode",
    "compilation_config", "cuda_graph_sizes", "max_seq_len_to_capture", "num_gpu_blocks_override",
    "num_lookahead_slots", "logprobs_mode", "limit_mm_per_prompt", "mm_processor_kwargs",
    "mm_processor_cache_gb", "disable_mm_preprocessor_cache", "interleave_mm_strings", "media_io_kwargs",
    "task", "runner", "convert", "served_model_name", "override_generation_config",
    "structured_outputs_config", "guided_decoding_backend",
    "worker_cls", "worker_extension_cls", "logits_processors",
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
    quantization: str | None = field(default=None, metadata=_cli(
        "how the weights are stored: None = as the checkpoint has them; int8 = int8 weights with "
        "one scale per output row, quantized as a float checkpoint loads; gguf = a .gguf file's own "
        "Q4_1 / Q8_0 / F16 blocks (chosen by itself for a .gguf model)"))
    dtype: str = field(default="auto", metadata=_cli(
        "float32, bfloat16 or float16; auto = float32 on a CPU, bfloat16 on CUDA"))
    device: str = field(default="auto", metadata=_cli(
        "cpu, cuda, or auto (cuda where a CUDA GPU is present)"))
    seed: int = field(default=0, metadata=_cli("seed of the shared sampling generator"))
    structured_outputs_backend: str = field(default="auto", metadata=_cli(
        "what compiles structured outputs: xgrammar, course (regex and choice), or auto"))
    structured_outputs_compile_timeout: float = field(default=30.0, metadata=_cli(
        "the server's limit, in seconds, on compiling one request's grammar (waiting for a compile "
        "worker included); past it the request gets a 400"))
    structured_outputs_compile_workers: int = field(default=1, metadata=_cli(
        "the server's grammar-compile processes (a crash or a runaway compile there cannot stop the engine)"))
    structured_outputs_max_spec_chars: int = field(default=262_144, metadata=_cli(
        "longest structured-output spec (schema, regex, grammar or choice list as JSON) in characters"))
    structured_outputs_max_choices: int = field(default=4_096, metadata=_cli(
        "most entries in a structured-output choice list"))
    structured_outputs_max_schema_depth: int = field(default=128, metadata=_cli(
        "deepest nesting of a JSON schema, counting what each $ref leads to"))
    reasoning_parser: str = field(default="", metadata=_cli(
        "the model's reasoning format (qwen3 or deepseek_r1): structured outputs constrain only what follows "
        "the reasoning, and the server splits it from the answer (the message's `reasoning` field)"))
    max_logprobs: int = field(default=20, metadata=_cli(
        "the most logprobs (or prompt_logprobs) a request may ask for; -1: up to the vocabulary"))
    max_model_len: int | None = field(default=None, metadata=_cli(
        "longest prompt + output in tokens (default: the model's max_position_embeddings)"))
    block_size: int = field(default=16, metadata=_cli("tokens per KV cache block (a power of two)"))
    mamba_cache_mode: str = field(default="align", metadata=_cli(
        "hybrid models (linear-attention layers): align (vLLM's default) or all = snapshot the state "
        "at every block boundary so prefix caching can resume from it (vLLM's align keeps only those "
        "where a step ends); none = no snapshots (no prefix hits)"))
    num_kv_blocks: int | None = field(default=None, metadata=_cli(
        "KV cache blocks (default: as many as the KV budget holds, capped at what max_num_seqs "
        "full-length requests could use)"))
    kv_cache_memory_bytes: int = field(default=DEFAULT_KV_CACHE_BYTES, metadata=_cli(
        "KV cache budget in bytes when num_kv_blocks is not given"))
    gpu_memory_utilization: float | None = field(default=None, metadata=_cli(
        "on CUDA: the fraction of free GPU memory the engine may use (default 0.9); on a CPU: "
        "the fraction of kv_cache_memory_bytes (1 GiB by default) the KV cache may use"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_cli(
        "token budget of one engine step (default: 1024 with chunked prefill, else max_model_len; "
        "`microvllm serve` on a CPU sizes it from the machine: about half a second of projections)"))
    max_num_seqs: int = field(default=64, metadata=_cli("most requests in one step"))
    enable_prefix_caching: bool = field(default=True, metadata=_cli("reuse the KV of shared prompt prefixes"))
    enable_chunked_prefill: bool = field(default=True, metadata=_cli(
        "split long prompts over several steps"))
    async_scheduling: bool = field(default=False, metadata=_cli(
        "plan each engine step while the previous step's forward runs (vLLM's async "
        "scheduling; off by default here, as vLLM has it off on a CPU)"))
    attention_backend: str = field(default="auto", metadata=_cli(
        "attention backend name: torch, cpu, triton, ...; auto = on a CPU the C++ kernel where "
        "it builds (torch with enforce_eager), on CUDA triton"))
    tensor_parallel_size: int = field(default=1, metadata=_cli(
        "split the model over this many worker processes (torch.distributed); 1: this process"))
    enable_expert_parallel: bool = field(default=False, metadata=_cli(
        "mixture-of-experts models: split the experts over the tensor-parallel ranks (whole "
        "experts per rank, tokens sent to them) instead of slicing every expert"))
    distributed_executor_backend: str | None = field(default=None, metadata=_cli(
        "who runs the tensor-parallel ranks: mp (the default: worker processes on this machine), "
        "ray (Ray actors in the cluster `ray start` started, on any of its machines), uni (one "
        "rank, in this process)"))
    data_parallel_size: int = field(default=1, metadata=_cli(
        "microvllm serve: this many engine cores (each a whole model copy and KV cache, in a "
        "process of its own) behind one API server, each request sent to the least loaded"))
    data_parallel_rank: int | None = field(default=None, metadata=_cli(
        "external load balancing: this server is replica RANK of --data-parallel-size (one "
        "engine core; its KV event ports are offset by RANK); unset: all N cores here"))
    data_parallel_external_lb: bool = field(default=False, metadata=_cli(
        "this server runs one rank and a router in front balances the load (implied by "
        "--data-parallel-rank, as in vLLM)"))
    enforce_eager: bool = field(default=False, metadata=_cli(
        "run the plain model code the notebooks show: no C++ kernels, no packed weights, "
        "no decode fast path (same tokens, slower)"))
    disable_log_stats: bool = field(default=False, metadata=_cli(
        "accepted for vLLM scripts: microvllm logs no periodic stats"))
    generation_config: str = field(default="auto", metadata=_cli(
        "where get_default_sampling_params() reads defaults: auto (the model's "
        "generation_config.json), vllm (SamplingParams()), or a folder"))
    speculative_config: dict | None = field(default=None, metadata=_cli(
        'speculative decoding, as a JSON dict: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
        "methods ngram, draft_model (with model=), layer_skip (with num_draft_layers=)", parse=json.loads))
    kv_events_config: dict | None = field(default=None, metadata=_cli(
        'KV cache events for a router, as a JSON dict (vLLM\'s KVEventsConfig): e.g. \'{"enable_kv_cache_events": '
        'true, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}\'. The events carry '
        "every prompt's token ids: the default endpoint is loopback (vLLM's is tcp://*:5557); a wildcard "
        "(*, 0.0.0.0, ::) logs a warning", parse=json.loads))
    kv_transfer_config: dict | None = field(default=None, metadata=_cli(
        'the KV connector, as a JSON dict (vLLM\'s KVTransferConfig): e.g. \'{"kv_connector": '
        '"OffloadingConnector", "kv_role": "kv_both"}\' (a second KV tier)', parse=json.loads))
    enable_lora: bool = field(default=False, metadata=_cli(
        "serve LoRA adapters: generate(..., lora_request=LoRARequest(name, id, peft_folder)) picks one per request"))
    max_loras: int = field(default=1, metadata=_cli(
        "with enable_lora: most distinct adapters in one step (the device's adapter slots)"))
    max_lora_rank: int = field(default=16, metadata=_cli(
        "with enable_lora: the largest adapter rank r served (1, 8, 16, 32, 64, 128, 256, 320 or 512)"))
    max_cpu_loras: int | None = field(default=None, metadata=_cli(
        "with enable_lora: adapters kept loaded on the CPU behind the slots (default: max_loras)"))
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
                base = f.metadata.get("parse") or next(t for t in (typing.get_args(kind) or (kind,))
                                                       if t is not type(None))
                parser.add_argument(flag, type=base, default=f.default, help=f.metadata["help"],
                                    metavar=f.name.upper() if base is str else None)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The settings found in parsed ``args`` (other attributes are ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})

    # ------------------------------------------------------------- config
    def create_engine_config(self, platform: Platform | None = None, hf_config=None) -> EngineConfig:
        """Check every option, settle every ``"auto"`` against ``platform`` and the model's
        config.json (``hf_config``; both found from the options when not given), and return
        the frozen ``EngineConfig`` (vLLM's ``EngineArgs.create_engine_config``)::

            option                   "auto" / None becomes
            dtype                    the platform's (float32 on a CPU, bfloat16 on CUDA)
            device                   cuda where a GPU is present, else cpu
            attention_backend        the platform's default
            max_model_len            the model's max_position_embeddings
            max_num_batched_tokens   1024 with chunked prefill, else max_model_len (a server
                                     on a CPU sizes its own: cli/serve.py)
            gpu_memory_utilization   the platform's KV budget (Platform.kv_cache_budget)
        """
        self._validate()
        self._check_process_options()
        self._check_async_scheduling()
        model_path = resolve_model_path(self.model)
        quantization = check_quantization(self.quantization, is_gguf=gguf_weights_file(model_path) is not None)
        if quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization={quantization!r} runs in one process: use tensor_parallel_size=1")
        hf_config = hf_config if hf_config is not None else load_config(model_path)
        platform = platform or get_platform(self.device, enforce_eager=self.enforce_eager)
        if platform.enforce_eager != self.enforce_eager:
            raise ValueError(f"enforce_eager={self.enforce_eager} but the platform given was made with "
                             f"enforce_eager={platform.enforce_eager}: make them agree")
        dtype = platform.resolve_dtype(DTYPE_ALIASES.get(self.dtype, self.dtype))
        if dtype != self.dtype:
            logger.info("dtype=%r: using %s, the %s platform's native precision",
                        self.dtype, dtype, platform.name)
        block_size = self._hybrid_block_size(hf_config, quantization)
        kv_cache_memory_bytes, gpu_memory_utilization = platform.kv_cache_budget(
            self.kv_cache_memory_bytes, self.gpu_memory_utilization)
        return EngineConfig(
            model_config=ModelConfig(model=self.model, model_path=model_path, hf_config=hf_config,
                                     dtype=dtype, seed=self.seed, generation_config=self.generation_config,
                                     max_logprobs=self.max_logprobs, quantization=quantization),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=self.enable_prefix_caching,
                                     mamba_cache_mode=self.mamba_cache_mode,
                                     num_kv_blocks=self.num_kv_blocks,
                                     kv_cache_memory_bytes=kv_cache_memory_bytes,
                                     gpu_memory_utilization=gpu_memory_utilization),
            scheduler_config=self._scheduler_config(hf_config.max_position_embeddings),
            parallel_config=self._parallel_config(hf_config),
            device_config=DeviceConfig(device=str(platform.device),
                                       attention_backend=platform.resolve_attention_backend(self.attention_backend),
                                       enforce_eager=self.enforce_eager),
            structured_outputs_config=StructuredOutputsConfig(**{
                f.name: getattr(self, f.name) for f in dataclasses.fields(StructuredOutputsConfig)}),
            speculative_config=self._speculative_config(hf_config),
            profiler_config=self.profiler_config,
            kv_events_config=None if self.kv_events_config is None else KVEventsConfig.from_dict(self.kv_events_config),
            kv_transfer_config=(None if self.kv_transfer_config is None
                                else KVTransferConfig.from_dict(self.kv_transfer_config)),
            lora_config=self._lora_config(hf_config))

    def _lora_config(self, hf_config) -> LoRAConfig | None:
        """``LoRAConfig`` with ``enable_lora``; None without it (then the other LoRA options
        must keep their defaults: they would do nothing)."""
        if not self.enable_lora:
            changed = [f"{name}={getattr(self, name)!r}" for name, default in
                       (("max_loras", 1), ("max_lora_rank", 16), ("max_cpu_loras", None))
                       if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{', '.join(changed)} without enable_lora=True does nothing: add "
                                 f"enable_lora=True (--enable-lora) or drop it")
            return None
        if self.speculative_config is not None:
            raise ValueError("enable_lora with speculative_config is not supported (the drafts would run "
                             "without the request's adapter): drop one of the two")
        if is_hybrid(hf_config):
            raise ValueError("enable_lora with a hybrid model (linear-attention layers) is not supported: its "
                             "projections are not the ones LoRA wraps here")
        return LoRAConfig(max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
                          max_cpu_loras=self.max_cpu_loras)

    def _check_async_scheduling(self) -> None:
        """What async scheduling does not combine with here, refused. vLLM 0.34 refuses it
        only for executors that cannot return a step's result later and for ROCm's DeepEP
        high-throughput DBO: its scheduler plans draft tokens and KV loads ahead too, and
        defers a grammar's mask until the token it needs arrives. microvllm does the last
        (``EngineCore.step_with_batch_queue``), not the first two yet."""
        if not self.async_scheduling:
            return
        for name, what in (("speculative_config", "speculative decoding"),
                           ("kv_transfer_config", "a KV connector")):
            if getattr(self, name) is not None:
                raise ValueError(f"async_scheduling=True with {name} ({what}) is not implemented in "
                                 f"microvllm (vLLM plans them with placeholders): drop one of the two")

    def _hybrid_block_size(self, hf_config, quantization) -> int:
        """``block_size``, raised for a hybrid model until a page holds a state (logged, as
        vLLM logs it); and what a hybrid cannot do here, refused."""
        if not is_hybrid(hf_config):
            return self.block_size
        if self.speculative_config is not None:
            raise ValueError("speculative decoding with a hybrid model (linear-attention layers) is not "
                             "supported: a rejected draft would have to roll the state back (vLLM keeps a "
                             "state per draft position); remove speculative_config")
        if self.tensor_parallel_size > 1:
            raise ValueError("a hybrid model (linear-attention layers) runs in one process here: "
                             "use tensor_parallel_size=1")
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r}: a hybrid model (linear-attention layers) "
                             "runs unquantized weights here")
        # The state's size is the model's to say (its linear layers' shapes): ask whichever
        # class config.json names, as moe_dims does, rather than naming one here.
        block_size = resolve_model_class(hf_config).min_block_size(hf_config, self.block_size)
        if block_size != self.block_size:
            logger.info("Setting attention block size to %d tokens so that an attention page holds "
                        "a linear-attention state (block_size=%d is too small)", block_size, self.block_size)
        return block_size

    def _scheduler_config(self, max_position_embeddings: int) -> SchedulerConfig:
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = max_position_embeddings
        elif max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_position_embeddings}: lower max_model_len")
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            # Chunked prefill lets a small budget serve any prompt; without it the
            # whole longest prompt must fit in one step.
            max_num_batched_tokens = 1024 if self.enable_chunked_prefill else max_model_len
        if not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len "
                f"(a prompt is scheduled whole), but {max_num_batched_tokens} < {max_model_len}: "
                "raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill")
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                               async_scheduling=self.async_scheduling)

    def _speculative_config(self, hf_config) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(self.speculative_config, hf_config.num_hidden_layers)
        if config.method != "ngram" and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config method {config.method!r} with tensor_parallel_size="
                             f"{self.tensor_parallel_size} is not implemented: use method 'ngram', or "
                             "tensor_parallel_size=1")
        if config.model is not None:
            draft_path = resolve_model_path(config.model)
            draft_config = load_config(draft_path)
            if draft_config.vocab_size != hf_config.vocab_size:
                raise ValueError(f"the draft model {config.model!r} has a vocabulary of {draft_config.vocab_size} "
                                 f"tokens but the target's has {hf_config.vocab_size}: a draft must share the "
                                 "target's tokenizer")
            if getattr(draft_config, "sliding_window", None) not in (None, 0) and \
                    getattr(draft_config, "use_sliding_window", True):
                raise ValueError(f"the draft model {config.model!r} uses a sliding window: drafts with one "
                                 "are not implemented; pick a full-attention draft")
            config = dataclasses.replace(config, model=str(draft_path))
        return config

    def _parallel_config(self, hf_config) -> ParallelConfig:
        """Refuse a ``tensor_parallel_size`` the model cannot be split by, from config.json,
        before any worker process starts (vLLM: ``ModelConfig.verify_with_parallel_config``):
        the query heads, the KV heads (or the ranks, when there are fewer KV heads) and the
        MLP's intermediate size must divide evenly. The vocabulary need not: it is padded."""
        tp, experts = self.tensor_parallel_size, moe_dims(hf_config)
        shard_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        if self.enable_expert_parallel and experts is None:
            raise ValueError("enable_expert_parallel=True: this model has no experts (it is not a "
                             "mixture of experts); leave enable_expert_parallel off")
        if experts is None or not experts.has_dense_layers or not self.enable_expert_parallel:
            divide(hf_config.intermediate_size, tp, "intermediate_size")
        if experts is not None and self.enable_expert_parallel:
            divide(experts.num_experts, tp, "num_experts")
        elif experts is not None:
            divide(experts.intermediate_size, tp, "moe_intermediate_size")
        return ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=self.enable_expert_parallel,
                              distributed_executor_backend=self.distributed_executor_backend or "mp",
                              data_parallel_size=self.data_parallel_size,
                              data_parallel_rank=self.data_parallel_rank or 0,
                              data_parallel_external_lb=(self.data_parallel_external_lb
                                                         or self.data_parallel_rank is not None))

    def _validate(self) -> None:
        """Every check of one option on its own, with what to change."""
        check_components(self.components)
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (1, 2, 4, 8, 16, 32...)")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba_cache_mode={self.mamba_cache_mode!r} is not one of "
                             f"{', '.join(map(repr, MAMBA_CACHE_MODES))}: 'align' or 'all' (state snapshots "
                             "at block boundaries) or 'none' (no snapshots)")
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
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use 'auto' or one of {sorted(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not supported; choose one of {DEVICES}")
        fraction = self.gpu_memory_utilization
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"gpu_memory_utilization={fraction!r} must be a fraction in (0, 1], "
                             "e.g. 0.5 for half of the KV cache budget")
        if not isinstance(self.attention_backend, str):
            raise TypeError(f"attention_backend={self.attention_backend!r} must be a backend name such as 'torch'")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager={self.enforce_eager!r} must be True or False")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed={self.seed!r} must be an int")
        _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_distributed_executor_backend(self.distributed_executor_backend, self.tensor_parallel_size)
        _positive_int("data_parallel_size", self.data_parallel_size)
        rank = self.data_parallel_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                                 or not 0 <= rank < self.data_parallel_size):
            raise ValueError(f"data_parallel_rank={rank!r} must be an int in [0, data_parallel_size="
                             f"{self.data_parallel_size})")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an int >= 0, or -1 for no limit")
        for name in ("structured_outputs_compile_workers", "structured_outputs_max_spec_chars",
                     "structured_outputs_max_choices", "structured_outputs_max_schema_depth"):
            _positive_int(name, getattr(self, name))
        timeout = self.structured_outputs_compile_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout={timeout!r} must be a number of seconds > 0")
        if self.reasoning_parser:
            try:
                ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)
            except KeyError as error:
                raise ValueError(f"reasoning_parser={self.reasoning_parser!r}: {error.args[0]}") from None
        if self.structured_outputs_backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_backend={self.structured_outputs_backend!r}: choose one of "
                             f"{STRUCTURED_OUTPUT_BACKENDS}")

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


def _check_distributed_executor_backend(backend, tensor_parallel_size: int) -> None:
    if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend={backend!r}: choose one of {DISTRIBUTED_EXECUTOR_BACKENDS} "
                         "(vLLM's 'external_launcher' and executor classes are not implemented)")
    if backend == "uni" and tensor_parallel_size > 1:
        raise ValueError(f"distributed_executor_backend='uni' runs one rank, in this process, but "
                         f"tensor_parallel_size={tensor_parallel_size}: use 'mp' or 'ray'")
    if backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                             "pip install 'microvllm[ray]' (on every machine of the cluster)")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")


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
            hint = f"did you mean {close[0]!r}?" if close else "not a vLLM or microvllm option: a typo?"
            described.append(f"{name!r} ({hint})")
    which = "an unknown argument" if len(unknown) == 1 else f"{len(unknown)} unknown arguments"
    raise TypeError(f"LLM() got {which}: {'; '.join(described)}: remove {'it' if len(unknown) == 1 else 'them'}. "
                    f"Valid arguments: {', '.join(sorted(known))}")


# vLLM's name for the same settings when they build an AsyncLLM.
AsyncEngineArgs = EngineArgs
