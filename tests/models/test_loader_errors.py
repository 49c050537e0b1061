"""Bad model folders fail early with an error that names the file and what is wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from microvllm.attention import get_attention_backend
from microvllm.models.loader import load_model
from microvllm.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("good"), "llama", tokenizer=False)


@pytest.fixture
def bad(good, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(good, folder)
    return folder


def load(folder):
    return load_model(folder, get_attention_backend("torch"))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nope")


def test_missing_config(bad):
    (bad / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load(bad)


def test_unsupported_architecture(bad):
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: architectures=\['GPT2LMHeadModel'\] is not supported"):
        load(bad)


def rewrite(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_missing_tensor(bad):
    rewrite(bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors for \['layers.1.mlp.gate_up_proj.weight'\]"):
        load(bad)


def test_wrong_shape(bad):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    path = rewrite(bad, edit)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' "
                                         r"has shape \(3, 64\)") as e:
        load(bad)
    assert str(path) in str(e.value)


def test_extra_tensor(bad):
    def edit(t):
        t["model.layers.0.self_attn.rogue.weight"] = torch.zeros(2)
    rewrite(bad, edit)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.rogue.weight'"):
        load(bad)


def test_truncated_file(bad):
    path = bad / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt|not a readable safetensors"):
        load(bad)


def test_pickle_only_checkpoint_is_refused(bad):
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are never loaded"):
        load(bad)


def test_unknown_dtype(good):
    with pytest.raises(ValueError, match="dtype='float64' is not supported"):
        load_model(good, get_attention_backend("torch"), dtype="float64")
