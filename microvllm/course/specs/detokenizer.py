"""Exercise 01: the incremental detokenizer."""

from microvllm.course.exercise import Exercise, Part
from microvllm.detokenizer import IncrementalDetokenizer, find_stop_string

EXERCISE = Exercise(
    number="01", slug="detokenizer", title="The incremental detokenizer",
    lecture="01 · the tokenizer path",
    intro="""You write the part of the engine that turns a stream of token ids into a stream of
text: `IncrementalDetokenizer._decode_next` (the sliding decode window) and `find_stop_string`
(stop strings that may straddle two steps).""",
    setup="""
from microvllm.detokenizer import REPLACEMENT_CHAR
from microvllm.checks import check_detokenizer, check_find_stop_string, run_engine_with
""",
    parts=(Part(IncrementalDetokenizer, intro="""The whole class is here so that its `update()` calls
*your* `find_stop_string`. Write `_decode_next`; the rest is the engine's code, to read."""),
           Part(find_stop_string)),
    todos={
        "IncrementalDetokenizer._decode_next":
            "decode tokens[prefix_offset:read_offset] and tokens[prefix_offset:], return the new part "
            "(or '' while it ends in REPLACEMENT_CHAR) and move both offsets",
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

The returned pieces must add up exactly to `tokenizer.decode(output_token_ids)`, and each call
may decode only a short window (O(new tokens), never the whole output).

`find_stop_string(output_text, new_char_count, stop)` returns `(stop_string, index)` for the stop
string that starts earliest among those *ending* in the last `new_char_count` characters, or
`None`. Older text was searched on earlier steps; a stop string may straddle old and new text.
""",
    hints=(
        """Read the table in the module docstring (`import microvllm.detokenizer;
print(microvllm.detokenizer.__doc__)`): "Hello wörld" fed one token at a time, with both offsets
after each step.""",
        """The incomplete character shows up as a trailing `"\\ufffd"` (`REPLACEMENT_CHAR`) in
`new_text`. A token that decodes to nothing (a skipped special token) gives
`len(new_text) <= len(prefix_text)`: treat it the same way.""",
        """```python
tokens = self.output_token_ids
prefix_text = self._decode(tokens[self.prefix_offset:self.read_offset])
new_text = self._decode(tokens[self.prefix_offset:])
# return "" when nothing is complete yet; else move the offsets and return the tail
```
For `find_stop_string`: start each search at `max(0, len(output_text) - new_char_count - len(stop_string) + 1)`
with `output_text.find(stop_string, start)`, and keep the smallest index.""",
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
