"""EngineCoreOutput: what ``Scheduler.update_from_output`` reports per request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens of one request after a step, and why it stopped (if it did).

    finish_reason  "stop" (EOS / stop token), "length" (max_tokens or
                   max_model_len) or "abort"; None while it continues
    stop_reason    the stop token id that ended it (None for EOS or length)
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None   # a KV connector's, once finished (disaggregated prefill)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
