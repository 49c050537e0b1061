"""OutputProcessor: from new token ids to what the user sees.

Per request it keeps an incremental detokenizer (text grows as tokens arrive, stop
strings are found even when split across tokens) and, for ``n > 1``, the parent that
gathers its samples::

    parent "7"  (n=2)            what step() returns
      ├── child "0_7"  tokens, text, finish_reason   RequestOutput("7", outputs=[
      └── child "1_7"  tokens, text, finish_reason       CompletionOutput(0, ...),
                                                         CompletionOutput(1, ...)])

A stop string is found here, not in the scheduler (which sees only ids), so the
processor reports those children back to the engine core to be finished; and when
the core fails one sample (its grammar, a KV connector, a fault in a step), the
whole request fails here, and its other samples go back to the core to be aborted.

Logprobs arrive from the runner as lists of ids and numbers (``LogprobsLists``) and
leave as vLLM's dicts of ``Logprob`` with each token's text (``logprobs_to_dicts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microvllm.detokenizer import IncrementalDetokenizer
from microvllm.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from microvllm.sample.logprobs import LogprobsLists


@dataclass
class ChildState:
    child_id: str
    parent: "ParentState"
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object
    children: list[ChildState] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict | None = None

    def finished(self) -> bool:
        return all(c.completion.finish_reason is not None for c in self.children)

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.completion for c in self.children], finished=self.finished(),
                             num_cached_tokens=self.num_cached_tokens,
                             prompt_logprobs=self.prompt_logprobs,
                             kv_transfer_params=self.kv_transfer_params)


def sample_ids(request_id: str, n: int) -> list[str]:
    """The scheduler's ids of a request's samples: itself, or "0_7", "1_7", ... for n > 1."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class OutputProcessor:
    def __init__(self, tokenizer, detokenizer_class: type[IncrementalDetokenizer] = IncrementalDetokenizer):
        self.tokenizer = tokenizer
        self.detokenizer_class = detokenizer_class
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self.parents

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        return [c.child_id for c in parent.children if c.completion.finish_reason is None]

    def num_unfinished(self) -> int:
        return len(self.parents)

    def ids_in_use(self, request_id: str, n: int) -> list[str]:
        """Which of the ids a new request would take (its own, its samples') are taken."""
        wanted = {request_id, *sample_ids(request_id, n)}
        return sorted(i for i in wanted if i in self.parents or i in self.children)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> list[str]:
        parent = ParentState(request_id, prompt, prompt_token_ids, params)
        if getattr(params, "prompt_logprobs", None) is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        ids = sample_ids(request_id, params.n)
        for index, child_id in enumerate(ids):
            detok = None
            if self.tokenizer is not None:
                detok = self.detokenizer_class(
                    self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens)   # stop strings count only after min_tokens
            completion = CompletionOutput(index=index,
                                          logprobs=[] if params.logprobs is not None else None)
            child = ChildState(child_id, parent, completion, detok)
            parent.children.append(child)
            self.children[child_id] = child
        self.parents[request_id] = parent
        return ids

    def process(self, core_outputs) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one core step's outputs (``EngineCoreOutput``: new tokens, logprobs, a
        finish reason or an error). Returns (outputs of the requests that changed, sample
        ids that hit a stop string, sample ids of requests that failed): the front end
        has the core end both kinds (vLLM: ``OutputProcessor.process_outputs``, whose
        ``reqs_to_abort`` the core aborts)."""
        changed: dict[str, ParentState] = {}
        failed: dict[str, RequestOutput] = {}
        stopped: list[str] = []
        to_abort: list[str] = []
        for parent in self.parents.values():
            for child in parent.children:
                child.completion.delta_text, child.completion.delta_token_ids = "", []
        for core in core_outputs:
            found = self.children.get(core.request_id)
            if found is None:
                continue   # its request failed or was aborted earlier
            child = found
            completion, parent = child.completion, child.parent
            if completion.finish_reason is not None:
                continue   # ended here (a stop string) while the core, in its own process, ran on
            if core.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                # By position: a recomputed chunk (after preemption) overwrites the same slots.
                lists = core.new_prompt_logprobs
                dicts = self.logprobs_to_dicts(lists)
                parent.prompt_logprobs[lists.start:lists.start + len(dicts)] = dicts
            if core.error is not None:   # the core failed this sample: the whole request fails
                siblings = [c for c in self.child_ids(parent.request_id) if c != core.request_id]
                output = self.fail(parent.request_id, core.error, bad_request=core.bad_request)
                if output is not None:
                    failed[parent.request_id] = output
                    changed.pop(parent.request_id, None)
                    to_abort.extend(siblings)
                continue
            if not core.new_token_ids and core.finish_reason is None:
                continue   # a prompt chunk's logprobs only: nothing for the caller yet
            new_ids = list(core.new_token_ids)
            completion.token_ids.extend(new_ids)
            completion.delta_token_ids = new_ids
            if core.kv_transfer_params is not None:
                parent.kv_transfer_params = core.kv_transfer_params
            if core.num_cached_tokens and not parent.num_cached_tokens:
                parent.num_cached_tokens = core.num_cached_tokens
            if completion.logprobs is not None and core.new_logprobs is not None:
                lists = core.new_logprobs
                completion.logprobs.extend(self.logprobs_to_dicts(lists))
                # Column 0 of each row is the sampled token.
                completion.cumulative_logprob = ((completion.cumulative_logprob or 0.0)
                                                 + sum(row[0] for row in lists.logprobs))
            if child.detokenizer is not None and new_ids:
                # finished: release any text held back; stop_terminated: the last token
                # is an eos/stop token, whose text is not part of the output.
                delta = child.detokenizer.update(new_ids, finished=core.finish_reason is not None,
                                                 stop_terminated=core.finish_reason == "stop")
                completion.delta_text = delta
                completion.text += delta
                if child.detokenizer.stop_reason is not None:
                    # The text was cut at a stop string: that is why it ended (as in
                    # vLLM), even if the scheduler also ended it this step — the
                    # held-back text flushed at the end can hold a stop string too.
                    completion.finish_reason, completion.stop_reason = "stop", child.detokenizer.stop_reason
                    if core.finish_reason is None:
                        stopped.append(core.request_id)
            if core.finish_reason is not None and completion.finish_reason is None:
                completion.finish_reason, completion.stop_reason = core.finish_reason, core.stop_reason
            changed[parent.request_id] = parent
        outputs = []
        for parent in changed.values():
            outputs.append(parent.to_output())
            if parent.finished():
                self._drop(parent)
        outputs.extend(failed.values())
        return outputs, stopped, to_abort

    def logprobs_to_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """vLLM's form: per row ``{token id: Logprob}``, the row's own token first (its
        rank as computed), then the top N (ranks 1..N)."""
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) \
            if self.tokenizer is not None else (lambda t: None)
        dicts = []
        for ids, values, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.ranks):
            ranks = [rank, *range(1, len(ids))]
            dicts.append({t: Logprob(v, r, decode(t)) for t, v, r in zip(ids, values, ranks)})
        return dicts

    def parent_id(self, child_id: str) -> str:
        """The request a sample (``"1_7"``) belongs to; a request of n=1 is its own."""
        child = self.children.get(child_id)
        return child.parent.request_id if child is not None else child_id

    def fail(self, request_id: str, message: str, bad_request: bool = False) -> RequestOutput | None:
        """End a request that failed inside a step: its unfinished samples get
        ``finish_reason="error"``, and the output carries ``message`` in ``error``.
        ``bad_request``: the request's own fault (a grammar no output can follow), not
        the engine's; a server answers 400 instead of 500."""
        output = self.abort(request_id, finish_reason="error")
        if output is not None:
            output.error, output.bad_request = message, bad_request
        return output

    def abort(self, request_id: str, finish_reason: str = "abort") -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if child.completion.finish_reason is None:
                child.completion.finish_reason = finish_reason
        self._drop(parent)
        return parent.to_output()

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.children.pop(child.child_id, None)

    def check_invariants(self, unfinished_in_scheduler: set[str]) -> None:
        """Every request the scheduler still holds is tracked here, and vice versa."""
        tracked = {cid for cid, c in self.children.items() if c.completion.finish_reason is None}
        if tracked != unfinished_in_scheduler:
            raise AssertionError(
                f"output bookkeeping drifted: only in scheduler {sorted(unfinished_in_scheduler - tracked)}, "
                f"only in output processor {sorted(tracked - unfinished_in_scheduler)}")
