"""The roofline prices a mixture of experts by what a token computes with and what a
step touches, not as a dense model of the same size."""

import pytest
import torch

from microvllm.bench.roofline import ModelCost
from microvllm.models.tiny import make_tiny_model


def test_experts_are_priced_by_the_tokens_that_reach_them(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3_moe", tokenizer=False)   # 8 experts, top-2, layer 1 sparse
    cost = ModelCost.from_folder(folder, torch.float32)
    hidden, inter, experts = 64, 32, 8
    assert (cost.num_experts, cost.experts_per_token) == (experts, 2)
    assert cost.expert_params == experts * 3 * hidden * inter            # one sparse layer
    dense = ModelCost.from_folder(make_tiny_model(tmp_path / "dense", "qwen3", tokenizer=False,
                                                  head_dim=16), torch.float32)
    assert dense.expert_params == 0 and dense.experts_touched(100) == 0.0

    one = cost.step_cost([(1, 10)], num_logit_rows=1)
    body_only = ModelCost(**{**cost.__dict__, "expert_params": 0}).step_cost([(1, 10)], num_logit_rows=1)
    # One token computes with 2 of 8 experts ...
    assert one.linear_flops - body_only.linear_flops == pytest.approx(2.0 * cost.expert_params * 2 / 8)
    # ... and reads them: a quarter of the experts' bytes; 64 tokens touch nearly all of them.
    assert one.bytes_read - body_only.bytes_read == pytest.approx(cost.expert_params * 4 * 2 / 8)
    assert cost.experts_touched(64) == pytest.approx(1 - (6 / 8) ** 64)
    assert cost.num_params == cost.body_params + cost.embedding_params + cost.expert_params
