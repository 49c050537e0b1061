"""int8 weight-only quantization of a float checkpoint (layers/quantization/int8.py)."""

import pytest
import torch

from microvllm import LLM, SamplingParams
from microvllm.layers.quantization.int8 import Int8LinearMethod, dequantize_int8, quantize_int8_per_row
from microvllm.models.tiny import make_tiny_model
from microvllm.platforms.cpu import decode_fast_path

PROMPTS = [[5, 9, 33, 71], [300, 12], [7, 7, 7, 7, 7, 7, 200, 41, 90], [450]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama", seed=3, tie_word_embeddings=True)


def tokens(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_per_row_scales_bound_the_error():
    w = torch.randn(6, 50) * torch.tensor([1e-3, 1e-1, 1, 10, 100, 0.0])[:, None]
    q, scales = quantize_int8_per_row(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.shape == (6,)
    assert scales[-1] == 1   # an all-zero row gets a harmless scale
    error = (dequantize_int8(q, scales) - w).abs()
    assert (error <= scales[:, None] / 2 + 1e-12).all()   # half a step of each row's own scale
    assert (q.abs().amax(dim=1)[:-1] == 127).all()        # each row's largest weight uses the range


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["torch", "platform"])
def test_int8_model_stores_int8_and_stays_close_to_float(tiny_folder, enforce_eager):
    llm = LLM(model=str(tiny_folder), quantization="int8", enforce_eager=enforce_eager)
    model = llm.engine.executor.worker.model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down.quant_method, Int8LinearMethod) and down.weight.dtype == torch.int8
    assert down.weight_scale.shape == (down.out_features,)
    assert model.lm_head.weight is model.embed_tokens.weight   # still tied, quantized once
    assert down.implementation == ("native" if enforce_eager else "QuantizedLinear")
    fast_path = llm.engine.executor.worker.model_runner.decode_step_runner
    if not enforce_eager and decode_fast_path.unsupported_reason(model) is None:
        assert fast_path is not None and fast_path.kind == "int8_linear_pair"   # decode steps in one C call
    # Each prompt's first token (its prefill's logits) is the float model's; later tokens
    # may part ways (a random tiny model has near-ties; notebook 16 measures the real one).
    float_tokens = tokens(LLM(model=str(tiny_folder), enforce_eager=enforce_eager))
    assert [t[0] for t in tokens(llm)] == [t[0] for t in float_tokens]


def test_both_paths_compute_the_same_int8_model(tiny_folder):
    eager = tokens(LLM(model=str(tiny_folder), quantization="int8", enforce_eager=True))
    assert tokens(LLM(model=str(tiny_folder), quantization="int8")) == eager


def test_int8_with_tensor_parallelism_is_refused(tiny_folder):
    with pytest.raises(ValueError, match="use tensor_parallel_size=1"):
        LLM(model=str(tiny_folder), quantization="int8", tensor_parallel_size=2)
