"""Checks for exercise 21: the incremental Hermes tool-call parser
(``tool_parsers/hermes_tool_parser.py``: ``parse_delta`` and ``send_call``)::

    deltas in          "Sure<t"    "ool_c"    'all>{"name": "f", "arguments": {"a"'    ': 1}}</tool_call>'
    what comes out     "Sure"      (nothing)  call 0: name "f" (id, type); '{"a"'       arguments ': 1}'

Every hand case feeds one message, cut into deltas at chosen places, to your class through
its public methods (``extract_tool_calls_streaming`` per delta, then ``finish_streaming``)
and compares **each delta's** output with the package's parser (ids aside: they are
random): the contract fixes what is certain after every delta, so the answer is exact.
Before that, each output is checked on its own (a call's first piece has its index, the
next one, an id and type "function"; its name never comes again). When they differ,
``_diagnose`` looks for the usual mistakes' traces (a piece of a tag sent as content, a
call's arguments sent twice, the second call merged into the first, the first piece sent
again, the same pieces later than they could go) before the case's own hint. The cases
come one rule at a time, so that the first one that fails names one mistake; the
property, last, cuts random messages at random places and compares the concatenated
pieces with the whole-message parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    not_implemented_message,
    property_settings,
    run_checks,
    run_property,
)
from microvllm.tool_parsers.hermes_tool_parser import TOOL_CALL_END, TOOL_CALL_START

HINT_HELD_BACK = ("a piece of <tool_call> split across deltas was sent as content: outside a call, send only what "
                  "cannot be the beginning of the tag, safe, held = split_held_back(self.buffer, TOOL_CALL_START), "
                  "and keep the held-back end in self.buffer until the next delta says whether it is a tag")
HINT_END_TAG = ("the end tag split across deltas was not found: inside a call, move only what cannot begin "
                "</tool_call> into self.body (split_held_back(self.buffer, TOOL_CALL_END)) and keep the rest in "
                "self.buffer, so that '</to' + 'ol_call>' meet there and close the call")
HINT_TWICE = ("arguments emitted twice: the client concatenates every fragment, so send only the characters not "
              "sent before, arguments[self.arguments_sent:], and add their number to self.arguments_sent (also at "
              "the close: what streamed before is not sent again)")
HINT_TWO_CALLS = ("the second call was merged into the first (or lost): each <tool_call> starts a new call, so on "
                  "entering one reset its state (self.body = '', self.scan = CallScan(), "
                  "self.current_tool_name_sent = False, self.arguments_sent = 0); send_call then gives it the "
                  "next index")
HINT_NAME_ONCE = ("a call's first piece (its name, a new index and id) went out more than once: send it once per call, "
                  "when the name is first known, and set self.current_tool_name_sent = True")
HINT_INDEX = ("call indices count the calls of the message from 0: self.current_tool_id starts at -1 and goes up by "
              "one when a call's first piece is sent (every later piece of that call carries the same index)")
HINT_FIRST_PIECE = ("a call's first piece carries its name, an id and type 'function': DeltaToolCall(index, "
                    "DeltaFunctionCall(name=name), id=random_tool_call_id(), type='function'); its later pieces only "
                    "DeltaFunctionCall(arguments=...) with the same index")
HINT_AFTER = ("the text after a call is content: on </tool_call>, keep what follows it in self.buffer "
              "(self.buffer = self.buffer[end + len(TOOL_CALL_END):]) and go on reading it outside the call")
HINT_LOOP = ("the same pieces came, but a delta later than they could: after a call closes, go on with the rest of "
             "the buffer in the same step (loop: more text or another call may follow in the same delta)")
HINT_SOON = ("send what is certain in the step that makes it certain: content that cannot begin <tool_call>, and "
             "inside a call what self.scan.streamable_call(self.body) knows (send_call in every step, not only at "
             "the close)")
HINT_UNCLOSED = ("at the end of the stream (end_of_stream=True) a call left open closes as it is: add what is held "
                 "back to its body and parse it as at </tool_call> (a call if parse_call finds one, else its text, "
                 "<tool_call> included, is content)")
HINT_END_HELD = ("at the end of the stream (end_of_stream=True) nothing may stay held back: text kept because it "
                 "could begin <tool_call> was not a tag after all, so it is content")
HINT_NOT_JSON = ("a call whose body parse_call rejects (not JSON, no name) is text: give it back as content with its "
                 "tags, TOOL_CALL_START + body + TOOL_CALL_END, when nothing of it was sent as a call")
HINT_BEFORE = ("the text before <tool_call> in the same delta did not come out as content: which part of self.buffer "
               "does the step add as content (self.add_content(delta, self.buffer[:start])) before it drops the tag "
               "and enters the call?")
HINT_SENT_THEN_BROKEN = ("a call whose name was already sent came back as content too: the client holds the call "
                         "already and cannot take it back, so its text is not content; is the body given back as "
                         "text only while not self.current_tool_name_sent?")
HINT_EMPTY = ("an argument fragment with no characters went out: a client gains nothing from it, and vLLM sends "
              "none; does send_call append DeltaFunctionCall(arguments=...) only when arguments[self.arguments_sent:] "
              "is not empty?")
HINT_LATER_INDEX = ("a piece of an earlier call came after the next call began: does every later piece carry the "
                    "index of the call being streamed, DeltaToolCall(self.current_tool_id, ...), and not a fixed "
                    "number?")
HINT_RETURN = ("extract_tool_calls_streaming must return a DeltaMessage or None; parse_delta returns the "
               "DeltaMessage it filled")


# --------------------------------------------------------------------- running a stream


@dataclass(frozen=True)
class Piece:
    """One DeltaToolCall as the checks compare it (its id only as 'has one')."""

    index: int
    name: str | None
    arguments: str | None
    has_id: bool
    type: str | None

    def __str__(self) -> str:
        parts = [f"index {self.index}"]
        if self.name is not None:
            parts.append(f"name {self.name!r}")
        if self.arguments is not None:
            parts.append(f"arguments {self.arguments!r}")
        if self.has_id or self.type is not None:
            parts.append(f"id {'yes' if self.has_id else 'no'}, type {self.type!r}")
        return "(" + ", ".join(parts) + ")"


Out = tuple[str | None, tuple[Piece, ...]]   # one delta's output: (content, tool-call pieces)


def _out(delta) -> Out:
    if delta is None:
        return None, ()
    if not hasattr(delta, "tool_calls") or not hasattr(delta, "content"):
        raise CheckFailure("extract_tool_calls_streaming returned something that is not a DeltaMessage",
                           got=repr(delta), hint=HINT_RETURN)
    pieces = tuple(Piece(c.index, c.function.name, c.function.arguments, c.id is not None, c.type)
                   for c in delta.tool_calls)
    return (delta.content or None), pieces


def stream(parser_class, pieces: list[str]) -> list[Out]:
    """Feed ``pieces`` to a new ``parser_class()`` as a server does; one output per piece,
    then the one of ``finish_streaming()``."""
    parser, previous, outs = parser_class(), "", []
    for piece in pieces:
        outs.append(_out(parser.extract_tool_calls_streaming(previous, previous + piece, piece)))
        previous += piece
    outs.append(_out(parser.finish_streaming()))
    return outs


def assemble(outs: list[Out]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client makes of the stream: (content, [(name, arguments), ...])."""
    content, calls = "", {}
    for text, pieces in outs:
        content += text or ""
        for piece in pieces:
            entry = calls.setdefault(piece.index, ["", ""])
            entry[0] = piece.name if piece.name is not None else entry[0]
            entry[1] += piece.arguments or ""
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The package's whole-message parse, in ``assemble``'s form."""
    from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    info = Hermes2ProToolParser().extract_tool_calls(text)
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


def describe(pieces: list[str]) -> str:
    shown = [repr(p) for p in pieces]
    if len(shown) > 12:
        shown = shown[:6] + [f"... ({len(shown) - 10} more)"] + shown[-4:]
    return f"{len(pieces)} deltas " + " ".join(shown) + " , then finish_streaming()"


def _show(outs: list[Out], start: int = 0, count: int = 4) -> str:
    """Outputs ``start`` .. ``start + count - 1``, the later ones counted."""
    lines = [] if start == 0 else [f"({start} deltas as expected)"]
    for number in range(start, min(len(outs), start + count)):
        content, pieces = outs[number]
        label = "finish" if number == len(outs) - 1 else f"delta {number}"
        said = ([f"content {content!r}"] if content else []) + [str(p) for p in pieces]
        lines.append(f"{label}: " + (", ".join(said) if said else "nothing"))
    if start + count < len(outs):
        lines.append(f"... ({len(outs) - start - count} more)")
    return "; ".join(lines)


def _structure_problem(outs: list[Out]) -> tuple[int, str, str] | None:
    """The first piece that breaks the rules of a stream on its own: (which output, what, hint)."""
    seen: set[int] = set()
    for number, (_, pieces) in enumerate(outs):
        where = "finish_streaming()" if number == len(outs) - 1 else f"delta {number}"
        for piece in pieces:
            if piece.index not in seen:
                if piece.index != len(seen):
                    return (number, f"{where}: a new call has index {piece.index}, but {len(seen)} call(s) came "
                                    f"before it (indices count from 0)", HINT_INDEX)
                if piece.name is None or not piece.has_id or piece.type != "function":
                    return number, f"{where}: call {piece.index}'s first piece is {piece}", HINT_FIRST_PIECE
                seen.add(piece.index)
            elif piece.name is not None or piece.has_id:
                return number, f"{where}: call {piece.index}'s name (or id) came again: {piece}", HINT_NAME_ONCE
            elif piece.index != len(seen) - 1:
                return (number, f"{where}: a piece of call {piece.index} came after call {len(seen) - 1} began: "
                                f"{piece}", HINT_LATER_INDEX)
            if piece.arguments == "":
                return number, f"{where}: call {piece.index} got an empty argument fragment: {piece}", HINT_EMPTY
    return None


def _held_back_leak(got: list[Out], want: list[Out]) -> bool:
    """Whether the first delta whose content differs sent what the package held back as a
    possible start of <tool_call>."""
    for (mine, _), (theirs, _) in zip(got, want):
        if mine != theirs:
            mine, theirs = mine or "", theirs or ""
            extra = mine[len(theirs):] if mine.startswith(theirs) else ""
            return bool(extra) and (TOOL_CALL_START.startswith(extra[:len(TOOL_CALL_START)])
                                    or TOOL_CALL_START in extra)
    return False


def _diagnose(got: list[Out], want: list[Out], pieces: list[str], hint: str) -> str:
    """The usual mistake whose trace ``got`` shows, else ``hint`` (the case's own)."""
    if _held_back_leak(got, want):
        return HINT_HELD_BACK
    (_, got_calls), (_, want_calls) = assemble(got), assemble(want)
    if len(want_calls) >= 2 and 1 <= len(got_calls) < len(want_calls):
        return HINT_TWO_CALLS
    if len(got_calls) > len(want_calls):
        return HINT_NAME_ONCE
    for (_, mine), (_, theirs) in zip(got_calls, want_calls):
        if len(mine) > len(theirs):
            return HINT_TWICE
    if assemble(got) == assemble(want):   # the same in the end: the timing differs
        late = _first_difference(got, want)
        closes_there = late is not None and late < len(pieces) and TOOL_CALL_END in pieces[late]
        return HINT_LOOP if closes_there else HINT_SOON
    return hint


def _first_difference(got: list[Out], want: list[Out]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def compare(parser_class, pieces: list[str], where: str, hint: str) -> None:
    """Stream ``pieces`` through yours and through the package's parser; raise a
    ``CheckFailure`` naming the first difference and its likely cause."""
    from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    got, want = stream(parser_class, pieces), stream(Hermes2ProToolParser, pieces)
    problem = _structure_problem(got)
    if problem is not None:
        number, what, rule = problem
        raise CheckFailure(f"{where}: {what}", input=describe(pieces), got=_show(got, max(0, number - 1)), hint=rule)
    if got == want:
        return
    first = _first_difference(got, want) or 0
    label = "finish_streaming()" if first == len(pieces) else f"delta {first} ({pieces[first]!r})"
    raise CheckFailure(f"{where}: your output first differs at {label}", input=describe(pieces),
                       expected=_show(want, first), got=_show(got, first), hint=_diagnose(got, want, pieces, hint))


# --------------------------------------------------------------------- the cases

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
ESCAPED = '{"name": "search", "arguments": {"query": "say \\"hi\\"", "k": 3}}'


def check_hermes_parser(Hermes2ProToolParser, *, max_examples: int = 120, quiet: bool = False) -> CheckResult:
    """Check your ``Hermes2ProToolParser`` (its ``parse_delta`` and ``send_call``, through
    ``extract_tool_calls_streaming`` and ``finish_streaming``); print and return the result."""
    cls = Hermes2ProToolParser

    def text_only():
        compare(cls, ["Hello", ", world", "!"], "text without a call, in 3 deltas", HINT_SOON)
        compare(cls, ["a < b", " and c > d"], "a '<' that cannot begin <tool_call> (the next character is ' ')",
                HINT_SOON)

    def held_back():
        compare(cls, ["Sure<t", "ool_c", 'all>{"name": "f", "arguments": {}}</tool_call>'],
                "<tool_call> split over three deltas", HINT_HELD_BACK)
        compare(cls, ["x <to", "day"], "'<to' held back, then released: it was '<today'", HINT_HELD_BACK)

    def one_call():
        compare(cls, [CALL], "one call, whole in one delta", HINT_FIRST_PIECE)

    def text_before():
        compare(cls, ["I will look." + CALL], "text, then a call, in the same delta", HINT_BEFORE)

    def arguments_stream():
        body = "<tool_call>\n" + ESCAPED
        compare(cls, [*body, "\n</tool_call>"], "a call written one character a delta (an escaped quote in its "
                "arguments), the end tag whole", HINT_SOON)

    def text_after():
        compare(cls, [CALL + " Done."], "text after a call, in the same delta", HINT_AFTER)
        compare(cls, [CALL, " Done."], "text after a call, in the next delta", HINT_AFTER)

    def two_calls():
        compare(cls, ["Both." + CALL + "\n" + SECOND], "two calls in one delta", HINT_TWO_CALLS)
        compare(cls, ["Both." + CALL, "\n" + SECOND[:30], SECOND[30:]], "two calls, the second over two deltas",
                HINT_TWO_CALLS)

    def end_tag_split():
        compare(cls, ['<tool_call>{"name": "f", "arguments": {"a": 1}}</to', "ol_call", "> ok"],
                "</tool_call> split over three deltas, text after it", HINT_END_TAG)

    def not_json():
        compare(cls, ["x<tool_call>{oops}</tool_call>y"], "a call whose body is not JSON", HINT_NOT_JSON)
        compare(cls, ["x<tool_call>\n[1, 2]", "\n</tool_call>y"], "a call whose body is a list, not an object",
                HINT_NOT_JSON)

    def sent_then_broken():
        compare(cls, SENT_THEN_BROKEN, "a call whose name streamed, then closed before its JSON did",
                HINT_SENT_THEN_BROKEN)

    def end_held():
        compare(cls, ["a <tool"], "'<tool' at the end of the stream", HINT_END_HELD)

    def unclosed():
        compare(cls, ['x<tool_call>{"arguments": {"a": 1}, "name": "f"}\n'],
                "a call left open at the end, its name after its arguments (nothing of it streams before the end)",
                HINT_UNCLOSED)
        compare(cls, ['x<tool_call>{"name": '], "a call left open at the end, not JSON: its text is content",
                HINT_UNCLOSED)

    def random_messages():
        from hypothesis import given, strategies as st

        @property_settings(max_examples, report_multiple_bugs=False)
        @given(st.data())
        def test(data):
            text = data.draw(_messages(st), label="message")
            cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text)), label="cuts"))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if a < b]
            got = stream(cls, pieces)
            problem = _structure_problem(got)
            if problem is not None:
                number, what, rule = problem
                raise CheckFailure(f"a random message: {what}", input=describe(pieces),
                                   got=_show(got, max(0, number - 1)), hint=rule)
            content, calls = assemble(got)
            want_content, want_calls = whole(text)
            if (content, calls) != (want_content, want_calls):
                want = stream(_package_class(), pieces)
                raise CheckFailure("a random message: the concatenated deltas differ from the whole message's "
                                   "parse", input=describe(pieces),
                                   expected=f"content {want_content!r}, calls {want_calls}",
                                   got=f"content {content!r}, calls {calls}",
                                   hint=_diagnose(got, want, pieces, HINT_SOON))

        run_property(test)

    cases = [   # one rule at a time, so that the first failure names one mistake
        Case("text streams through as it comes", text_only),
        Case("one call: its first piece (index 0, id, type, name), then its arguments", one_call),
        Case("text before a call in the same delta is content", text_before),
        Case("a tag split across deltas is held back, never content", held_back),
        Case("arguments stream as they are written, each character once", arguments_stream),
        Case("text after a call is content", text_after),
        Case("two calls in one message: indices 0 and 1", two_calls),
        Case("the end tag split across deltas closes the call", end_tag_split),
        Case("a call that is not JSON stays text, tags and all", not_json),
        Case("a call whose name was sent is never content, even when its JSON breaks", sent_then_broken),
        Case("text held back at the end of the stream is content", end_held),
        Case("a call left open at the end of the stream closes as it is", unclosed),
        Case(f"property: {max_examples} random messages cut at random places (the concatenated deltas give the "
             "whole message's parse)", random_messages),
    ]
    return run_checks("Hermes2ProToolParser.parse_delta / send_call", cases, quiet=quiet)


def _package_class():
    from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    return Hermes2ProToolParser


def _messages(st):
    """Messages of text and well-formed calls (the strategy of tests/tool_parsers/test_hermes.py)."""
    text = st.text(alphabet="ab <>/_tolcaxyz\n{}\"", max_size=12).filter(lambda t: TOOL_CALL_START not in t)
    values = st.recursive(st.none() | st.booleans() | st.integers(-99, 999) | st.text("ab }{<\"\\é", max_size=5),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("kq", max_size=2), inner,
                                                                                        max_size=3), max_leaves=6)

    @st.composite
    def messages(draw) -> str:
        parts = []
        for _ in range(draw(st.integers(0, 3))):
            parts.append(draw(text))
            name = draw(st.sampled_from(["get_weather", "f", "search_docs"]))
            arguments = draw(st.dictionaries(st.text("abc", min_size=1, max_size=3), values, max_size=3))
            body = json.dumps({"name": name, "arguments": arguments}, indent=draw(st.sampled_from([None, 2])),
                              separators=draw(st.sampled_from([(", ", ": "), (",", ":")])),
                              ensure_ascii=draw(st.booleans()))
            parts.append(f"{TOOL_CALL_START}{draw(st.sampled_from(['', chr(10)]))}{body}\n{TOOL_CALL_END}")
        parts.append(draw(text))
        return "".join(parts)

    return messages()


# --------------------------------------------------------------------- the engine

# What the tiny random model is made to write (structured outputs: a regex of the text), one
# request each: every rule of the contract meets real engine output, cut into deltas wherever
# the engine's steps and the detokenizer cut it.
WRITTEN = (
    ("reasoning, text, one call (an escaped quote in its arguments)",
     '<think>Paris, then.</think>I will look.<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "note": "say \\"hi\\""}}\n</tool_call>'),
    ("two calls, text between and after them",
     '<think>Both.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call> Done.'),
    ("a call left open at the end, its name after its arguments",
     '<think>Oslo.</think>Checking.<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n'),
    ("text that only looks like tags, and a call that is not JSON",
     "<think>No tools.</think>Use <b>, not </tool_call> or <tool_call>[1, 2]</tool_call>: a < b <tool"),
)
# The tiny tokenizer has "<" and ">" as tokens of their own, so no delta of this run closes a
# call and holds text after it, or holds text and the start of a call; the checker's hand
# cases do (and the engine cell runs them too).
NOT_SEEN = ("Not seen by this run: a delta that closes a call and holds more text, or holds text and then "
            "<tool_call> (the tiny tokenizer's \"<\" and \">\" are tokens of their own, so a tag never shares a "
            "delta with the text around it; a real model's tokens, and a slow client, merge them); a call whose name "
            "streamed and whose JSON then broke (the run's messages do not write one). The cell runs "
            "check_hermes_parser's cases for them on your class too.")
AFTER_CLOSE = [CALL + " Done.", " And more."]   # those cases: a close and text after it in one delta,
BEFORE_CALL = ["I will look." + CALL]           # text before a call in one delta,
SENT_THEN_BROKEN = ['x<tool_call>{"name": "f", "arguments": {"a": 1', "</tool_call>y"]   # a broken call, name sent
ENGINE_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
                for name in ("get_weather", "get_time")]
YOURS = "hermes-yours"   # the name your class is registered under for the run


class InProcessServer:
    """uvicorn serving ``app`` on a free port of 127.0.0.1 from a thread (no lifespan: the
    engine is shut down by its owner, after both servers stopped)."""

    def __init__(self, app):
        import threading
        import time

        import uvicorn

        from microvllm.testing.ports import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def literal_regex(text: str) -> str:
    """A regex matching exactly ``text`` (only the characters special to a regex escaped:
    ``re.escape`` also escapes spaces, which a grammar compiler warns about)."""
    return "".join("\\" + ch if ch in ".^$*+?{}[]\\|()" else ch for ch in text)


def _chunks(url: str, text: str) -> tuple[list[tuple], int]:
    """Stream one forced request: (each chunk's delta as plain data, a call's id as 'has one';
    the number of tokens generated)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chunks, tokens = [], 0
    for chunk in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=ENGINE_TOOLS,
            max_tokens=300, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"structured_outputs": {"regex": literal_regex(text)}}):
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        for choice in chunk.choices:
            delta = choice.delta
            calls = tuple(Piece(c.index, c.function.name if c.function else None,
                                c.function.arguments if c.function else None, bool(c.id), c.type)
                          for c in delta.tool_calls or [])
            chunks.append(((delta.model_extra or {}).get("reasoning"), delta.content or None, calls,
                           choice.finish_reason))
    return chunks, tokens


def _message(chunks: list[tuple]) -> tuple:
    """(reasoning, content, [(name, arguments)], finish_reason) as a client assembles them."""
    reasoning = "".join(r or "" for r, *_ in chunks) or None
    content, calls = assemble([(c, pieces) for _, c, pieces, _ in chunks])
    finish = next((f for *_, f in reversed(chunks) if f), None)
    return reasoning, content, calls, finish


def run_hermes_parser_with(Hermes2ProToolParser, *, quiet: bool = False):
    """Serve a tiny random Llama (written to a temporary folder) twice, with the package's
    ``--tool-call-parser hermes`` and with your class (registered as ``hermes-yours``), both
    with ``--reasoning-parser qwen3``; make the model write each of ``WRITTEN`` (a regex of
    the text), streamed through the openai client; compare every chunk (reasoning, content,
    tool-call pieces, finish reason; ids only as 'has one'). Returns an ``EngineRunResult``."""
    import tempfile

    from microvllm.checks.engine_run import EngineRunResult
    from microvllm.engine.async_llm import AsyncLLM
    from microvllm.entrypoints.openai.api_server import build_app
    from microvllm.models.tiny import make_tiny_model
    from microvllm.tool_parsers import ToolParserManager

    def report(same, message, reference=(), yours=()):
        if not quiet:
            print(message)
        return EngineRunResult(same, list(reference), list(yours), message)

    try:   # a part not written yet is said in one line, before the engine starts
        stream(Hermes2ProToolParser, ["Sure<tool_call>", '{"name": "f", "arguments": {}}</tool_call>'])
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
        todo = not_implemented_message(exc)
        return report(False, f"run_hermes_parser_with: not implemented yet ({todo})" if todo is not None else
                      f"your parser fails on a short stream: {type(exc).__name__}: {exc} (run check_hermes_parser "
                      "above)")

    calls = []

    class Counted(Hermes2ProToolParser):   # counts the steps the server gives your class
        def extract_tool_calls_streaming(self, *args, **kwargs):
            calls.append(1)
            return super().extract_tool_calls_streaming(*args, **kwargs)

    ToolParserManager.register_module(YOURS)(Counted)
    reference, yours, tokens = [], [], []
    servers = []
    with tempfile.TemporaryDirectory(prefix="microvllm-21-") as folder:
        make_tiny_model(folder, "llama", seed=3)
        engine = AsyncLLM(folder, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=128)
        try:
            for parser in ("hermes", YOURS):
                servers.append(InProcessServer(build_app(engine, "tiny", enable_auto_tool_choice=True,
                                                       tool_call_parser=parser, reasoning_parser="qwen3")))
            for _, text in WRITTEN:
                chunks, count = _chunks(servers[0].url, text)
                reference.append(chunks)
                tokens.append(count)
                try:
                    yours.append(_chunks(servers[1].url, text)[0])
                except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report
                    return report(False, f"The stream through your parser failed on {text!r}: {type(exc).__name__}:"
                                         f" {exc} (the server's log above says where; run check_hermes_parser)")
        finally:
            for server in servers:
                server.stop()
            engine.shutdown()
            ToolParserManager.registered.pop(YOURS, None)
    lines = [f"A tiny random Llama made to write {len(WRITTEN)} messages (a regex of each text), streamed through "
             f"two servers with --reasoning-parser qwen3: --tool-call-parser hermes (the package's) and your class "
             f"({len(calls)} calls to yours)"]
    differ = []
    for (what, _), ref, mine, count in zip(WRITTEN, reference, yours, tokens):
        reasoning, content, tool_calls, finish = _message(ref)
        names = ", ".join(name for name, _ in tool_calls) or "none"
        lines.append(f"  {what}: {count} tokens in {len(ref)} chunks; content {content!r}; calls: {names}; "
                     f"finish_reason {finish}")
        if mine != ref:
            differ.append((what, ref, mine))
    if differ:
        what, ref, mine = differ[0]
        first = next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b), min(len(ref), len(mine)))
        lines.append(f"  {what}: chunk {first} differs: the package's {ref[first] if first < len(ref) else None}, "
                     f"yours {mine[first] if first < len(mine) else None}")
        lines.append(f"  assembled: the package's {_message(ref)}; yours {_message(mine)}")
        lines.append(f"✗ Your parser's stream differs on {len(differ)} of {len(WRITTEN)} messages: run "
                     "check_hermes_parser above, which names the first rule yours breaks.")
    elif not calls:
        lines.append("✗ The server never called your parser.")
    else:
        lines.append("  " + NOT_SEEN)
        for deltas in (AFTER_CLOSE, BEFORE_CALL, SENT_THEN_BROKEN):
            after = stream(Hermes2ProToolParser, deltas)
            want = stream(_package_class(), deltas)
            if after != want:
                lines.append(f"✗ Every chunk was the same as with the package's parser, but on the deltas {deltas} "
                             f"yours gives {_show(after)}, not {_show(want)}: run check_hermes_parser above.")
                return report(False, "\n".join(lines), reference, yours)
        lines.append("✓ Same reasoning, content and tool calls as the package's parser in every chunk of every "
                     "stream: your parser serves the real engine.")
    return report(not differ and bool(calls), "\n".join(lines), reference, yours)
