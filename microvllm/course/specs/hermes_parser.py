"""Exercise 21: the incremental Hermes tool-call parser (``tool_parsers/hermes_tool_parser.py``):
deltas of text in, content and tool-call pieces out."""

from microvllm.course.exercise import Exercise, Part
from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

EXERCISE = Exercise(
    number="21", slug="hermes_parser", title="Agents: stream a model's tool calls out of its text",
    lecture="21 · agents: tool calls and reasoning",
    intro="""You write the streaming half of the `hermes` tool-call parser, the one `microvllm serve
--enable-auto-tool-choice --tool-call-parser hermes` runs for every streamed chat response (vLLM has a
class of the same name). The model writes its calls as text, `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, one token at a time; the server must turn that text, delta by delta, into what the
OpenAI API streams: content for the text outside the calls, and for each call a first piece (its
index, an id, its name) then fragments of its arguments' JSON text, which the client concatenates.
A tag can be cut anywhere between two deltas, so nothing that may still become a tag may be sent as
content, and nothing may be sent twice: a client cannot take a piece back.""",
    setup="""
import microvllm.tool_parsers.hermes_tool_parser
from microvllm.tool_parsers.abstract_tool_parser import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    random_tool_call_id,
)
from microvllm.tool_parsers.hermes_tool_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    CallScan,
    parse_call,
    streamable_call,
)
from microvllm.tool_parsers.streaming import split_held_back
from microvllm.checks.hermes_parser import assemble, check_hermes_parser, run_hermes_parser_with, stream
""",
    parts=(Part(Hermes2ProToolParser, methods=("parse_delta", "send_call"), intro="""Your class is the engine's
`Hermes2ProToolParser` with your `parse_delta` and `send_call`. Given (imported above):
`split_held_back(text, tag)` returns `(safe, held)`, `held` being the longest end of `text` that could
begin `tag`; a `CallScan()`, one per call, reads a call's body as it grows, each character once:
`self.scan.streamable_call(self.body)` returns what is certain of the call so far, `(name or None,
arguments text so far or None)` (`streamable_call(body)` is the same, read from the start);
`parse_call(body)` returns `(name, arguments)` of a whole call's body, or None if it is not a call;
`self.add_content(delta, text)` appends text outside every call to `delta.content`, holding back
whitespace alone between or around calls (not content, as in vLLM). The state, set in `__init__`
(given): `self.buffer` (text not handled yet), `self.in_call`, `self.body` (the current call's text
after `<tool_call>`), `self.scan` (its `CallScan`), `self.current_tool_id` (-1 before the first call),
`self.current_tool_name_sent`, `self.arguments_sent`. The server calls `extract_tool_calls_streaming`
per delta and `finish_streaming()` at the end; both call your `parse_delta`."""),),
    todos={
        "Hermes2ProToolParser.parse_delta": "append delta_text to self.buffer; loop: outside a call, find "
                                            "TOOL_CALL_START: found, add the text before it as content "
                                            "(self.add_content), drop the tag, enter the call (body '', a new "
                                            "CallScan(), name not sent, 0 arguments sent); not found, add "
                                            "split_held_back's safe part as content (everything at the end of the "
                                            "stream) and return; inside a call, find TOOL_CALL_END: not found (and "
                                            "not the end), move split_held_back's safe part into the body, "
                                            "send_call(delta, *self.scan.streamable_call(self.body)) and return; else "
                                            "end the body there (or at the end of the buffer), keep the rest in the "
                                            "buffer, send_call(delta, *parse_call(body)) if it is a call, else its "
                                            "tagged text as content if no name was sent; leave the call",
        "Hermes2ProToolParser.send_call": "return if name is None; the first time (not current_tool_name_sent): "
                                          "current_tool_id += 1, mark the name sent, append DeltaToolCall(index, "
                                          "DeltaFunctionCall(name=name), id=random_tool_call_id(), "
                                          "type='function'); then append the characters of arguments past "
                                          "self.arguments_sent as DeltaFunctionCall(arguments=...) and count them",
    },
    contract="""
`parse_delta(delta_text, *, end_of_stream=False) -> DeltaMessage` and `send_call(delta, name, arguments)`

    deltas      "Sure<t"     "ool_c"     'all>\\n{"name": "f", "argu'   'ments": {"a": '     '1}}\\n</tool_call> ok'
    content     "Sure"       -           -                               -                    " ok"
    tool_calls  -            -           (0, name "f", id, "function")   (0, '{"a": ')        (0, '1}')

- **Content**: text outside every call, sent in the step that makes it certain: everything in the
  buffer except its longest end that could begin `<tool_call>` (`split_held_back`); that end waits
  for the next delta. At the end of the stream (`end_of_stream=True`) nothing waits: held text is content.
  Add it with `self.add_content(delta, text)` (given), which keeps whitespace alone between or around
  calls out of the content (a client would show the newline between two calls as a message).
- **A call** starts at `<tool_call>` and ends at `</tool_call>` (held back the same way while split).
  Its **first piece**, once its name is known (`self.scan.streamable_call`): `DeltaToolCall(index,
  DeltaFunctionCall(name=...), id=random_tool_call_id(), type="function")`, the index counting the
  message's calls from 0 (`self.current_tool_id`). Then **argument fragments**, `DeltaToolCall(index,
  DeltaFunctionCall(arguments=...))`: the characters of the arguments' JSON text not sent before,
  while they are written (`self.scan.streamable_call`) and at the close (`parse_call`). Concatenated, they are the
  arguments exactly as the model wrote them, each character once.
- **At the close** (`</tool_call>`, or the end of the stream with a call open): `parse_call(body)`; a
  call sends what is left of it; a body that is not a call (not JSON, no name) is text: content,
  with its tags (`<tool_call>` + body + `</tool_call>` if it was closed), unless its name was already sent.
  Then go on with the rest of the buffer in the same step: more text, or another call.
- The pieces of each delta must equal the package's (ids aside): the contract fixes what is certain
  after every delta. Whatever the cuts, the concatenated deltas give the whole-message parse
  (`extract_tool_calls`, given).
""",
    hints=(
        """Draw the two states, *outside* and *inside* a call, and what moves you between them. In each
state, what do you look for in `self.buffer`, and what happens when it is not there yet? Why can
`"Sure<t"` not be sent whole, and what does `split_held_back("Sure<t", TOOL_CALL_START)` return? Why
must the step be a loop rather than one `if`: what can one delta hold?""",
        """`send_call` is called with what is known of the call *now*: `(None, None)`, then `("f",
None)`, then `("f", '{"a": ')`, then `("f", '{"a": 1}')`. Which state tells you whether the first
piece went out, and what tells you which characters of `arguments` the client already has? What must
be reset when the next `<tool_call>` opens? At `end_of_stream`, which of the two states needs more
than "send what is held back"?""",
        """Before you run this, predict every delta's output:
```python
# Test case: paste it into a new cell and run it (it uses your class above)
outs = stream(Hermes2ProToolParser, ["Sure<t", 'ool_call>{"name": "f", "argu', 'ments": {"a": 1}}</tool_ca',
                                     "ll> ok <to"])
for out in outs:
    print(out)
assert assemble(outs) == ("Sure ok <to", [("f", '{"a": 1}')]), assemble(outs)
```""",
    ),
    checks=("result = check_hermes_parser(Hermes2ProToolParser)",),
    engine_intro="""`run_hermes_parser_with(Hermes2ProToolParser)` writes a tiny random Llama to a temporary
folder and serves it from this process twice, on two ports of 127.0.0.1, with `--reasoning-parser
qwen3` and `--enable-auto-tool-choice`: once with `--tool-call-parser hermes` (the package's) and once
with your class, registered as `hermes-yours` the way a `--tool-parser-plugin` file registers one. The
tiny model cannot decide to call a tool, so each request makes it write a fixed message through
structured outputs (a regex of the text): reasoning, a call with an escaped quote in its arguments,
two calls with text after them, a call left open at the end, text that only looks like tags. Its
tokenizer cuts the tags into pieces of one or two characters, so every tag arrives split over several
deltas. Each stream goes through the openai client, and every chunk (reasoning, content, tool-call
pieces, finish reason; ids only as "has one") must be the same with your parser as with the
package's. Three rules the run cannot see, and it says so (a delta that closes a call and holds
text after it, a delta that holds text and then `<tool_call>`, a call whose name streamed before its
JSON broke): the cell runs those cases on your class directly. It takes about 15 seconds.""",
    engine="run_hermes_parser_with(Hermes2ProToolParser)",
)
