"""What is wrong with a request body's JSON text, said before anything parses it.

Python's ``json`` accepts three things that break the server later, far from their
cause; each is found here and named by its field (``messages[0].content``)::

    bytes that are not UTF-8        b'{"prompt": "a\\xffb"}'        FastAPI: "There was an error
                                                                  parsing the body"
    arrays/objects nested too deep  {"chat_template_kwargs": {"a": {"a": ... 900 deep
                                                                  RecursionError: a 500
    a lone UTF-16 surrogate         {"prompt": "a\\ud800b"}        the tokenizer: "TextEncodeInput
                                                                  must be Union[...]"

Each check is one pass in C over the bytes (``bytes.isascii``, ``bytes.count``, a regex)
in the common case; only a body that may hold a problem is walked in Python to say where.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# serde_json's default recursion limit; Python itself fails somewhere past ~300 levels
# (the parser, pydantic, the encoder of an error), so this is not a flag.
MAX_JSON_DEPTH = 128

_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_TOKEN = re.compile(rb"(" + _STRING + rb")(\s*:)?|[\[\]{}]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class BodyProblem:
    message: str
    param: str | None   # the top-level field it is in, as OpenAI's error names it


def find_body_problem(body: bytes) -> BodyProblem | None:
    """The first of: not UTF-8, nested deeper than ``MAX_JSON_DEPTH``, a lone surrogate;
    None if the text has none of them (it may still be malformed JSON: the parser says so)."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as error:
            return BodyProblem(f"the request body is not valid UTF-8: byte {error.start} (0x{body[error.start]:02x}) "
                               f"{_reason(error)}; JSON must be sent as UTF-8 (RFC 8259)", None)
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
        problem = _too_deep(body)
        if problem is not None:
            return problem
    if _SURROGATE_ESCAPE.search(body):
        return _lone_surrogate(body)
    return None


def _reason(error: UnicodeDecodeError) -> str:
    return {"invalid start byte": "cannot start a character",
            "invalid continuation byte": "starts a character that the next bytes do not complete "
                                         "(a UTF-16 surrogate encoded like UTF-8 is not UTF-8 either)",
            "unexpected end of data": "ends the body inside a character"}.get(error.reason, f"is {error.reason}")


def _too_deep(body: bytes) -> BodyProblem | None:
    """Walk the brackets outside strings; remember the top-level key each one is under."""
    depth, field = 0, None
    for match in _TOKEN.finditer(body):
        token = match.group(0)
        if match.group(2) and depth == 1:          # a key of the top-level object
            field = json.loads(match.group(1))
        elif token in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                where = field if field is not None else "the request body"
                return BodyProblem(f"{where} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
                                   f"(at byte {match.start()}): this server reads at most {MAX_JSON_DEPTH} levels; "
                                   "flatten it", field)
        elif token in (b"]", b"}"):
            depth -= 1
    return None


def _lone_surrogate(body: bytes) -> BodyProblem | None:
    """Parse (depth is checked, so this cannot recurse too far) and find the first string
    that still holds a surrogate: ``json`` joins every valid pair into one character."""
    try:
        document = json.loads(body)
    except ValueError:
        return None                                # malformed: FastAPI's parser says where
    stack: list[tuple[str, object]] = [("", document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _LONE_SURROGATE.search(value)
            if found:
                return _surrogate_problem(path, path, value, found.start())
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                found = _LONE_SURROGATE.search(key)
                if found:
                    return _surrogate_problem(f"a key in {path or 'the request body'}", path, key, found.start())
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{index}]", item) for index, item in reversed(list(enumerate(value)))
                         if isinstance(item, (str, dict, list)))
    return None


def _surrogate_problem(where: str, path: str, text: str, position: int) -> BodyProblem:
    code = ord(text[position])
    half = "high" if code < 0xDC00 else "low"
    param = re.split(r"[.\[]", path, maxsplit=1)[0]
    return BodyProblem(f"{where} holds an unpaired surrogate (\\u{code:04x}, a {half} half, at character "
                       f"{position}): a JSON \\u escape of U+D800..U+DFFF must be a high half followed by a "
                       "low half; send the character itself (as UTF-8) or both halves", param or None)
