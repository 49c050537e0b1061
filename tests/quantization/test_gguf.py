"""GGUF files run in their own formats (layers/quantization/gguf.py, models/gguf_loader.py).

Tiny Llama models are written as GGUF files here, with the ``gguf`` package (offline), in
Q4_1 and Q8_0; each run natively must give the greedy tokens of the same file expanded to
float32 by transformers (both compute with the same dequantized values), on the plain torch
path and on the CPU platform's kernels, and those of transformers running the file."""

import numpy as np
import pytest
import torch

from microvllm import LLM, SamplingParams
from microvllm.layers.quantization.gguf import GGUFLinearMethod, dequantize
from microvllm.models.default_model import convert_gguf
from microvllm.models.tiny import make_tiny_model
from microvllm.models.tiny_gguf import write_gguf
from microvllm.platforms.cpu import decode_fast_path

PROMPTS = [[5, 9, 33, 71], [300, 12], [7, 7, 7, 7, 7, 7, 200, 41, 90], [450]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def gguf_files(tiny_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {kind: write_gguf(tiny_folder, root / f"tiny-{kind}.gguf", weight_type=kind)
            for kind in ("Q4_1", "Q8_0", "F16")}


def tokens(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "F16"])
def test_torch_dequantization_equals_the_gguf_package(kind):
    """Our torch dequantization gives exactly the floats of gguf's numpy reference (what
    transformers expands a file to)."""
    import gguf

    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((48, 96)) * 0.1).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    stored = weights.astype(np.float16) if kind == "F16" else gguf.quants.quantize(weights, qtype)
    expected = gguf.quants.dequantize(stored, qtype) if kind != "F16" else stored.astype(np.float32)
    rows = torch.from_numpy(np.ascontiguousarray(stored)).view(torch.uint8).reshape(48, -1)
    ours = dequantize(rows, kind, 96)
    assert torch.equal(ours, torch.from_numpy(expected.reshape(48, 96)))
    if kind != "F16":   # and the format is lossy, but close
        assert 0 < (ours - torch.from_numpy(weights)).abs().max() < 0.1


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["torch", "platform"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "F16"])
def test_native_gguf_matches_its_float_expansion(gguf_files, tmp_path, kind, enforce_eager):
    file = gguf_files[kind]
    native = LLM(model=str(file), enforce_eager=enforce_eager)
    model = native.engine.executor.worker.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, GGUFLinearMethod) and qkv.weight.dtype == torch.uint8
    assert qkv.weight.shape == (128, 64 // 32 * {"Q4_1": 20, "Q8_0": 34, "F16": 64}[kind])   # the file's bytes
    assert model.embed_tokens.weight_type == "Q8_0"
    # F16 has no kernel of its own: dequantized in torch on both paths
    assert qkv.implementation == ("native" if enforce_eager or kind == "F16" else "QuantizedLinear")
    fast_path = native.engine.executor.worker.model_runner.decode_step_runner
    if not enforce_eager and kind != "F16" and decode_fast_path.unsupported_reason(model) is None:
        assert fast_path is not None and fast_path.kind == f"{kind.lower()}_linear"   # decode steps in one C call
    got = tokens(native)
    convert_gguf(file, tmp_path / "expanded")   # transformers: the file dequantized to float32
    expected = tokens(LLM(model=str(tmp_path / "expanded"), enforce_eager=enforce_eager))
    assert got == expected


def test_native_gguf_matches_transformers_on_the_file(gguf_files):
    from transformers import AutoModelForCausalLM

    file = gguf_files["Q4_1"]
    hf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              min_new_tokens=12, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    assert tokens(LLM(model=str(file))) == expected


def test_tokenizer_and_config_come_from_the_file(gguf_files, tiny_folder):
    llm = LLM(model=str(gguf_files["Q4_1"]), enforce_eager=True)
    reference = LLM(model=str(tiny_folder), enforce_eager=True)
    text = "the model reads the cache"
    assert llm.get_tokenizer().encode(text) == reference.get_tokenizer().encode(text)
    assert llm.engine.executor.worker.hf_config.num_key_value_heads == 2


def test_no_float_copy_of_the_quantized_weights(gguf_files):
    model = LLM(model=str(gguf_files["Q4_1"])).engine.executor.worker.model
    floats = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_floating_point())
    stored = sum(p.numel() for p in model.parameters() if not p.is_floating_point())
    assert floats == sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert stored > 0


def test_unsupported_tensor_type_says_what_to_do(tiny_folder, tmp_path):
    file = write_gguf(tiny_folder, tmp_path / "q5.gguf", weight_type="Q5_0")
    with pytest.raises(ValueError, match=r"stored as Q5_0.*Q4_1, Q8_0.*llama-quantize"):
        LLM(model=str(file))


@pytest.mark.parametrize("option,match", [
    ("awq", r"quantization='awq' is not supported: choose one of \['gguf', 'int8'\]"),
    ("int8", r"a GGUF file keeps its own formats"),
])
def test_quantization_option_is_checked_against_the_model(gguf_files, option, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(gguf_files["Q4_1"]), quantization=option)


def test_gguf_quantization_needs_a_gguf_file(tiny_folder):
    with pytest.raises(ValueError, match="needs a .gguf file"):
        LLM(model=str(tiny_folder), quantization="gguf")


def test_bfloat16_activations_run_the_torch_path(gguf_files):
    llm = LLM(model=str(gguf_files["Q4_1"]), dtype="bfloat16")
    runner = llm.engine.executor.worker.model_runner
    assert runner.decode_step_runner is None   # the fast path's Q4_1 kernel takes float32 activations
    assert all(len(t) == 12 for t in tokens(llm))


def test_the_index_knows_the_ggml_types_as_the_gguf_package_does():
    import gguf

    from microvllm.models.gguf_file import GGML_TYPES

    for kind, (name, block, size) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(kind)
        assert (qtype.name, (block, size)) == (name, gguf.GGML_QUANT_SIZES[qtype])


def test_the_index_reads_what_the_gguf_reader_reads(gguf_files):
    import gguf

    from microvllm.models.gguf_file import GGUFIndex

    index, reader = GGUFIndex(gguf_files["Q4_1"]), gguf.GGUFReader(str(gguf_files["Q4_1"]))
    assert index.fields["general.architecture"] == "llama"
    assert index.fields["llama.attention.head_count_kv"] == 2
    assert [(t.name, t.type_name, t.shape) for t in index.tensors] == \
        [(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert np.array_equal(ours.data, theirs.data)
    index.close()


def test_a_fused_layer_of_mixed_types_loads_as_float32(tiny_folder, tmp_path):
    """q and v in Q4_1, k in Q8_0 (llama.cpp's mixed quantizations do such things): qkv_proj is
    one matrix here, so it is loaded as float32; the rest keeps its formats."""
    file = write_gguf(tiny_folder, tmp_path / "mixed.gguf", types={"attn_k": "Q8_0"})
    llm = LLM(model=str(file))
    model = llm.engine.executor.worker.model
    assert model.layers[0].self_attn.qkv_proj.quant_method is None
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert model.layers[0].mlp.down_proj.weight_type == "Q4_1"
    convert_gguf(file, tmp_path / "expanded")
    assert tokens(llm) == tokens(LLM(model=str(tmp_path / "expanded")))
