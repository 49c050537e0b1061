"""Holding back what may be the start of a tag: the one idea every streaming parser needs.

A stream arrives in pieces cut wherever the tokenizer cut it, so a tag can be split:

    deltas      "Sure<to"      "ol_ca"      "ll>\\n{"
    text so far "Sure<to"      "Sure<tool_ca"  "Sure<tool_call>\\n{"
    safe to send "Sure"        (nothing new)   the tag is whole: a tool call starts

"<to" could be the start of "<tool_call>" or of "<total>": until the next piece says which,
it must not be sent as content. ``split_held_back`` finds the longest end of the text that
is a beginning of the tag and keeps it back; the rest is safe.
"""

from __future__ import annotations


def partial_tag_length(text: str, tag: str, start: int = 0) -> int:
    """The length of the longest end of ``text[start:]`` that is a beginning of ``tag`` (but
    not the whole tag: a whole tag is found with ``str.find``). It reads at most the last
    ``len(tag) - 1`` characters, however long the text."""
    for length in range(min(len(text) - start, len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def split_held_back(text: str, tag: str) -> tuple[str, str]:
    """``text`` as (safe to send now, held back: a possible start of ``tag``)."""
    keep = partial_tag_length(text, tag)
    return (text[:len(text) - keep], text[len(text) - keep:]) if keep else (text, "")
