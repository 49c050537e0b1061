"""Request: one prompt's tokens, its progress, and its life cycle.

    all_token_ids   [ p0 p1 p2 p3 p4 p5 p6 | o0 o1 o2 ]
                      prompt_token_ids       output_token_ids
                    |<------- num_tokens = 10 ----------->|
                    |<-- num_computed_tokens = 9 -->|       KV written for these
                                                     ^ o2: sampled last step, its KV
                                                       is computed next step (decode)
    spec_token_ids                                      [ d0 d1 d2 ]   speculative decoding:
                                                        drafts, checked next step with o2


``num_computed_tokens`` is how many leading tokens already have their KV in the
cache (prefix-cache hits included). The scheduler's only job is to make it
catch up with ``num_tokens``: a prefill chunk or a single decode token per
step; once it does, the model has logits for the last token and samples the
next one, which grows ``num_tokens`` by one again.

Life cycle (see ``core/scheduler.py`` for the full timeline):

    WAITING -> RUNNING -> FINISHED_STOPPED | FINISHED_LENGTH_CAPPED | FINISHED_ABORTED
     |   ^       |  ^
     |   |       v  |  (preempted: blocks freed, num_computed_tokens = 0)
     |   |     PREEMPTED
     v   | loaded (a KV connector: its blocks wait, cached, to be admitted as prefix hits)
    WAITING_FOR_REMOTE_KVS   (a KV connector loads some of its blocks; not schedulable)
"""

from __future__ import annotations

import enum
from typing import Any

from microvllm.core.kv_cache_utils import BlockHash, hash_new_full_blocks


class RequestStatus(enum.IntEnum):
    """Where a request is. Every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # a KV connector is loading its blocks
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # cancelled by the caller

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """"stop", "length", "abort" (vLLM's finish_reason strings), or None."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A generation request as the scheduler sees it (pure Python, no tensors).

    ``sampling_params`` is duck-typed: the scheduler reads ``max_tokens``
    (None = no limit but max_model_len), ``min_tokens``, ``ignore_eos`` and
    ``stop_token_ids`` (list or None) from it; the runner reads the rest.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        *,
        eos_token_id: int | None,
        block_size: int,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt: at least one token is needed")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        # Its LoRA adapter (a ``LoRARequest``: ``lora_name``, ``lora_int_id``, ``lora_digest``: its
        # blocks' prefix-cache key), None for the base model.
        self.lora_request = lora_request

        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + output in one list; read it, never modify it from outside.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-hit tokens at first admission; -1 = not yet admitted
        self.num_preemptions = 0
        # Speculative decoding: the drafter's guesses of the next tokens, checked by the
        # target at the next step (they are not tokens of the request until accepted).
        self.spec_token_ids: list[int] = []
        # Async scheduling (core/async_scheduler.py): tokens that steps still in flight will
        # sample for this request, not known yet; the next plan counts them as if they
        # were there. Always 0 without async scheduling.
        self.num_output_placeholders = 0
        # Set when a plan schedules it: its chunk stops short of its last token (+ the
        # placeholders), so this step samples nothing for it.
        self.is_prefill_chunk = False
        # KV connectors (disaggregated serving): what the client sent, and what goes back.
        extra_args = getattr(sampling_params, "extra_args", None) or {}
        self.kv_transfer_params: dict | None = extra_args.get("kv_transfer_params")

        # Hashes of the full blocks of all_token_ids, grown as tokens arrive.
        self.block_hashes: list[BlockHash] = []
        hash_new_full_blocks(self.block_hashes, self.all_token_ids, block_size, cache_salt, self.lora_request)

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model (vLLM's convention)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens plus draft tokens: what the next step may compute up to."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return getattr(self.sampling_params, "max_tokens", None)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Add sampled token(s); hash any block they complete. O(new tokens + new full blocks * B)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        hash_new_full_blocks(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt,
                             self.lora_request)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        """"stop", "length", "abort", or None while not finished."""
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
