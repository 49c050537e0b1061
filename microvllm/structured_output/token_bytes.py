"""What each token adds to the output, in bytes: the alphabet of a grammar over bytes.

A token's *text* is not enough: a byte-level BPE has tokens for pieces of characters,
and decoding one alone gives U+FFFD. Its *spelling* in the vocabulary keeps every byte::

    token id   spelling (vocab.json)   bytes          decode([id]) alone
    10813      'ðŁ'                   F0 9F          '\\ufffd'   (the start of 😀 or 🙂)
    242        'ĺ'                    98             '\\ufffd'
    13536      'Ġsmile'               20 73 6D ...   ' smile'   (Ġ = the space byte)

GPT-2's byte-level BPE (also Llama 3, SmolLM2, Qwen) writes each of the 256 bytes as
one printable character (``bytes_to_unicode``): the printable Latin-1 bytes as
themselves, the 68 others as U+0100, U+0101, ... in order. Reading a spelling back
through that table gives the token's exact bytes. A SentencePiece vocabulary names its
byte tokens ``<0xF0>``; any other token is taken as its decoded text.
"""

from __future__ import annotations

from collections.abc import Callable


def _byte_level_alphabet() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: spelling character -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(0x100 + i): byte for i, byte in enumerate(others)}}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def token_bytes_reader(hf) -> Callable[[int], bytes | None]:
    """``read(token_id) -> bytes | None`` for a Hugging Face tokenizer ``hf``: the token's
    bytes, or None when there is nothing to go on (a token that is neither spelled in
    the byte alphabet nor a byte token, and whose decoded text is not whole characters)."""
    decoder = getattr(getattr(hf, "backend_tokenizer", None), "decoder", None)
    byte_level = "ByteLevel" in repr(decoder)   # ByteLevel(...), or inside Sequence([...])

    def read(token_id: int) -> bytes | None:
        spelling = hf.convert_ids_to_tokens(token_id)
        if not isinstance(spelling, str):
            return None
        if byte_level and all(ch in BYTE_LEVEL_ALPHABET for ch in spelling):
            return bytes(BYTE_LEVEL_ALPHABET[ch] for ch in spelling)
        if len(spelling) == 6 and spelling.startswith("<0x") and spelling.endswith(">"):
            return bytes([int(spelling[3:5], 16)])
        text = hf.decode([token_id], skip_special_tokens=False)   # an added token spelled as plain text
        return text.encode() if "\ufffd" not in text else None

    return read


def is_text(data: bytes) -> bool:
    """Whether ``data`` is whole characters (valid UTF-8)."""
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False
