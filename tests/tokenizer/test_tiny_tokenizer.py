"""The tiny byte-level tokenizer for tiny test models."""

import pytest
from transformers import AutoTokenizer

from microvllm.models.tiny_tokenizer import build_tiny_tokenizer


def test_build_is_deterministic(tiny_path, tmp_path):
    build_tiny_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_path / name).read_bytes()


def test_loads_with_transformers(tiny_path):
    hf = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    assert len(hf) == 512
    assert hf.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert hf.eos_token_id == 2
    assert hf.encode("Hello") == hf.encode("Hello", add_special_tokens=False)  # no BOS


def test_our_tokenizer_sees_it(tiny_tokenizer):
    assert tiny_tokenizer.vocab_size == 512
    assert tiny_tokenizer.eos_token_ids == {2}


@pytest.mark.parametrize("text", ["plain ascii", "Ünïcödé ✓", "中文 日本語 한국어", "🙂👨‍👩‍👧", "\x00\x7f"])
def test_any_unicode_round_trips(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    assert 0 not in ids  # nothing is unknown in byte-level BPE
    assert tiny_tokenizer.decode(ids) == text


def test_learned_merges_compress_english(tiny_tokenizer):
    text = "The capital of France is Paris."
    assert len(tiny_tokenizer.encode(text)) < len(text.encode()) / 2


def test_other_vocab_size(tmp_path):
    build_tiny_tokenizer(tmp_path, vocab_size=300)
    assert len(AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)) == 300


def test_too_small_vocab_says_minimum(tmp_path):
    with pytest.raises(ValueError, match="at least 259"):
        build_tiny_tokenizer(tmp_path, vocab_size=100)
