"""The ``*WithLoRA`` wrappers against peft itself: the same weights, the same inputs, the
same outputs; a mixed batch (three adapters and the base) against per-token loops; the
refusals of ``PEFTHelper``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from microvllm.config.lora import LoRAConfig  # noqa: E402
from microvllm.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from microvllm.lora.layers import (  # noqa: E402
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from microvllm.lora.peft_helper import PEFTHelper  # noqa: E402
from microvllm.lora.punica_wrapper import LoRAMapping  # noqa: E402
from microvllm.lora.request import LoRARequest  # noqa: E402
from microvllm.lora.worker_manager import LRUCacheWorkerLoRAManager  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD, INTER = 32, 4, 2, 8, 48


class HFBlock(nn.Module):
    """The Hugging Face layout peft adapts: separate projections."""

    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(HIDDEN, HEADS * HEAD, bias=False)
        self.self_attn.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD, bias=False)
        self.self_attn.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD, bias=False)
        self.self_attn.o_proj = nn.Linear(HEADS * HEAD, HIDDEN, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.mlp.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.mlp.down_proj = nn.Linear(INTER, HIDDEN, bias=False)


class HFModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([HFBlock()])


class OurBlock(nn.Module):
    """Ours: fused q/k/v and gate/up, the same weights."""

    def __init__(self, hf: HFBlock):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False)
        self.self_attn.o_proj = RowParallelLinear(HEADS * HEAD, HIDDEN, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False)
        self.mlp.down_proj = RowParallelLinear(INTER, HIDDEN, bias=False)
        a, m = hf.self_attn, hf.mlp
        qkv = self.self_attn.qkv_proj
        for shard, layer in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj)):
            qkv.weight_loader(qkv.weight, layer.weight.data, shard)
        gate_up = self.mlp.gate_up_proj
        for shard, layer in ((0, m.gate_proj), (1, m.up_proj)):
            gate_up.weight_loader(gate_up.weight, layer.weight.data, shard)
        self.self_attn.o_proj.weight.data.copy_(a.o_proj.weight.data)
        self.mlp.down_proj.weight.data.copy_(m.down_proj.weight.data)


class OurModel(nn.Module):
    def __init__(self, hf: HFModel):
        super().__init__()
        self.layers = nn.ModuleList([OurBlock(hf.model.layers[0])])


# Three adapters: different ranks, alphas, targets (some slices of the fused layers left
# out), one rsLoRA.
ADAPTERS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    "poem": dict(r=8, lora_alpha=4, target_modules=["k_proj", "o_proj", "gate_proj"], use_rslora=True),
    "math": dict(r=2, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                  "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An HF model with the three adapters saved as peft folders, and our model with the
    same base weights, wrapped by the worker manager."""
    torch.manual_seed(0)
    hf = HFModel()
    paths = {}
    peft_model = None
    for name, kwargs in ADAPTERS.items():
        config = LoraConfig(init_lora_weights=False, **kwargs)   # random B: the adapter changes the output
        torch.manual_seed(len(paths) + 1)
        if peft_model is None:
            peft_model = get_peft_model(hf, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
        folder = tmp_path_factory.mktemp(f"adapter_{name}")
        peft_model.save_pretrained(folder, selected_adapters=[name])
        # save_pretrained puts a non-default adapter in a sub-folder named after it
        paths[name] = folder / name if (folder / name).is_dir() else folder
    ours = OurModel(peft_model.base_model.model)
    manager = LRUCacheWorkerLoRAManager(LoRAConfig(max_lora_rank=8, max_loras=3), max_num_batched_tokens=64,
                                        dtype=torch.float32)
    manager.create_lora_manager(ours)
    requests = {name: LoRARequest(name, i + 1, str(paths[name])) for i, name in enumerate(ADAPTERS)}
    return peft_model, ours, manager, requests


def peft_outputs(peft_model, adapter: str | None, x_attn: torch.Tensor, x_o: torch.Tensor, x_down: torch.Tensor):
    """peft's outputs of each of our fused layers (concatenated slices), under ``adapter``
    (None: the base model)."""
    block = peft_model.base_model.model.model.layers[0]
    a, m = block.self_attn, block.mlp

    def run():
        return (torch.cat([a.q_proj(x_attn), a.k_proj(x_attn), a.v_proj(x_attn)], dim=-1), a.o_proj(x_o),
                torch.cat([m.gate_proj(x_attn), m.up_proj(x_attn)], dim=-1), m.down_proj(x_down))

    if adapter is None:
        with peft_model.disable_adapter():
            return run()
    peft_model.base_model.set_adapter(adapter)
    return run()


def our_outputs(ours, x_attn, x_o, x_down):
    block = ours.layers[0]
    return (block.self_attn.qkv_proj(x_attn), block.self_attn.o_proj(x_o), block.mlp.gate_up_proj(x_attn),
            block.mlp.down_proj(x_down))


def random_inputs(num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, HIDDEN, generator=g), torch.randn(num_tokens, HEADS * HEAD, generator=g),
            torch.randn(num_tokens, INTER, generator=g))


def test_layers_are_wrapped(setup):
    _, ours, _, _ = setup
    block = ours.layers[0]
    assert isinstance(block.self_attn.qkv_proj, MergedQKVParallelLinearWithLoRA)
    assert isinstance(block.self_attn.o_proj, RowParallelLinearWithLoRA)
    assert isinstance(block.mlp.gate_up_proj, MergedColumnParallelLinearWithLoRA)
    assert isinstance(block.mlp.down_proj, RowParallelLinearWithLoRA)
    assert block.self_attn.qkv_proj.output_slices == (HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_each_layer_kind_equals_peft(setup, adapter):
    peft_model, ours, manager, requests = setup
    inputs = random_inputs(5, seed=hash(adapter) % 1000)
    lora_id = requests[adapter].lora_int_id
    manager.set_active_adapters({requests[adapter]}, LoRAMapping((lora_id,) * 5))
    with torch.no_grad():
        got = our_outputs(ours, *inputs)
        want = peft_outputs(peft_model, adapter, *inputs)
        base = peft_outputs(peft_model, None, *inputs)
    for layer, g, w, b in zip(("qkv", "o", "gate_up", "down"), got, want, base):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{layer}: {m}")
    targets = ADAPTERS[adapter]["target_modules"]
    # The adapter changed what it targets, and only that (q/k/v, gate/up slice by slice).
    q, k = HEADS * HEAD, KV_HEADS * HEAD
    slices = {"q_proj": (0, 0, q), "k_proj": (0, q, q + k), "v_proj": (0, q + k, q + 2 * k),
              "o_proj": (1, 0, HIDDEN), "gate_proj": (2, 0, INTER), "up_proj": (2, INTER, 2 * INTER),
              "down_proj": (3, 0, HIDDEN)}
    for module, (i, lo, hi) in slices.items():
        changed = not torch.allclose(got[i][:, lo:hi], base[i][:, lo:hi])
        assert changed == (module in targets), module


def test_mixed_batch_equals_per_token_loops(setup):
    """Tokens of three adapters and of none in one batch: each row equals peft's output
    for that token under its own adapter."""
    peft_model, ours, manager, requests = setup
    owners = ["sql", None, "math", "poem", "poem", None, "sql", "math", "math", "poem", "sql"]
    inputs = random_inputs(len(owners), seed=7)
    mapping = LoRAMapping(tuple(requests[o].lora_int_id if o else 0 for o in owners))
    manager.set_active_adapters({requests[o] for o in owners if o}, mapping)
    with torch.no_grad():
        got = our_outputs(ours, *inputs)
        for t, owner in enumerate(owners):
            want = peft_outputs(peft_model, owner, *(x[t:t + 1] for x in inputs))
            for g, w in zip(got, want):
                torch.testing.assert_close(g[t:t + 1], w, rtol=1e-5, atol=1e-5)
    manager.set_active_adapters(set(), None)


@settings(derandomize=True, deadline=None, max_examples=25)
@given(owners=st.lists(st.sampled_from(["sql", "poem", "math", None]), min_size=1, max_size=12),
       seed=st.integers(0, 2 ** 16))
def test_property_any_mix_equals_per_token_loops(setup, owners, seed):
    peft_model, ours, manager, requests = setup
    inputs = random_inputs(len(owners), seed=seed)
    mapping = LoRAMapping(tuple(requests[o].lora_int_id if o else 0 for o in owners))
    manager.set_active_adapters({requests[o] for o in owners if o}, mapping)
    with torch.no_grad():
        got = our_outputs(ours, *inputs)
        for t, owner in enumerate(owners):
            for g, w in zip(got, peft_outputs(peft_model, owner, *(x[t:t + 1] for x in inputs))):
                torch.testing.assert_close(g[t:t + 1], w, rtol=1e-5, atol=1e-5)


def test_slots_and_cpu_lru(setup, tmp_path):
    """Two slots, two CPU places, three adapters: the least recently used one goes."""
    peft_model, _, _, requests = setup
    ours = OurModel(peft_model.base_model.model)
    manager = LRUCacheWorkerLoRAManager(LoRAConfig(max_lora_rank=8, max_loras=2, max_cpu_loras=2), 16,
                                        torch.float32)
    manager.create_lora_manager(ours)
    a, b, c = requests["sql"], requests["poem"], requests["math"]
    manager.set_active_adapters({a, b}, LoRAMapping((1, 2)))
    assert manager.list_adapters() == {1, 2}
    manager.set_active_adapters({b}, LoRAMapping((2,)))     # b used last: a is the LRU
    manager.set_active_adapters({c}, LoRAMapping((3,)))
    assert manager.list_adapters() == {2, 3}
    assert sorted(i for i in manager.adapter_manager.lora_index_to_id if i) == [2, 3]
    # the evicted adapter comes back from disk and still computes what peft does
    inputs = random_inputs(3, seed=3)
    manager.set_active_adapters({a}, LoRAMapping((1, 1, 1)))
    with torch.no_grad():
        for g, w in zip(our_outputs(ours, *inputs), peft_outputs(peft_model, "sql", *inputs)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="max_loras"):
        manager.set_active_adapters({a, b, c}, LoRAMapping((1, 2, 3)))


def test_no_mapping_is_the_base_model(setup):
    peft_model, ours, manager, requests = setup
    manager.set_active_adapters({requests["sql"]}, None)
    inputs = random_inputs(4, seed=11)
    with torch.no_grad():
        for g, w in zip(our_outputs(ours, *inputs), peft_outputs(peft_model, None, *inputs)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_scaling(use_rslora):
    helper = PEFTHelper.from_dict({"r": 16, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": use_rslora})
    assert helper.scaling == (8 / math.sqrt(16) if use_rslora else 8 / 16)


@pytest.mark.parametrize("change, message", [
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"r": 32}, "max_lora_rank=16"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"\['lm_head'\]"),
])
def test_refusals(tmp_path, change, message):
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **change}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    helper = PEFTHelper.from_local_dir(tmp_path)
    with pytest.raises(ValueError, match=message):
        helper.validate_legal(max_lora_rank=16)


def test_not_a_peft_folder(tmp_path):
    with pytest.raises(ValueError, match="not a peft adapter folder"):
        PEFTHelper.from_local_dir(tmp_path)


def test_plain_config_is_legal():
    PEFTHelper.from_dict({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]}).validate_legal(16)
