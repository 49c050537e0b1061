"""``LLM``: the offline API, vLLM-compatible where the concept exists.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}],
                        SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].outputs[0].text

``generate`` adds every prompt to the engine, then calls ``engine.step()`` until all
are done — the same loop you can run by hand with ``llm.engine``.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import time
from collections.abc import Iterator

from microvllm.config import EngineConfig
from microvllm.engine.engine import Engine
from microvllm.engine.outputs import RequestOutput
from microvllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int = 64, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 attention_backend: str = "auto", dtype: str = "float32", seed: int = 0,
                 trace: bool = False, enforce_eager: bool = False, **engine_options):
        _check_engine_options(engine_options)
        config = EngineConfig(
            model=model, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, attention_backend=attention_backend,
            dtype=dtype, seed=seed, trace=trace, enforce_eager=enforce_eager, **engine_options)
        self.engine = Engine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.prompts.tokenizer

    @property
    def trace(self):
        """The recorded ``Trace`` (with ``trace=True``), else None."""
        return self.engine.trace

    # ------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; results come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a dict such as {{'prompt_token_ids': [1, 2, 3]}}, "
                            f"or a list of those; got {type(prompts).__name__}: {str(prompts)[:60]!r}")
        prompts = list(prompts)
        params = self._params_per_prompt(prompts, sampling_params)
        # Check and tokenize every prompt before adding any, so a bad one leaves
        # nothing behind.
        processed = [self.engine.process_request(str(next(self._ids)), prompt, p, name=f"prompts[{index}]")
                     for index, (prompt, p) in enumerate(zip(prompts, params))]
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
        if isinstance(sampling_params, SamplingParams):
            sampling_params.verify()  # a field may have been set after construction
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
            p.verify()  # a field may have been set after construction
        return sampling_params

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
    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """``messages``: one conversation (a list of {"role", "content"} dicts) or a list
        of conversations. Each is rendered with the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so chat() cannot render messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(c, add_generation_prompt=True)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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


def _check_engine_options(options: dict) -> None:
    """Refuse an unknown keyword (often a vLLM-only one such as gpu_memory_utilization)
    with a message that lists what LLM() accepts."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TypeError(f"LLM() got an unknown argument {unknown[0]!r} ({hint}a vLLM option microvllm "
                        f"does not have, or a typo): remove it. Valid arguments: {', '.join(sorted(known))}")


def _progress_bar(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
