"""Exercise 21's checker on parsers a learner might write from scratch, not planted one line at a
time: each is failed (not reported as unfinished) and its first failure gives the hint of its
real mistake, at the case that isolates it."""

from __future__ import annotations

from microvllm.checks.hermes_parser import HINT_FIRST_PIECE, HINT_RETURN, HINT_SOON, check_hermes_parser
from microvllm.tool_parsers.abstract_tool_parser import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from microvllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser, parse_call


def first_failure(parser_class) -> tuple[str, str]:
    """(the name of the first failing case, its explanation)."""
    result = check_hermes_parser(parser_class, max_examples=20, quiet=True)
    assert not result.passed and not result.not_implemented, result.report()
    case = next(case for case in result.cases if case.status == "fail")
    return case.name, case.message


class WaitsForTheClose(Hermes2ProToolParser):
    """Sends a call only once its whole JSON is there: right in the end, never streamed."""

    def send_call(self, delta, name, arguments):
        if parse_call(self.body) == (name, arguments):
            super().send_call(delta, name, arguments)


class HoldsBackEveryAngle(Hermes2ProToolParser):
    """Outside a call, keeps everything from the last '<' on, whatever follows it."""

    def parse_delta(self, delta_text, *, end_of_stream=False):
        if self.in_call or end_of_stream or "<tool_call>" in self.buffer + delta_text:
            return super().parse_delta(delta_text, end_of_stream=end_of_stream)
        self.buffer += delta_text
        cut = self.buffer.rfind("<")
        safe, self.buffer = (self.buffer, "") if cut < 0 else (self.buffer[:cut], self.buffer[cut:])
        return DeltaMessage(content=safe or None)


class ReturnsADict(Hermes2ProToolParser):
    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, *args, **kwargs):
        delta = self.parse_delta(delta_text)
        return {"content": delta.content, "tool_calls": delta.tool_calls}


class NameWithoutAnId(Hermes2ProToolParser):
    """The call's first piece without its id and type."""

    def send_call(self, delta, name, arguments):
        if name is None:
            return
        if not self.current_tool_name_sent:
            self.current_tool_id += 1
            self.current_tool_name_sent = True
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, DeltaFunctionCall(name=name)))
        new = (arguments or "")[self.arguments_sent:]
        if new:
            self.arguments_sent += len(new)
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, DeltaFunctionCall(arguments=new)))


class SendCallNotWritten(Hermes2ProToolParser):
    def send_call(self, delta, name, arguments):
        raise NotImplementedError("Hermes2ProToolParser.send_call: not written yet")


def test_a_call_sent_only_at_its_close_is_told_to_stream():
    case, message = first_failure(WaitsForTheClose)
    assert case.startswith("arguments stream as they are written"), case
    assert HINT_SOON in message, message


def test_holding_back_every_angle_bracket_is_told_to_send_what_cannot_begin_the_tag():
    case, message = first_failure(HoldsBackEveryAngle)
    assert case.startswith("text streams through as it comes"), case
    assert HINT_SOON in message and "'a < b'" in message, message


def test_a_dict_instead_of_a_delta_message_is_named():
    _, message = first_failure(ReturnsADict)
    assert HINT_RETURN in message, message


def test_a_first_piece_without_id_and_type_is_named():
    case, message = first_failure(NameWithoutAnId)
    assert case.startswith("one call"), case   # the first case with a call
    assert HINT_FIRST_PIECE in message and "first piece is (index 0, name 'get_weather')" in message, message


def test_one_method_not_written_is_reported_as_not_implemented():
    result = check_hermes_parser(SendCallNotWritten, max_examples=5, quiet=True)
    assert result.not_implemented and "send_call: not written yet" in result.report(), result.report()
