"""EngineCoreOutput: what ``Scheduler.update_from_output`` reports per request (with
``LogprobsLists``, the sampler's logprobs as plain lists, which the engine core adds); and
KVConnectorOutput: what a KV connector's worker side reports after a step (the scheduler
reads it, so it lives down here, in core, with the connectors above)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogprobsLists:
    """Logprobs of consecutive positions of one request, as Python lists, one row per
    position: column 0 is the token actually there (sampled, or the prompt's), then
    the top N. ``start``: the position of the first row (prompt logprobs)."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]                    # rank of each row's column-0 token, 1 = most likely
    start: int = 0


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens of one request after a step, and why it stopped (if it did).

    finish_reason  "stop" (EOS / stop token), "length" (max_tokens or
                   max_model_len) or "abort"; None while it continues; "error" when
                   the engine core failed it (``error`` says why)
    stop_reason    the stop token id that ended it (None for EOS or length)

    The scheduler fills the first six fields; the engine core adds the sampler's
    logprobs and, for a request it failed, the error (``engine/core.py``).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None   # a KV connector's, once finished (disaggregated prefill)
    new_logprobs: LogprobsLists | None = None          # of the new tokens (logprobs=N)
    new_prompt_logprobs: LogprobsLists | None = None   # of this step's prompt chunk (prompt_logprobs=N)
    error: str | None = None       # finish_reason "error": why (the caller hears it)
    bad_request: bool = False      # ... by the request's own fault (a server answers 400)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step (vLLM: ``vllm/v1/outputs.py``):
    requests whose blocks finished being saved / sent, and being loaded / received."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    # Loads that failed (vLLM: invalid_block_ids, kv_load_failure_policy "recompute"): the
    # scheduler frees those requests' blocks and they compute their prompt instead.
    failed_recving: set[str] | None = None
    # Saves that failed (each also in finished_sending: its blocks are freed as usual); the
    # connector's scheduler side must not count them as saved (OffloadingConnector: its
    # tier is then off).
    failed_sending: set[str] | None = None

    def is_empty(self) -> bool:
        return not self.finished_sending and not self.finished_recving and not self.failed_recving \
            and not self.failed_sending
