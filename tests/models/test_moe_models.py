"""Mixture-of-experts models against Hugging Face on the same weights, and the layer's
parts on their own: the router, the loader's expert tensors, tensor-parallel shards.

The engine-level regimes (chunked prefill, preemption, prefix hits) are in
tests/engine/test_engine_parity.py (arch qwen3_moe, mixtral); expert parallelism over
processes in tests/engine/test_expert_parallel.py.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from microvllm import LLM, SamplingParams
from microvllm.attention import get_attention_backend
from microvllm.distributed.parallel_state import as_rank
from microvllm.layers.fused_moe import FusedMoE, fused_moe_iterative, select_experts
from microvllm.models.loader import load_model
from microvllm.models.tiny import make_tiny_model
from tests.engine.conftest import greedy_by_backend, hf_greedy, varied_prompts
from tests.models.test_parity import check_parity, prompt

# Each a different way config.json shapes the experts.
VARIANTS = {
    "qwen3_moe_no_renormalize": ("qwen3_moe", dict(norm_topk_prob=False)),
    "qwen3_moe_every_other_layer": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                                      mlp_only_layers=[])),
    "qwen3_moe_top_k_all_experts": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=4)),
    "mixtral_top_1": ("mixtral", dict(num_experts_per_tok=1)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_variants_match_hf(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    folder = make_tiny_model(tmp_path, arch, seed=5, tokenizer=False, **overrides)
    ours, _ = load_model(folder, get_attention_backend("torch"))
    sparse = [i for i, layer in enumerate(ours.layers) if isinstance(getattr(layer.mlp, "experts", None), FusedMoE)]
    if variant == "qwen3_moe_every_other_layer":
        assert sparse == [1, 3]   # (i + 1) % decoder_sparse_step == 0
    # (Seeds chosen so that greedy decoding never picks EOS, which min_new_tokens makes
    # Hugging Face's generate skip: the paged driver does not.)
    check_parity(folder, prompt(512, 29, seed=8))


@pytest.mark.parametrize("impl", ["iterative", "sorted", "triton"])
def test_each_forward_step_runs_the_engine_token_identical_to_hf(tmp_path, monkeypatch, impl):
    """Steps (a), (b), (c) in the real engine (the plain code, enforce_eager=True; the
    Triton kernel in its interpreter on a CPU)."""
    monkeypatch.setenv("MICROVLLM_MOE_IMPL", impl)
    folder = make_tiny_model(tmp_path, "qwen3_moe", seed=9, tokenizer=False)
    prompts = varied_prompts(512, count=4, seed=21, max_len=24)
    llm = LLM(str(folder), enforce_eager=True, max_model_len=128, max_num_batched_tokens=32)
    experts = llm.engine.executor.worker.model.layers[1].mlp.experts
    assert experts.impl == impl
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(folder), tuple(p), 8)


def test_the_layer_chooses_its_experts_once(monkeypatch):
    """``impl=`` or $MICROVLLM_MOE_IMPL is read when the layer is built, and the forward
    decides nothing: changing the variable afterwards changes nothing."""
    from microvllm.layers.fused_moe.layer import EXPERT_FUNCTIONS

    monkeypatch.setenv("MICROVLLM_MOE_IMPL", "iterative")
    from_env, explicit = FusedMoE(4, 2, 8, 6), FusedMoE(4, 2, 8, 6, impl="sorted")
    monkeypatch.delenv("MICROVLLM_MOE_IMPL")
    default = FusedMoE(4, 2, 8, 6)
    assert (from_env.impl, explicit.impl, default.impl) == ("iterative", "sorted", "sorted")   # a CPU's default
    monkeypatch.setenv("MICROVLLM_MOE_IMPL", "triton")
    calls = []
    monkeypatch.setitem(EXPERT_FUNCTIONS, "iterative", lambda *args: calls.append(1) or fused_moe_iterative(*args))
    for param in from_env.parameters():
        param.data.normal_()
    from_env(torch.randn(3, 8), torch.randn(3, 4))
    assert calls == [1] and from_env.impl == "iterative"


def test_the_loader_asks_the_experts_to_choose_on_their_device(tmp_path, monkeypatch):
    """load_model builds on the meta device; each MoE layer chooses again once its weights
    are on theirs (on a GPU that choice is the Triton kernel)."""
    devices = []
    monkeypatch.setattr(FusedMoE, "choose_impl", lambda self: devices.append(self.w13_weight.device.type))
    folder = make_tiny_model(tmp_path, "qwen3_moe", seed=5, tokenizer=False)
    load_model(folder, get_attention_backend("torch"))
    assert devices and devices[-1] == "cpu", devices


@pytest.mark.slow   # the Triton attention kernels in their interpreter: ~10 s
def test_triton_attention_backend_with_experts(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3_moe", seed=6, tokenizer=False)
    prompts = varied_prompts(512, count=5, seed=22, max_len=30)
    outs = {name: ids for name, (_, ids) in greedy_by_backend(folder, prompts, ("torch", "triton")).items()}
    assert outs["triton"] == outs["torch"]
    for p, tokens in zip(prompts, outs["triton"]):
        assert tuple(tokens) == hf_greedy(str(folder), tuple(p), 12)


# ---------------------------------------------------------------------- the router
def test_select_experts_by_hand():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 2]]
    assert torch.allclose(weights[0], probs[[0, 2]])
    weights, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(weights[0], probs[[0, 2]] / probs[[0, 2]].sum())
    assert torch.allclose(weights.sum(-1), torch.ones(1))
    # The bias picks the experts, never weighs them: expert 3 is chosen, with its own probability.
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    weights, ids = select_experts(logits, 2, renormalize=False, e_score_correction_bias=bias)
    assert ids.tolist() == [[3, 0]]
    assert torch.allclose(weights[0], probs[[3, 0]])
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and the number of experts"):
        select_experts(logits, 5, renormalize=True)


# ---------------------------------------------------------------------- loading
def test_a_missing_expert_tensor_is_named(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3_moe", seed=1, tokenizer=False)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors for \['layers.1.mlp.experts.w13_weight'\]"):
        load_model(folder, get_attention_backend("torch"))


def test_an_expert_of_the_wrong_shape_is_named(tmp_path):
    folder = make_tiny_model(tmp_path, "mixtral", seed=1, tokenizer=False)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.2.w2.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}.* has shape \(64, 31\) but config.json implies \(64, 32\)"):
        load_model(folder, get_attention_backend("torch"))


def test_quantizing_experts_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3_moe", seed=1, tokenizer=False)
    with pytest.raises(ValueError, match="experts have no quantized path"):
        load_model(folder, get_attention_backend("torch"), quantization="int8")


def test_shards_sum_to_the_whole_layer():
    """Tensor parallel (each expert's columns split) and expert parallel (whole experts
    split) shards, built as each rank would build them, add up to the one-process layer."""
    torch.manual_seed(0)
    E, k, H, inter, T = 4, 2, 16, 8, 9
    w13, w2 = torch.randn(E, 2 * inter, H), torch.randn(E, H, inter)
    hidden, logits = torch.randn(T, H), torch.randn(T, E)
    weights, ids = select_experts(logits, k, renormalize=True)
    whole = fused_moe_iterative(hidden, w13, w2, weights, ids)

    def loaded(layer):
        for e in range(E):
            layer.weight_loader(layer.w13_weight, w13[e, :inter], (e, "w1"))
            layer.weight_loader(layer.w13_weight, w13[e, inter:], (e, "w3"))
            layer.weight_loader(layer.w2_weight, w2[e], (e, "w2"))
        return layer

    for expert_parallel in (False, True):
        total = torch.zeros_like(whole)
        for rank in range(2):
            with as_rank(2, rank, enable_expert_parallel=expert_parallel):
                layer = loaded(FusedMoE(E, k, H, inter, renormalize=True))
            if expert_parallel:
                assert layer.w13_weight.shape == (2, 2 * inter, H)
                assert layer.expert_map().tolist() == ([0, 1, -1, -1] if rank == 0 else [-1, -1, 0, 1])
                local_ids = layer.expert_map()[ids]
            else:
                assert layer.w13_weight.shape == (E, inter, H)
                local_ids = ids
            total += layer.run_experts(hidden, weights, local_ids)
        assert torch.allclose(total, whole, atol=1e-5), f"expert_parallel={expert_parallel}"
