"""Chat messages as clients send them -> what a chat template reads (vLLM:
``entrypoints/chat_utils.py``).

Agent frameworks send more than ``{"role", "content": str}``; each shape is either
rendered or refused with what to change (never a template crash)::

    {"role": "user", "content": [{"type": "text", "text": "a"}, ...]}   parts -> "a\\n..."
    {"role": "assistant", "content": null, "tool_calls": [...]}        content "" and the
        tool calls passed to the template (arguments parsed from JSON, as templates expect)
    {"role": "tool", "tool_call_id": "call_1", "content": "42"}        passed as it is
    {"role": "user", "content": null}                                  400: needs content
    {"type": "image_url", ...} part, a text part without "text"        400: says which
"""

from __future__ import annotations

import json

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat_messages(messages: list[dict]) -> list[dict]:
    """Check and normalize ``messages`` (dicts, as the request holds them); raises
    ``ValueError`` naming the message and the field."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    return [_parse_message(index, dict(message)) for index, message in enumerate(messages)]


def _parse_message(index: int, message: dict) -> dict:
    where = f"messages[{index}]"
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role={role!r} is not one of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        content = _join_text_parts(where, content)
    if content is None:
        if role == "assistant":
            content = ""   # an assistant turn that only called tools
        else:
            raise ValueError(f"{where}.content is null: a {role} message needs content "
                             "(a string or a list of text parts)")
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    parsed = {key: value for key, value in message.items() if value is not None}
    parsed["content"] = content
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise ValueError(f"{where}.tool_calls: only an assistant message can call tools")
        parsed["tool_calls"] = [_parse_tool_call(f"{where}.tool_calls[{i}]", call)
                                for i, call in enumerate(message["tool_calls"])]
    return parsed


def _join_text_parts(where: str, parts: list) -> str:
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text"):
            raise ValueError(f"{where}.content[{i}] has type {kind!r}: only text parts "
                             "({'type': 'text', 'text': ...}) are supported; these models read no images or audio")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{i}] is a text part without a string 'text': add the text")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_tool_call(where: str, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must look like {{'id': ..., 'type': 'function', "
                         "'function': {'name': ..., 'arguments': '<json>'}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:   # chat templates (Llama's, Qwen's) index the arguments as a dict
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {arguments[:60]!r}") from None
    return {**call, "function": {**function, "arguments": arguments}}
