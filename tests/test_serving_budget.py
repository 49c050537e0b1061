"""A CPU server's default token budget (``cli/serve.py``, ``bench/roofline.py``): sized from
the model's FLOPs per token and the measured GEMM rate, a power of two within bounds, and
never over a budget the user set or a run without chunked prefill."""

import dataclasses

import pytest

from microvllm.bench.roofline import BUDGET_BOUNDS, ModelCost, serving_token_budget
from microvllm.cli.main import build_parser
from microvllm.cli.serve import size_cpu_token_budget
from microvllm.models.tiny import make_tiny_model

SMOLLM2 = ModelCost(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                    vocab_size=49152, body_params=106_168_896, embedding_params=28_311_552,
                    lm_head_params=28_311_552, element_size=4)


@pytest.mark.parametrize("gflops,budget", [(220, 512), (100, 256), (10, 256), (440, 1024), (5000, 2048),
                                           (140, 256), (300, 512), (340, 1024)])
def test_the_budget_is_half_a_second_of_projections_as_a_power_of_two(gflops, budget):
    # SmolLM2-135M: 0.21 GFLOP per token; 220 GFLOP/s -> 518 tokens in 0.5 s -> 512;
    # the nearest power of two on a log scale, flipping at 362 and 724 tokens:
    # 140 -> 330 tokens -> 256, 300 -> 707 -> 512, 340 -> 801 -> 1024
    assert serving_token_budget(SMOLLM2, gflops * 1e9) == budget
    assert BUDGET_BOUNDS[0] <= budget <= BUDGET_BOUNDS[1]


def test_noise_in_the_measured_rate_does_not_move_the_budget_of_a_machine_near_a_power_of_two():
    # The machine the figures came from measured 205-225 GFLOP/s from start to start.
    assert {serving_token_budget(SMOLLM2, g * 1e9) for g in range(190, 250, 5)} == {512}


def test_a_mixture_of_experts_counts_its_active_experts_only():
    moe = dataclasses.replace(SMOLLM2, body_params=20_000_000, expert_params=800_000_000, num_experts=64,
                              experts_per_token=4)   # 20M + 800M * 4/64 = 70M active per token
    dense_like = dataclasses.replace(SMOLLM2, body_params=70_000_000)
    assert serving_token_budget(moe, 300e9) == serving_token_budget(dense_like, 300e9) == 1024


def serve_args(*flags):
    return build_parser().parse_args(["serve", *flags])


def test_a_cpu_server_gets_a_sized_budget_unless_one_is_set(tmp_path):
    folder = str(make_tiny_model(tmp_path / "llama", "llama", seed=1))
    args = serve_args(folder, "--device", "cpu")
    size_cpu_token_budget(args)
    assert args.max_num_batched_tokens in (256, 512, 1024, 2048)
    given = serve_args(folder, "--max-num-batched-tokens", "96")
    size_cpu_token_budget(given)
    assert given.max_num_batched_tokens == 96
    whole = serve_args(folder, "--no-enable-chunked-prefill")
    size_cpu_token_budget(whole)
    assert whole.max_num_batched_tokens is None   # max_model_len, as the engine decides
