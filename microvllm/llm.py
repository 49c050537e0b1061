"""``LLM``: the offline API, vLLM-compatible where the concept exists.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}],
                        SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].outputs[0].text

``generate`` adds every prompt to the engine, then calls ``engine.step()`` until all
are done — the same loop you can run by hand with ``llm.engine``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

from microvllm.engine.arg_utils import EngineArgs, check_engine_options
from microvllm.engine.engine import Engine
from microvllm.engine.outputs import RequestOutput
from microvllm.lora.request import LoRARequest
from microvllm.sampling_params import SamplingParams, default_sampling_params


class LLM:
    """An offline engine for one model: ``generate`` and ``chat`` on lists of prompts
    (vLLM's ``LLM``; the same arguments mean the same thing).

    Args:
        model: a Hugging Face model folder, a hub id already in the local Hugging Face
            cache (``"HuggingFaceTB/SmolLM2-135M-Instruct"``; never downloaded), or None
            for the embedded SmolLM2-135M-Instruct.
        **kwargs: any ``EngineArgs`` option (``engine/arg_utils.py`` lists each one once,
            with its default and what it does; ``python -m microvllm generate --help``
            prints them): ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
            ``enable_prefix_caching``, ``dtype``, ``device``, ``enforce_eager``,
            ``tensor_parallel_size``, ... and the course's hooks ``trace=True`` (record
            every step: ``llm.trace``), ``debug_invariants`` and ``components``.

    Its processes (the engine core's, with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``; the
    workers of ``tensor_parallel_size > 1``) stop with ``shutdown()``, when the ``LLM`` is
    garbage collected, or when the interpreter exits: a script need not call ``shutdown()``.

    An unknown argument raises ``TypeError`` naming the closest valid one, or saying
    that it is a vLLM option microvllm does not implement.
    """

    def __init__(self, model: str | None = None, **kwargs):
        check_engine_options(kwargs)
        self.engine_args = args = EngineArgs(model=model, **kwargs)
        config = args.create_engine_config()   # every check, before anything is loaded
        # The course's hooks go beside the config, as Engine.from_engine_args passes them.
        self.engine = Engine(config, components=args.components, trace=args.trace,
                             debug_invariants=args.debug_invariants)
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> Engine:
        """The engine under this LLM (vLLM's name; ``llm.engine`` is the same object)."""
        return self.engine

    @property
    def tokenizer(self):
        return self.engine.prompts.tokenizer

    @property
    def trace(self):
        """The recorded ``Trace`` (with ``trace=True``), else None."""
        return self.engine.trace

    # ------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; results come back in input order.
        ``lora_request``: the LoRA adapter to run with (engine started with
        ``enable_lora=True``): one for all prompts, or a list with one per prompt (None:
        the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a dict such as {{'prompt_token_ids': [1, 2, 3]}}, "
                            f"or a list of those; got {type(prompts).__name__}: {str(prompts)[:60]!r}")
        prompts = list(prompts)
        params = self._params_per_prompt(prompts, sampling_params)
        loras = self._loras_per_prompt(prompts, lora_request)
        # Check and tokenize every prompt before adding any, so a bad one leaves
        # nothing behind.
        processed = [self.engine.process_request(str(next(self._ids)), prompt, p, name=f"prompts[{index}]",
                                                 lora_request=lora)
                     for index, (prompt, p, lora) in enumerate(zip(prompts, params, loras))]
        request_ids = []
        try:
            for request in processed:
                self.engine.add_processed_request(request)
                request_ids.append(request.request_id)
            finished = self._run(request_ids, use_tqdm)
        except BaseException:
            # KeyboardInterrupt or an error mid-run: abort what is in flight so that
            # every block is free again and the next call starts clean.
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return [finished[r] for r in request_ids]

    def _params_per_prompt(self, prompts, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):   # verified by Engine.process_request
            return [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}: use SamplingParams(temperature=0, ...)")
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params: "
                             "pass one SamplingParams, or a list with one per prompt")
        for p in sampling_params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params entries must be SamplingParams, got {type(p).__name__}: "
                                "use SamplingParams(temperature=0, ...)")
        return sampling_params

    @staticmethod
    def _loras_per_prompt(prompts, lora_request) -> list[LoRARequest | None]:
        if not isinstance(lora_request, (list, tuple)):
            return [lora_request] * len(prompts)   # checked by Engine.process_request
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} lora_request entries: pass one "
                             "LoRARequest, or a list with one per prompt (None for the base model)")
        return list(lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        start, num_in, num_out = time.perf_counter(), 0, 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        num_in += len(out.prompt_token_ids)
                        num_out += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"est. speed input: {num_in / elapsed:.1f} toks/s, "
                                            f"output: {num_out / elapsed:.1f} toks/s")
                        bar.update(1)
        if bar is not None:
            bar.close()
        return finished

    # ---------------------------------------------------------------- chat
    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None, *,
             chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts)
        or a list of conversations, each rendered with the chat template (vLLM's ``chat``).

        ``content`` may be a string or OpenAI's parts ``[{"type": "text", "text": ...}]``.
        ``chat_template`` replaces the model's; ``chat_template_kwargs`` are passed to it;
        ``continue_final_message=True`` (with ``add_generation_prompt=False``) continues
        the last assistant message. Each output's ``prompt`` is the rendered text.
        ``lora_request``: as in ``generate``.
        """
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so chat() cannot render messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.chat_prompt(
            conversation, add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
            for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # -------------------------------------------------------------- stream
    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt as it is generated (deltas)."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream() takes one sample per prompt, got n={params.n}")
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, prompt, params)
        done = False
        try:
            while not done and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    if out.outputs[0].delta_text:
                        yield out.outputs[0].delta_text
                    done = out.finished
        finally:
            if not done:  # the caller stopped early or something failed: free its blocks
                self.engine.abort_request(request_id)


    # ------------------------------------------------------ vLLM's surface
    def shutdown(self) -> None:
        """Stop its processes now (the engine core's, the workers of ``tensor_parallel_size >
        1``; a no-op with none); the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self):
        """The Hugging Face tokenizer (``apply_chat_template(..., tokenize=False)`` and all)."""
        return self.engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's recommended defaults (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens) from its generation_config.json,
        as vLLM does with ``generation_config="auto"``; ``"vllm"``: plain ``SamplingParams()``."""
        source = self.engine.config.model_config.generation_config
        if source == "vllm":
            return SamplingParams()
        return default_sampling_params(self.engine.model_path if source == "auto" else Path(source))

    def get_metrics(self):
        """A snapshot of the engine's metrics (vLLM's ``LLM.get_metrics``): gauges of the
        queues and the KV cache, and with speculative decoding the counters of drafts and
        accepted drafts (``Counter`` / ``Vector`` with ``.name`` and ``.value(s)``)."""
        from microvllm.engine.metrics import engine_metrics
        return engine_metrics(self.engine)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prompt block (e.g. before timing a run). False while
        requests hold blocks, unless ``reset_running_requests`` preempts them first."""
        return self.engine.reset_prefix_cache(reset_running_requests)

    def start_profile(self) -> None:
        """Start a torch.profiler trace of this process (see ``microvllm/profiler.py``)."""
        self.engine.start_profile()

    def stop_profile(self) -> Path:
        """Stop the trace and write it as a Chrome trace JSON; returns its path."""
        return self.engine.stop_profile()


def _progress_bar(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
