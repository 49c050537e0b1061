"""Tokenizer: the same ids as Hugging Face, the right eos ids, and clear errors."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from microvllm.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Héllo wörld, café crème brûlée",
    "日本語のテキストです。中文也可以。",
    "Emoji 🙂🚀👍🏽 family 👨‍👩‍👧",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_hf(smol_path):
    return AutoTokenizer.from_pretrained(smol_path, local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(any_tokenizer, text):
    ids = any_tokenizer.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert any_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hugging_face(smol_tokenizer, smol_hf, text):
    assert smol_tokenizer.encode(text) == smol_hf(text).input_ids
    assert smol_tokenizer.encode(text, add_special_tokens=False) == smol_hf(
        text, add_special_tokens=False).input_ids


def test_smollm2_adds_no_bos(smol_tokenizer):
    # SmolLM2's post-processor adds nothing; a Llama-2/3 tokenizer would add a BOS.
    assert smol_tokenizer.encode("Hello world") == [19556, 905]


def test_chat_template_ids_equal_hugging_face(smol_tokenizer, smol_hf):
    expected = smol_hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    ids = smol_tokenizer.apply_chat_template(CHAT)
    assert ids == list(expected)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    # The text the template renders tokenizes to the same ids.
    text = smol_tokenizer.render_chat_template(CHAT)
    assert text.endswith("<|im_start|>assistant\n")
    assert smol_tokenizer.encode(text, add_special_tokens=False) == ids


def test_chat_template_without_generation_prompt(smol_tokenizer):
    with_prompt = smol_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    without = smol_tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert with_prompt[:len(without)] == without
    assert smol_tokenizer.decode(with_prompt[len(without):], skip_special_tokens=False) == \
        "<|im_start|>assistant\n"


def test_tiny_chat_template(tiny_tokenizer):
    text = tiny_tokenizer.render_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and 2 in ids  # <|im_start|> and <|im_end|> are single tokens


def test_smollm2_eos_and_vocab(smol_tokenizer):
    assert smol_tokenizer.eos_token_ids == {2}
    assert smol_tokenizer.eos_token_id == 2
    assert smol_tokenizer.vocab_size == 49152
    assert smol_tokenizer.convert_ids_to_tokens([19556, 905, 2]) == ["Hello", "Ġworld", "<|im_end|>"]
    assert smol_tokenizer.hf_tokenizer.eos_token == "<|im_end|>"


def test_decode_skip_special_tokens(smol_tokenizer):
    ids = smol_tokenizer.encode("Hi") + [2]
    assert smol_tokenizer.decode(ids) == "Hi"
    assert smol_tokenizer.decode(ids, skip_special_tokens=False) == "Hi<|im_end|>"


@pytest.mark.parametrize("eos_in_generation_config, expected", [
    (2, {2}),
    ([0, 2], {0, 2}),
    ([7], {2, 7}),  # the tokenizer's own eos (2) always counts too
])
def test_eos_ids_union_generation_config(tiny_path, tmp_path, eos_in_generation_config, expected):
    folder = tmp_path / "model"
    shutil.copytree(tiny_path, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_in_generation_config}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == expected


def test_eos_ids_from_config_json_without_generation_config(tiny_path, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_path, folder)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [0]}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == {0, 2}


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        Tokenizer.from_pretrained(missing)


def test_folder_without_tokenizer_files_is_named(tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer files in .*weights-only"):
        Tokenizer.from_pretrained(folder)


def test_no_chat_template_says_so(tiny_path, tmp_path):
    folder = tmp_path / "base-model"
    shutil.copytree(tiny_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.encode("Hi")  # plain text still works
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CHAT)
