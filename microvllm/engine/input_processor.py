"""InputProcessor: from what a user passed to what the engine core takes (vLLM:
``vllm/v1/engine/input_processor.py``).

    process(request_id, prompt, params)          every check, and the tokens; changes nothing
        params: verified; checked against the model (engine/param_checks.py)
        prompt: tokenized (engine/prompts.py), truncated if asked; a text far too long
                is refused before it is tokenized
        the core's own checks: fits max_model_len and the KV cache; a KV connector
                takes its kv_transfer_params (EngineCore.check_fits, check_kv_transfer_params)
        structured outputs: a grammar per sample, compiled unless given
      ──> ProcessedRequest
    core_requests(processed)                     one EngineCoreRequest per sample:
        n = 2, id "7"  ──>  "0_7" (seed + 0)  "1_7" (seed + 1)      the core never sees n

It reads the tokenizer and the config and writes nothing, so a server calls it on a
thread of its own while the core runs a step (vLLM runs it in the API process).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from microvllm.config import EngineConfig
from microvllm.distributed.kv_transfer.kv_transfer_params import check_kv_transfer_params
from microvllm.engine.core import EngineCoreRequest
from microvllm.engine.output_processor import sample_ids
from microvllm.engine.param_checks import check_params_for_model
from microvllm.engine.prompts import PromptProcessor
from microvllm.lora.lora_model import check_adapter_fits
from microvllm.lora.peft_helper import PEFTHelper
from microvllm.lora.request import AdapterDigests, LoRARequest
from microvllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedRequest:
    """A request that passed every check: adding it can no longer fail."""

    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    grammars: list | None = None   # structured outputs: one compiled matcher per sample
    lora_request: LoRARequest | None = None   # its LoRA adapter, checked; None: the base model
    reasoning_parser_kwargs: dict | None = None   # the chat's template kwargs (the reasoning gate's)


class InputProcessor:
    """The front end's door. ``core``: what answers the checks only the engine core can
    make (``check_fits``, ``check_kv_transfer_params``, ``request_refused``); ``structured_output_manager`` compiles
    grammars; ``ids_in_use(request_id, n)``: the ids of unfinished requests it would take."""

    def __init__(self, config: EngineConfig, prompts: PromptProcessor, *, core=None,
                 structured_output_manager=None,
                 ids_in_use: Callable[[str, int], list[str]] = lambda request_id, n: []):
        self.config = config
        self.prompts = prompts
        self.core = core
        self.structured_output_manager = structured_output_manager
        self.ids_in_use = ids_in_use
        self.adapter_digests = AdapterDigests()   # each adapter id's digest: its blocks' prefix-cache key

    def process(self, request_id: str, prompt, params: SamplingParams | None = None,
                *, name: str | None = None, grammars: list | None = None,
                lora_request: LoRARequest | None = None,
                reasoning_parser_kwargs: dict | None = None) -> ProcessedRequest:
        """Every check a request must pass, and its tokens; changes nothing. ``name``: what
        errors call it (``LLM.generate`` checks all its prompts first, as "prompts[2]").
        ``grammars``: its structured-output matchers, compiled already (a server compiles
        them in worker processes); otherwise they are compiled here. ``lora_request``: its
        adapter (``check_lora_request``)."""
        token_ids: list[int] | None = None
        try:
            lora_request = self.check_lora_request(lora_request)
            processed = self._process(request_id, prompt, params, name=name, grammars=grammars)
            if lora_request is not None or reasoning_parser_kwargs is not None:
                processed = dataclasses.replace(processed, lora_request=lora_request,
                                                reasoning_parser_kwargs=reasoning_parser_kwargs)
            token_ids = processed.token_ids
            kv_transfer_params = (processed.params.extra_args or {}).get("kv_transfer_params")
            if kv_transfer_params is not None:   # from a request body: untrusted
                check_kv_transfer_params(kv_transfer_params)
                if self.core is not None:
                    self.core.check_kv_transfer_params(kv_transfer_params, token_ids)
            return processed
        except ValueError:
            # A refused request that a KV producer holds blocks for: tell it to let them go.
            if not isinstance(params, SamplingParams):
                raise
            kv_transfer_params = (params.extra_args or {}).get("kv_transfer_params")
            if isinstance(kv_transfer_params, dict) and self.core is not None:
                if token_ids is None:   # refused before it was tokenized: the release needs its tokens
                    try:
                        token_ids = self.tokenize_prompt(prompt, params)[1]
                    except Exception:  # noqa: BLE001 - then the peer frees on its timeout
                        token_ids = None
                self.core.request_refused(kv_transfer_params, token_ids)
            raise

    def _process(self, request_id: str, prompt, params: SamplingParams | None, *,
                 name: str | None, grammars: list | None) -> ProcessedRequest:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # again: a field may have been set after construction
        check_params_for_model(params, self.prompts.vocab_size, self.config.model_config.max_logprobs)
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id={request_id!r} must be a non-empty string")
        # The n > 1 samples get ids "0_7", "1_7", ...: those must be free too.
        taken = self.ids_in_use(request_id, params.n)
        if taken:
            raise ValueError(f"request_id={request_id!r} is already in use (unfinished: {taken}): "
                             "give each request a unique id (or wait until it finishes)")
        text, token_ids = self.tokenize_prompt(prompt, params, name=name or request_id)
        if params.bad_words:
            params = params.clone()   # the caller's object stays as it was
            params.bad_words_token_ids = self.prompts.bad_words_token_ids(params.bad_words)
        if self.core is not None:
            self.core.check_fits(name or request_id, token_ids)
        if params.structured_outputs is not None and self.structured_output_manager is not None:
            if grammars is None:
                grammars = self.structured_output_manager.compile(params, params.n)
            self.structured_output_manager.check_can_start(params, grammars[0])   # all n are alike
        return ProcessedRequest(request_id, text, token_ids, params, grammars)

    def check_lora_request(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """A LoRA adapter may run only on an engine started with ``enable_lora=True``, and
        must be a peft folder this engine serves (rank, target modules, plain LoRA): refused
        here, before the request runs, rather than in the middle of a step. Returns it as the
        core takes it: with its ``lora_digest`` (its files' sha256, taken once per id)."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest(lora_name, lora_int_id, lora_path), "
                            f"got {type(lora_request).__name__}")
        lora_config = self.config.lora_config
        if lora_config is None:
            raise ValueError(f"lora_request={lora_request.lora_name!r} but this engine was started without "
                             f"LoRA: start it with enable_lora=True (--enable-lora), and max_lora_rank >= the "
                             f"adapter's rank")
        helper = PEFTHelper.from_local_dir(lora_request.lora_path)
        helper.validate_legal(lora_config.max_lora_rank)
        check_adapter_fits(lora_request.lora_path, helper, self.config.model_config.hf_config)
        return self.adapter_digests.with_digest(lora_request)

    def tokenize_prompt(self, prompt, params: SamplingParams, *,
                        name: str | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, truncated as ``params.truncate_prompt_tokens`` asks.
        Changes nothing, so a server may call it on another thread. A text far too long
        for ``max_model_len`` is refused before it is tokenized (that alone could take
        seconds): it needs at least len(text) / (the longest token's length) tokens."""
        truncate = params.truncate_prompt_tokens
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt")
        if isinstance(text, str) and truncate is None:
            self.check_text_fits(len(text), f"request {name!r}: the prompt" if name else "prompt",
                                 "the prompt (or set truncate_prompt_tokens)")
        text, token_ids = self.prompts.process(prompt)
        if truncate is not None:
            keep = self.config.scheduler_config.max_model_len - 1 if truncate == -1 else truncate
            if len(token_ids) > keep:   # the last `keep` tokens: the end of a long text matters most
                token_ids = token_ids[-keep:]
                text = self.prompts.tokenizer.decode(token_ids, skip_special_tokens=False) \
                    if self.prompts.tokenizer is not None else None
        return text, token_ids

    def max_text_chars(self) -> int:
        """The longest text that could still fit ``max_model_len`` (``check_text_fits``'s bound)."""
        if self.prompts.tokenizer is None:
            return 0
        return self.config.scheduler_config.max_model_len * self.prompts.max_token_chars - 1

    def check_text_fits(self, num_chars: int, which: str, shorten: str = "it") -> None:
        """``ValueError`` if ``num_chars`` characters of text cannot fit ``max_model_len``,
        known before tokenizing them (that alone could take seconds): they need at least
        ``num_chars`` / (the longest token's characters) tokens."""
        if self.prompts.tokenizer is None:   # no text to tokenize at all
            return
        if num_chars > self.max_text_chars():
            min_tokens = num_chars // self.prompts.max_token_chars
            max_model_len = self.config.scheduler_config.max_model_len
            raise ValueError(f"{which} has {num_chars:,} characters, so at least {min_tokens:,} tokens, but "
                             f"max_model_len is {max_model_len}: shorten {shorten}")

    def core_requests(self, processed: ProcessedRequest) -> list[EngineCoreRequest]:
        """One ``EngineCoreRequest`` per sample (vLLM: ``ParentRequest``, in the front end)."""
        params = processed.params
        now = time.monotonic()
        # Prompt logprobs need every prompt position computed, never read from the
        # prefix cache: a salt of the request's own makes every first lookup miss.
        salt = f"prompt_logprobs:{uuid.uuid4().hex}" if params.prompt_logprobs is not None else None
        grammars = processed.grammars or [None] * params.n
        return [EngineCoreRequest(child_id, processed.token_ids, _child_params(params, index),
                                  eos_token_id=self.prompts.eos_token_id, arrival_time=now, cache_salt=salt,
                                  grammar=grammars[index], prompt=processed.text,
                                  lora_request=processed.lora_request,
                                  reasoning_parser_kwargs=processed.reasoning_parser_kwargs)
                for index, child_id in enumerate(sample_ids(processed.request_id, params.n))]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of an ``n > 1`` request: its own seed (seed + index), so the
    samples differ yet each stays reproducible."""
    if params.n == 1:
        return params
    return params.clone(n=1, seed=None if params.seed is None else params.seed + index)
