"""Request and RequestStatus."""

import pytest

from microvllm.core import Request, RequestStatus
from microvllm.core.kv_cache_utils import hash_new_full_blocks
from tests.core.core_helpers import FakeSamplingParams, make_request


def test_token_bookkeeping_and_incremental_hashes():
    r = make_request("a", [1, 2, 3, 4, 5], 4)
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens) == (5, 5, 0)
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0 and r.num_cached_tokens == -1
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([6, 7])
    r.append_output_token_ids(8)
    assert r.output_token_ids == [6, 7, 8] and r.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert r.num_tokens == 8 and len(r.block_hashes) == 2
    expected = []
    hash_new_full_blocks(expected, list(range(1, 9)), 4)
    assert r.block_hashes == expected


def test_status_helpers_and_finish_reasons():
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)
    r = make_request("a", [1], 4)
    assert r.get_finished_reason() is None and not r.is_finished()
    for status, reason in [(RequestStatus.FINISHED_STOPPED, "stop"),
                           (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
                           (RequestStatus.FINISHED_ABORTED, "abort")]:
        r.status = status
        assert r.get_finished_reason() == reason and r.is_finished()


def test_request_reads_duck_typed_params_and_rejects_empty_prompt():
    r = Request("a", [1, 2], FakeSamplingParams(max_tokens=3), eos_token_id=2, block_size=4, arrival_time=1.5)
    assert r.max_tokens == 3 and r.eos_token_id == 2 and r.arrival_time == 1.5
    with pytest.raises(ValueError, match="empty prompt"):
        make_request("b", [], 4)
