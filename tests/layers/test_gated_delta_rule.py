"""The gated delta rule and the causal conv, against Hugging Face's own torch forms
(transformers' Qwen3.5 modeling file) on fresh random inputs; the chunked form against
the recurrent one; and the state carried across a split (chunked prefill, then decode)."""

import pytest
import torch

from microvllm.layers.linear_attention.causal_conv1d import causal_conv1d
from microvllm.layers.linear_attention.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def random_inputs(seed: int, T: int, H_k: int = 2, H_v: int = 4, d_k: int = 8, d_v: int = 6):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H_k, d_k, generator=gen)
    k = torch.randn(T, H_k, d_k, generator=gen)
    v = torch.randn(T, H_v, d_v, generator=gen)
    g = -torch.rand(T, H_v, generator=gen) * 0.5          # log decays <= 0
    beta = torch.rand(T, H_v, generator=gen)
    state = torch.randn(H_v, d_k, d_v, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seed,T", [(0, 1), (1, 7), (2, 64), (3, 130)])
def test_both_forms_match_hugging_face(seed, T):
    q, k, v, g, beta, state = random_inputs(seed, T)
    want_o, want_s = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    for form in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o, s = form(q, k, v, g, beta, state)
        torch.testing.assert_close(o, want_o[0], rtol=1e-4, atol=1e-5, msg=form.__name__)
        torch.testing.assert_close(s, want_s[0], rtol=1e-4, atol=1e-5, msg=form.__name__)
    chunk_o, chunk_s = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o, chunk_o[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_a_prompt_split_anywhere_gives_the_same_outputs_and_state(chunk_size):
    q, k, v, g, beta, _ = random_inputs(5, 50)
    whole_o, whole_s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)
    state, outs = None, []
    for start, end in ((0, 13), (13, 40), (40, 49)):     # chunked prefill
        o, state = chunk_gated_delta_rule(q[start:end], k[start:end], v[start:end], g[start:end],
                                          beta[start:end], state, chunk_size=chunk_size)
        outs.append(o)
    o, state = recurrent_gated_delta_rule(q[49:], k[49:], v[49:], g[49:], beta[49:], state)   # decode
    outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, whole_s, rtol=1e-4, atol=1e-5)


def test_the_state_is_not_changed_in_place():
    q, k, v, g, beta, state = random_inputs(7, 9)
    before = state.clone()
    for form in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        form(q, k, v, g, beta, state)
        assert torch.equal(state, before), form.__name__


@pytest.mark.parametrize("T", [1, 3, 20])
def test_causal_conv_matches_hugging_face_and_carries_its_state(T):
    gen = torch.Generator().manual_seed(T)
    channels, kernel = 10, 4
    x = torch.randn(T + 5, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    want = hf.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    y, _ = causal_conv1d(x, weight)
    torch.testing.assert_close(y, want)
    first, state = causal_conv1d(x[:T], weight)          # T tokens, then 5 one at a time
    rest = []
    for t in range(T, T + 5):
        y_t, state = causal_conv1d(x[t:t + 1], weight, state)
        rest.append(y_t)
    torch.testing.assert_close(torch.cat([first, *rest]), want)


def tiny_config():
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention", "full_attention"])


@pytest.mark.parametrize("T", [1, 5, 70])
def test_the_layer_matches_hugging_face_and_continues_from_its_state(T):
    from microvllm.layers.linear_attention.gated_deltanet import GatedDeltaNet, LinearAttentionState

    torch.manual_seed(T)
    config = tiny_config()
    theirs = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours = GatedDeltaNet(config).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(T + 3, config.hidden_size)
    with torch.no_grad():
        want = theirs(x[None])[0]
        got, _ = ours(x, LinearAttentionState())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        first, state = ours(x[:T], LinearAttentionState())      # prefill T, then 3 decode steps
        rest = []
        for t in range(T, T + 3):
            y, state = ours(x[t:t + 1], state)
            rest.append(y)
        torch.testing.assert_close(torch.cat([first, *rest]), want, rtol=1e-4, atol=1e-5)
