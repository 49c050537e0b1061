"""Exercise 01: the incremental detokenizer."""

from microvllm.course.exercise import Exercise, Part
from microvllm.detokenizer import IncrementalDetokenizer, find_stop_string

EXERCISE = Exercise(
    number="01", slug="detokenizer", title="The incremental detokenizer",
    lecture="01 · the tokenizer path",
    intro="""You write the part of the engine that turns a stream of token ids into a stream of
text: `IncrementalDetokenizer._decode_next` (the sliding decode window), `_flush` (the same window
when the request ends) and `find_stop_string` (stop strings that may straddle two steps).""",
    setup="""
from microvllm.detokenizer import REPLACEMENT_CHAR
from microvllm.checks import check_detokenizer, check_find_stop_string, run_engine_with
""",
    parts=(Part(IncrementalDetokenizer, intro="""The whole class is here so that its `update()` calls
*your* `find_stop_string`. Write `_decode_next` and `_flush` (the same window at the end of the
request); the rest is the engine's code, to read."""),
           Part(find_stop_string)),
    todos={
        "IncrementalDetokenizer._decode_next":
            "decode tokens[prefix_offset:read_offset] and tokens[prefix_offset:], return the new part "
            "(or '' while it ends in REPLACEMENT_CHAR) and move both offsets",
        "IncrementalDetokenizer._flush":
            "the text the window still holds back, even if it ends in REPLACEMENT_CHAR (the request ends); "
            "move both offsets",
        "find_stop_string":
            "return (stop string, start index) of the earliest stop string ending in the new text, or None",
    },
    contract="""
`_decode_next()` is called once per new token (already appended to `self.output_token_ids`):

- decode the window `tokens[prefix_offset:read_offset]` (text already emitted, re-decoded as
  context) and `tokens[prefix_offset:]` (the same plus the unread tokens);
- if the second text is not longer, or ends in `REPLACEMENT_CHAR` ("�", half a UTF-8
  character): return `""` and leave both offsets alone, so the next call decodes these tokens
  again together with the next one;
- otherwise return the new part, `new_text[len(prefix_text):]`, and move the window:
  `prefix_offset, read_offset = read_offset, len(tokens)`.

`_flush()` is called once, when the request ends: it returns the text the window still holds
back (`new_text[len(prefix_text):]`), even if it ends in `REPLACEMENT_CHAR` (the model produced bytes
that are not valid UTF-8, and no later token will complete them), and moves the window like
`_decode_next`.

The returned pieces must add up exactly to `tokenizer.decode(output_token_ids)`, and each call
may decode only a short window (O(new tokens), never the whole output).

`find_stop_string(output_text, new_char_count, stop)` returns `(stop_string, index)` for the stop
string that starts earliest among those *ending* in the last `new_char_count` characters, or
`None`. Older text was searched on earlier steps; a stop string may straddle old and new text.
""",
    hints=(
        """Read the table in the module docstring (`import microvllm.detokenizer;
print(microvllm.detokenizer.__doc__)`): "Hello wörld" fed one token at a time, with both offsets
after each step. `prefix_text` is the window up to `read_offset`, `new_text` the whole window.""",
        """The incomplete character shows up as a trailing `"\\ufffd"` (`REPLACEMENT_CHAR`) in
`new_text`. A token that decodes to nothing (a skipped special token) gives
`len(new_text) <= len(prefix_text)`: treat it the same way. `_flush` is the same window once
more, at the end: nothing can complete a half character any more. For `find_stop_string`: a stop
string that *ends* in the new text starts at most `len(stop_string) - 1` characters before it.""",
        """Before you run this, predict each `update()`'s text and the offsets after it. Why is the
second delta empty while the offsets stay at `(0, 1)`? With one new character in `"abcd"`, why is the answer
`"cd"`, not `"bc"` (nor `"d"`)?
```python
# Test case: paste it into a new cell and run it (it uses your class and function above)
from microvllm.checks.detokenizer import tiny_tokenizer
tok = tiny_tokenizer()   # "wö" is 3 tokens here: "w", then the two bytes of "ö" (130, 117)
detok = IncrementalDetokenizer(tok, [])
steps = [(detok.update([token_id]), detok.prefix_offset, detok.read_offset) for token_id in [89, 130, 117]]
assert steps == [("w", 0, 1), ("", 0, 1), ("ö", 1, 3)], steps
ends_early = IncrementalDetokenizer(tok, [])
assert ends_early.update([130], finished=True) == "\\ufffd"   # half an "ö", and the request ends
assert find_stop_string("The capital is Paris", 3, ["Paris", "is"]) == ("Paris", 15)
assert find_stop_string("abcd", 1, ["bc", "cd", "d"]) == ("cd", 2)
```""",
    ),
    checks=("check_detokenizer(IncrementalDetokenizer)", "check_find_stop_string(find_stop_string)"),
    engine_intro="""The engine makes one `IncrementalDetokenizer` per request. Passing your class as
`components={"detokenizer": ...}` makes the engine stream its text through your code. The tokens,
the final text and the text shown after every step must equal the reference engine's. What the tiny
model writes exercises every rule: two seeded prompts generate characters split over two tokens (and
bytes that are invalid for good, between them); one stop string straddles three tokens; another
prompt has `min_tokens` and a stop string that ends just where the first `min_tokens` tokens end.""",
    engine='run_engine_with({"detokenizer": IncrementalDetokenizer}, compare_text=True)',
)
