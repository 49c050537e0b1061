"""Notebook 02's picture of one decoder layer: every module of the layer, with the model's shapes."""

import pytest

from microvllm.attention.selector import get_attention_backend
from microvllm.models import loader
from microvllm.models.tiny import make_tiny_model
from microvllm.viz import plot_decoder_layer
from microvllm.viz.decoder_layer import decoder_layer_steps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_picture_names_every_module_with_the_models_shapes(tmp_path, arch):
    model, _ = loader.load_model(make_tiny_model(tmp_path / arch, arch), get_attention_backend("torch"))
    layer = model.layers[0]
    steps = decoder_layer_steps(model)
    names = [name for name, _, _ in steps]
    for name in names:   # each box is a real module of the layer
        module = getattr(layer, name, None) or getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
        assert module is not None
    shapes = dict((name, shape) for name, _, shape in steps)
    attn = layer.self_attn
    assert shapes["qkv_proj"].endswith(f"= {attn.qkv_proj.out_features}]")
    assert shapes["gate_up_proj"].endswith(f"= {layer.mlp.gate_up_proj.out_features}]")
    assert shapes["down_proj"] == f"[T, {layer.mlp.down_proj.out_features}]"
    fig = plot_decoder_layer(model)
    gids = {patch.get_gid() for patch in fig.axes[0].patches}
    assert {f"decoder-layer-{name}" for name in names} <= gids
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert all(shape in texts for shape in shapes.values())
