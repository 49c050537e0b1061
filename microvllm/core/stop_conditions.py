"""When does a request stop? Checked after each sampled token is appended."""

from __future__ import annotations

from microvllm.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status on ``request`` and return True if its last token ends it.

    In this order (as vLLM V1's ``check_stop``):
    1. length: ``max_model_len`` tokens in all, or ``max_tokens`` outputs -> "length";
    2. fewer than ``min_tokens`` outputs: never stop on a token yet;
    3. the EOS token (unless ``ignore_eos``) -> "stop", stop_reason None;
    4. a token in ``stop_token_ids`` -> "stop", stop_reason = that token id.
    The stopping token stays in ``output_token_ids``. O(len(stop_token_ids)).
    """
    params = request.sampling_params
    max_tokens = request.max_tokens
    if request.num_tokens >= max_model_len or (max_tokens is not None and request.num_output_tokens >= max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens < (getattr(params, "min_tokens", 0) or 0):
        return False
    last_token_id = request.output_token_ids[-1]
    if not getattr(params, "ignore_eos", False) and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in (getattr(params, "stop_token_ids", None) or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False
