"""Exercise 21 (the incremental Hermes tool-call parser, ``parse_delta`` and ``send_call``): the
checker passes the package's class and names the cause of each usual mistake; the engine cell,
a real server streaming the tiny model's forced tool calls through the openai client, tells a
wrong parser from the right one."""

import pytest

from microvllm.checks.hermes_parser import NOT_SEEN, check_hermes_parser, run_hermes_parser_with
from microvllm.tool_parsers import hermes_tool_parser
from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from tests.course.mutants import mutant

SOLUTION_END = '            self.in_call, self.body = False, ""\n        ### END SOLUTION'
# name: (the replacements that plant the mistake, words its first failure must contain)
MISTAKES = {
    "a tag split across deltas leaks as content": (
        [("split_held_back(self.buffer, TOOL_CALL_START)", '(self.buffer, "")')],
        "a piece of <tool_call> split across deltas was sent as content"),
    "the end tag split across deltas is missed": (
        [("split_held_back(self.buffer, TOOL_CALL_END)", '(self.buffer, "")')],
        "the end tag split across deltas was not found"),
    "two calls: the state is not reset": (
        [("                self.current_tool_name_sent, self.arguments_sent = False, 0\n", "")],
        "the second call was merged into the first"),
    "text after a call is dropped": (
        [("self.buffer = self.buffer[end + len(TOOL_CALL_END):] if closed else \"\"", 'self.buffer = ""')],
        "the text after a call is content"),
    "stops at the first close of a delta": (
        [(SOLUTION_END, SOLUTION_END.replace('""\n', '""\n            return delta\n'))],
        "after a call closes, go on with the rest of the buffer in the same step"),
    "arguments emitted twice (every step)": (
        [('new = (arguments or "")[self.arguments_sent:]', 'new = arguments or ""')],
        "arguments emitted twice"),
    "arguments emitted twice (again at the close)": (
        [("                self.send_call(delta, *call)\n",
          "                self.arguments_sent = 0\n                self.send_call(delta, *call)\n")],
        "arguments emitted twice"),
    "an unclosed call at the end of the stream is lost": (
        [("if end < 0 and not end_of_stream:", "if end < 0:")],
        "a call left open closes as it is"),
    "text held back at the end of the stream is lost": (
        [('                        safe, self.buffer = self.buffer, ""\n',
          "                        safe, self.buffer = split_held_back(self.buffer, TOOL_CALL_START)\n")],
        "nothing may stay held back"),
    "a call that is not JSON is dropped": (
        [('self.add_content(delta, TOOL_CALL_START + self.body + (TOOL_CALL_END if closed else ""))', "pass")],
        "is text: give it back as content with its tags"),
    "the name is sent with every step": (
        [("            self.current_tool_name_sent = True\n", "")],
        "went out more than once"),
    "the index does not advance": (
        [("            self.current_tool_id += 1\n", "")],
        "call indices count the calls of the message from 0"),
    "a call whose name was sent is given back as content too": (
        [("elif not self.current_tool_name_sent:", "else:")],
        "a call whose name was already sent came back as content too"),
    "the text before a call in the same delta is dropped": (
        [("                self.add_content(delta, self.buffer[:start])\n", "")],
        "the text before <tool_call> in the same delta did not come out as content"),
    "an empty argument fragment is sent": (
        [("        if new:\n", "        if True:\n")],
        "an argument fragment with no characters went out"),
    "later pieces carry index 0": (
        [("DeltaToolCall(self.current_tool_id, DeltaFunctionCall(arguments=new))",
          "DeltaToolCall(0, DeltaFunctionCall(arguments=new))")],
        "a piece of an earlier call came after the next call began"),
}
FIRST_CASE = {   # name: the hand case that must fail first (the one that isolates the mistake)
    "a tag split across deltas leaks as content": "a tag split across deltas is held back",
    "the end tag split across deltas is missed": "the end tag split across deltas closes the call",
    "two calls: the state is not reset": "two calls in one message",
    "text after a call is dropped": "text after a call is content",
    "stops at the first close of a delta": "text after a call is content",
    "arguments emitted twice (every step)": "arguments stream as they are written",
    "arguments emitted twice (again at the close)": "arguments stream as they are written",
    "an unclosed call at the end of the stream is lost": "a call left open at the end",
    "text held back at the end of the stream is lost": "text held back at the end of the stream",
    "a call that is not JSON is dropped": "a call that is not JSON stays text",
    "the index does not advance": "one call: its first piece",
    "a call whose name was sent is given back as content too": "a call whose name was sent is never content",
    "the text before a call in the same delta is dropped": "text before a call in the same delta is content",
    "an empty argument fragment is sent": "arguments stream as they are written",
    "later pieces carry index 0": "two calls in one message",
}


def planted(name: str) -> type:
    return mutant(hermes_tool_parser, MISTAKES[name][0]).Hermes2ProToolParser


def test_the_package_passes():
    result = check_hermes_parser(Hermes2ProToolParser, quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named_by_its_cause(name):
    result = check_hermes_parser(planted(name), quiet=True)
    assert not result.passed and not result.not_implemented, f"the checker passed the mutant {name!r}"
    first = result.failures[0].message
    cause = MISTAKES[name][1]
    assert cause in first, f"{name}: the first failure does not name the cause:\n{first}"
    assert "hint:" in first and "input:" in first, first
    others = {words for _, words in MISTAKES.values() if words != cause}
    assert not any(words in first for words in others), f"{name}: the first failure names another cause:\n{first}"
    if name in FIRST_CASE:
        failed = next(case for case in result.cases if case.status == "fail")
        assert failed.name.startswith(FIRST_CASE[name]), (name, failed.name)


def test_a_todo_is_reported_as_not_implemented():
    class Todo(Hermes2ProToolParser):
        def parse_delta(self, delta_text, *, end_of_stream=False):
            raise NotImplementedError("Hermes2ProToolParser.parse_delta: ...")

    result = check_hermes_parser(Todo, quiet=True)
    assert not result.passed and result.not_implemented and "not implemented" in result.report()
    assert "not implemented yet" in run_hermes_parser_with(Todo, quiet=True).message


def test_the_engine_cell_passes_the_package():
    result = run_hermes_parser_with(Hermes2ProToolParser, quiet=True)
    assert result.same and "calls to yours)" in result.message, result.message
    assert result.message.splitlines()[-1].startswith("✓ Same reasoning, content and tool calls"), result.message
    assert NOT_SEEN in result.message, result.message
    for line in ("calls: get_weather; finish_reason tool_calls", "calls: none; finish_reason stop",
                 "calls: get_weather, get_time; finish_reason tool_calls"):
        assert line in result.message, (line, result.message)


# The brief's five mistakes, through the server (each run takes seconds: not all twelve).
SEEN_BY_THE_ENGINE = ("a tag split across deltas leaks as content", "two calls: the state is not reset",
                      "arguments emitted twice (every step)", "an unclosed call at the end of the stream is lost")
# The tiny tokenizer's "<" and ">" are tokens of their own: no delta of the run closes a call and holds text
# after it, or holds text and then <tool_call>; no message of the run breaks a call whose name was sent.
NOT_SEEN_BY_THE_ENGINE = ("text after a call is dropped", "the text before a call in the same delta is dropped",
                          "a call whose name was sent is given back as content too")


@pytest.mark.parametrize("name", SEEN_BY_THE_ENGINE)
def test_the_engine_cells_run_streams_each_mistake_differently(name):
    wrong = run_hermes_parser_with(planted(name), quiet=True)
    assert not wrong.same and wrong.reference != wrong.yours, (name, wrong.message)
    assert "Your parser's stream differs on" in wrong.message and "check_hermes_parser" in wrong.message, wrong.message


@pytest.mark.parametrize("name", NOT_SEEN_BY_THE_ENGINE)
def test_the_engine_cell_says_what_its_run_cannot_see(name):
    wrong = run_hermes_parser_with(planted(name), quiet=True)
    assert wrong.reference == wrong.yours, (name, wrong.message)   # the run itself cannot tell
    assert NOT_SEEN in wrong.message and not wrong.same, (name, wrong.message)
    assert "✗ Every chunk was the same as with the package's parser, but on the deltas" in wrong.message, wrong.message
