"""Structured outputs: constrain what a request may generate to a JSON schema, a regex,
a grammar or a list of choices (vLLM: ``v1/structured_output/``).

    SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
        at the door (Engine.process_request, off the engine thread):
            the spec's size and depth checked first (limits.py: ValueError, a 400)
            LLM:    manager.compile(params) -> one grammar (matcher) per sample, here
            server: manager.prepare -> compiled in a worker process (compile_workers.py:
                    a crash, a timeout, a client gone cannot touch the engine)
                    -> manager.grammars_from(what it sent back)
            compiled grammars are cached by spec, least recently used out past a budget
            manager.check_can_start: a first mask that allows nothing -> ValueError (400)
        each step (Engine.step):
            plan = scheduler.schedule()
            manager.grammar_bitmask(rows that sample a token) -> int32 [rows, vocab/32]
            sampler: raw logprobs first, then those rows masked (-inf where the bit
                     is 0) with the other logits rules, then the draw
            scheduler.update_from_output -> manager.accept_tokens(each new token)
            a grammar that accepted EOS is terminated: its request is finished
            a token it refuses (the mask allowed nothing): the request fails, "error"

    With a reasoning parser (``reasoning_parser="qwen3"``, ``--reasoning-parser``) the grammar
    is in force only after the reasoning, vLLM's rule: the model thinks freely, then answers
    in the format asked for::

        prompt ... <think>   Paris is the capital   </think>   {"city": "Paris"}
                             no mask, the grammar    the end   masked; the grammar
                             takes nothing           tag       takes each token

Files: ``backend_types.py`` the interface; ``backend_regex.py`` + ``regex_dfa.py`` the
course's own backend (regex and choice); ``backend_xgrammar.py`` the production one
(everything, what vLLM uses); ``bitmask.py`` the mask both fill; ``limits.py`` and
``compile_workers.py`` what a server needs so that no spec can crash or stall it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from microvllm.config.structured_outputs import StructuredOutputsConfig
from microvllm.reasoning import ReasoningParserManager
from microvllm.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from microvllm.structured_output.bitmask import allocate_bitmask, allows_nothing
from microvllm.structured_output.compile_workers import CompileJob
from microvllm.structured_output.errors import clean_compiler_message  # noqa: F401 - part of the API
from microvllm.structured_output.limits import check_spec

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "xgrammar", "course")


class StructuredOutputManager:
    """One engine's backend and its requests' grammars (by the scheduler's request id)."""

    def __init__(self, tokenizer, vocab_size: int, backend: str = "auto", token_trie: type | None = None,
                 limits: StructuredOutputsConfig | None = None, cache_bytes: int = 64 << 20,
                 reasoning_parser: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend={backend!r}: choose one of {BACKENDS}")
        self.tokenizer, self.vocab_size, self.backend_name = tokenizer, vocab_size, backend
        self.token_trie = token_trie   # the course backend's TokenTrie class (exercise 15: yours)
        self.limits = limits or StructuredOutputsConfig()   # its structured_outputs_max_* fields
        self._backends: dict[str, StructuredOutputBackend] = {}
        self.grammars: dict[str, StructuredOutputGrammar] = {}
        # The reasoning gate (vLLM's ``reasoner``): per request, whether its reasoning is over
        # (then its grammar masks and takes tokens). None: no gate, every grammar is in force.
        self.reasoner = None
        if reasoning_parser:
            self.reasoner = ReasoningParserManager.get_reasoning_parser(reasoning_parser)(tokenizer)
            self.reasoner.think_token_ids()   # ValueError now, at start, if the tags are not tokens
        self.reasoning_ended: dict[str, bool] = {}
        # Compiled grammars by spec, least recently used first, at most cache_bytes in all:
        # requests with the same schema (a client's every call) compile it once.
        self._compiled: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self.cache_bytes, self._cached_bytes = cache_bytes, 0
        self._lock = threading.Lock()   # compiles run on several threads at once
        # What building the masks costs: seconds in grammar_bitmask, and how many steps.
        self.mask_seconds_total = 0.0
        self.num_mask_steps = 0
        self.last_mask_seconds = 0.0

    def backend(self, kind: StructuredOutputOptions) -> StructuredOutputBackend:
        """The backend that compiles ``kind`` (built on first use)."""
        name = self.backend_name
        if name == "auto":   # xgrammar where installed (vLLM's default), else the course's
            name = "xgrammar" if _xgrammar_installed() else "course"
        with self._lock:
            if name not in self._backends:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer, and this model folder has none")
                if name == "xgrammar":
                    from microvllm.structured_output.backend_xgrammar import XgrammarBackend
                    self._backends[name] = XgrammarBackend(self.tokenizer, self.vocab_size, self.cache_bytes)
                else:
                    from microvllm.structured_output.backend_regex import RegexBackend, TokenTrie

                    self._backends[name] = RegexBackend(self.tokenizer, self.vocab_size, self.token_trie or TokenTrie)
            return self._backends[name]

    def compile(self, params, n: int) -> list[StructuredOutputGrammar]:
        """One grammar per sample for ``params.structured_outputs``, compiled here, in this
        thread; ``ValueError`` (naming the field) for a spec that breaks a limit or does not
        compile. Slow for big schemas: call it off the engine thread. (A server compiles
        in worker processes instead: ``prepare``, then ``grammars_from``.)"""
        job, grammars = self.prepare(params, n)
        if grammars is not None:
            return grammars
        compiled = self.backend(job.kind).spec_compiler().compile(job.kind, job.spec, job.any_whitespace)
        return self._grammars(job, self._remember(job, compiled), n)

    def prepare(self, params, n: int) -> tuple[CompileJob, list[StructuredOutputGrammar] | None]:
        """The cheap part of compiling: the limits (``ValueError``), then the cache. Returns
        the job to compile, and the grammars already if the spec was compiled before."""
        structured = params.structured_outputs
        job = CompileJob(StructuredOutputOptions(structured.kind), structured.spec,
                         not structured.disable_any_whitespace)
        check_spec(structured, job.spec, self.limits)
        key = _key(self.backend(job.kind), job)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
        return job, (self._grammars(job, hit[0], n) if hit is not None else None)

    def grammars_from(self, job: CompileJob, blob, n: int) -> list[StructuredOutputGrammar]:
        """The grammars for what a compile worker sent back (``SpecCompiler.dump``)."""
        return self._grammars(job, self._remember(job, self.backend(job.kind).load(blob)), n)

    def _remember(self, job: CompileJob, compiled):
        backend = self.backend(job.kind)
        key, size = _key(backend, job), backend.compiled_size(compiled)
        with self._lock:
            if key not in self._compiled and size <= self.cache_bytes:
                self._compiled[key] = (compiled, size)
                self._cached_bytes += size
                while self._cached_bytes > self.cache_bytes:
                    _, (_, dropped) = self._compiled.popitem(last=False)
                    self._cached_bytes -= dropped
        return compiled

    def _grammars(self, job: CompileJob, compiled, n: int) -> list[StructuredOutputGrammar]:
        backend = self.backend(job.kind)
        return [backend.new_grammar(job.kind, compiled, job.any_whitespace) for _ in range(n)]

    def check_can_start(self, params, grammar: StructuredOutputGrammar) -> None:
        """``ValueError`` if ``grammar`` (just compiled for ``params``) allows no first token,
        not even end of text: no output could ever match it (a regex such as ``[^\\s\\S]``,
        or text that no token of this vocabulary can write). Known before the request
        runs, so it is refused at the door (HTTP 400) instead of failing after a step."""
        if self.allows_nothing(grammar):
            kind = params.structured_outputs.kind
            raise ValueError(f"structured_outputs.{kind} can never be matched: its grammar allows no token "
                             "of this model's vocabulary at the start, not even the end of the text")

    def allows_nothing(self, grammar: StructuredOutputGrammar) -> bool:
        """True if ``grammar``'s next mask allows no token at all (its state is unchanged)."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        grammar.fill_bitmask(bitmask, 0)
        return bool(allows_nothing(bitmask, self.vocab_size)[0])

    def add(self, request_id: str, grammar: StructuredOutputGrammar, prompt_token_ids=(),
            reasoning_parser_kwargs: dict | None = None) -> None:
        """Track ``grammar``. The reasoning is over from the start when the prompt ended it or
        when the request switched thinking off (vLLM's rule: the gate is built per request from
        ``reasoning_parser_kwargs``, the request's ``chat_template_kwargs``; with
        ``enable_thinking: false`` the model writes no reasoning, so the grammar holds from its
        first token, whether or not the template wrote an empty ``<think></think>``)."""
        self.grammars[request_id] = grammar
        if self.reasoner is not None:
            gate = (type(self.reasoner)(self.tokenizer, chat_template_kwargs=reasoning_parser_kwargs)
                    if reasoning_parser_kwargs else self.reasoner)
            self.reasoning_ended[request_id] = (not gate.thinking_enabled
                                                or self.reasoner.is_reasoning_end(prompt_token_ids))

    def remove(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)
        self.reasoning_ended.pop(request_id, None)

    def should_fill_bitmask(self, request_id: str) -> bool:
        """Whether the request's next token is masked: its grammar is in force."""
        return self.reasoning_ended.get(request_id, True)

    def tokens_for_grammar(self, request_id: str, new_token_ids: list[int]) -> list[int]:
        """Which of a step's new tokens the grammar takes: all of them once the reasoning is
        over; while it goes on, none, except those after an end tag among them (the
        reasoning ended this step: the grammar starts with the next token)."""
        if self.reasoning_ended.get(request_id, True):
            return new_token_ids
        assert self.reasoner is not None
        after = self.reasoner.content_ids_after_end(new_token_ids)
        if after is None:
            return []
        self.reasoning_ended[request_id] = True
        return after

    def grammar_bitmask(self, request_ids: list[str]) -> torch.Tensor:
        """``[len(request_ids), words]``: row i says what request i may sample next."""
        start = time.perf_counter()
        bitmask = allocate_bitmask(len(request_ids), self.vocab_size)
        for row, request_id in enumerate(request_ids):
            self.grammars[request_id].fill_bitmask(bitmask, row)
        self.last_mask_seconds = time.perf_counter() - start
        self.mask_seconds_total += self.last_mask_seconds
        self.num_mask_steps += 1
        return bitmask

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance a request's grammar; False if a token breaks it (then nothing changed)."""
        return self.grammars[request_id].accept_tokens(request_id, token_ids)

    def is_terminated(self, request_id: str) -> bool:
        return self.grammars[request_id].is_terminated()


def _key(backend: StructuredOutputBackend, job: CompileJob) -> tuple:
    return backend.name, job.kind, job.spec, job.any_whitespace


def _xgrammar_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("xgrammar") is not None
