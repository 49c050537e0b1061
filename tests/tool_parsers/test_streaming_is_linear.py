"""Each streaming parser's work grows with the text, not with its square (issue 66, item 5).

The parsers run on the server's event loop: while one reads a delta, every other stream and
``/health`` wait. Re-reading the whole text at each delta made a message's cost quadratic:
20 KB of qwen3_xml parameters in 4-character deltas took 31 s, 5 KB of a pythonic string
holding ``)`` 57 s (cubic: a parse per ``)`` per delta). Now each parser keeps its place.

The test is machine-independent: it times N and 4N characters of the same payload on this
machine, in the same run (best of five, CPU time), and asserts the ratio: linear work gives
about 4, quadratic 16; the bound, 8, leaves room for noise. (What remains superlinear is
C-speed copying: a stream's text so far is one string, and appending to it copies it;
the caller, vLLM's interface, does the same with ``current_text``.)

``python -m tests.tool_parsers.test_streaming_is_linear 10,20,40`` prints the seconds per
size for every payload (the issue's before/after table).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from microvllm.tool_parsers import ToolParserManager


def hermes_members(n: int) -> str:
    members = [f'"k{k}": {k}' for k in range(n // 10)]
    return '<tool_call>\n{"name": "f", "arguments": {' + ", ".join(members) + '}}\n</tool_call>'


def hermes_string(n: int) -> str:
    return '<tool_call>\n{"name": "f", "arguments": {"code": "' + "x" * n + '"}}\n</tool_call>'


def qwen_parameters(n: int) -> str:
    parameters = "".join(f"<parameter=p{k}>\nvalue {k}\n</parameter>\n" for k in range(n // 36))
    return "<tool_call>\n<function=f>\n" + parameters + "</function>\n</tool_call>"


def qwen_value(n: int) -> str:
    return "<tool_call>\n<function=f>\n<parameter=code>\n" + "x" * n + "\n</parameter>\n</function>\n</tool_call>"


def tags(n: int) -> str:
    return "<tool_call>" * (n // 11)


def llama_members(n: int) -> str:
    return json.dumps({"name": "f", "parameters": {f"k{k}": k for k in range(n // 10)}})


def mistral_list(n: int) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": "f", "arguments": {f"k{k}": k for k in range(n // 10)}}])


def mistral_named(n: int) -> str:
    return "[TOOL_CALLS]f[ARGS]" + json.dumps({f"k{k}": k for k in range(n // 10)})


def pythonic_string(n: int) -> str:
    return '[f(a="' + "x)" * (n // 2) + '", b=1)]'


def pythonic_arguments(n: int) -> str:
    return "[f(" + ", ".join(f"k{k}={k}" for k in range(n // 8)) + ")]"


PAYLOADS = {   # (parser, what): the text of about n characters
    ("hermes", "2 members a KB"): hermes_members, ("hermes", "one string"): hermes_string,
    ("hermes", "<tool_call> x n"): tags,
    ("qwen3_xml", "parameters"): qwen_parameters, ("qwen3_xml", "one value"): qwen_value,
    ("qwen3_xml", "<tool_call> x n"): tags,
    ("llama3_json", "members"): llama_members,
    ("mistral", "a list"): mistral_list, ("mistral", "[ARGS] form"): mistral_named,
    ("pythonic", "')' in a string"): pythonic_string, ("pythonic", "arguments"): pythonic_arguments,
}


def seconds(name: str, text: str, step: int = 4) -> float:
    """CPU seconds a new ``name`` parser spends on ``text`` streamed in ``step``-character
    deltas, as a server calls it (``previous_text``, ``current_text``, ``delta_text``); only
    the parser's calls are timed, not the caller's ``previous + delta``."""
    parser = ToolParserManager.get_tool_parser(name)()
    spent, current = 0.0, ""
    for at in range(0, len(text), step):
        previous, current = current, current + text[at:at + step]
        start = time.process_time()
        parser.extract_tool_calls_streaming(previous, current, text[at:at + step])
        spent += time.process_time() - start
    start = time.process_time()
    parser.finish_streaming()
    return spent + time.process_time() - start


@pytest.mark.slow
@pytest.mark.parametrize("name, what", sorted(PAYLOADS))
def test_four_times_the_text_costs_about_four_times_the_time(name, what):
    size = 8000
    small, large = PAYLOADS[name, what](size), PAYLOADS[name, what](4 * size)
    times: dict[str, list[float]] = {"small": [], "large": []}
    for _ in range(5):   # interleaved, so that a busy moment of the machine hits both
        times["small"].append(seconds(name, small))
        times["large"].append(seconds(name, large))
    ratio = min(times["large"]) / min(times["small"])
    assert ratio < 8, (f"{name} ({what}): {len(large)} characters took {ratio:.1f}x the time of {len(small)} "
                       f"(linear is about 4, quadratic 16): {times}")


if __name__ == "__main__":
    sizes = [int(kb) for kb in (sys.argv[1] if len(sys.argv) > 1 else "5,10,20").split(",")]
    print(f"{'parser':12} {'payload':17}" + "".join(f"{kb:>8} KB" for kb in sizes))
    for (name, what), make in PAYLOADS.items():
        row = f"{name:12} {what:17}"
        for kb in sizes:
            took = seconds(name, make(kb * 1000))
            row += f"{took:9.3f} s"
            if took > 20:   # a quadratic parser (before issue 66): the next size would take minutes
                row += "  (larger: skipped)"
                break
        print(row, flush=True)
