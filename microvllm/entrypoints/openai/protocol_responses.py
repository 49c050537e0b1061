"""The Responses API's request (``POST /v1/responses``), turned into a chat request (vLLM:
``entrypoints/openai/responses/protocol.py`` ``ResponsesRequest``, and ``responses/utils.py``
``construct_input_messages``, ``construct_tool_dicts``).

A response is a chat turn in other words: the same template renders it, the same engine
call and the same parsers answer it. What differs is the vocabulary, translated here::

    Responses request                            chat request (protocol.py)
    instructions: "Be brief."                    {"role": "system", "content": "Be brief."}
    input: "Hi"                                  {"role": "user", "content": "Hi"}
    input: [                                     messages: [
      {"role": "user", "content": [                {"role": "user", "content": "Hi"},
         {"type": "input_text", "text": "Hi"}]},
      {"type": "reasoning", "content": [           {"role": "assistant", "reasoning": "...",
         {"type": "reasoning_text", ...}]},           "content": "Let me look.",
      {"type": "message", "role": "assistant",        "tool_calls": [{"id": "call_1",
         "content": [{"type": "output_text",             "type": "function", "function":
                      "text": "Let me look."}]},         {"name": "f", "arguments": "{}"}}]},
      {"type": "function_call", "call_id": "call_1",
         "name": "f", "arguments": "{}"},
      {"type": "function_call_output",             {"role": "tool", "tool_call_id": "call_1",
         "call_id": "call_1", "output": "42"}]        "content": "42"}]
    tools: [{"type": "function", "name": "f",    tools: [{"type": "function", "function":
             "parameters": {...}}]  (flat)                {"name": "f", "parameters": {...}}}]
    tool_choice: {"type": "function", "name": f} tool_choice: {"type": "function", "function": {"name": f}}
    text: {"format": {"type": "json_schema",     response_format: {"type": "json_schema",
           "name": n, "schema": {...}}}             "json_schema": {"name": n, "schema": {...}}}
    max_output_tokens                            max_completion_tokens

Items that follow one another in one assistant turn (reasoning, its message, its calls) are
merged into one assistant message, as vLLM does. microvllm stores no response (stateless):
``previous_response_id``, ``background`` and ``conversation`` are refused with a 400;
``store`` (true by default in OpenAI's API) is accepted and nothing is stored, as vLLM does
when it has no store.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from microvllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# The vLLM sampling extras a Responses request may carry too (the openai client: extra_body).
SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos", "logit_bias",
                   "skip_special_tokens", "include_stop_str_in_output", "structured_outputs")
# Fields of the Responses API that name a feature microvllm lacks, with what to change.
REFUSED = {
    "previous_response_id": "needs the earlier response stored on the server, and microvllm stores none "
                            "(stateless): send the whole conversation in input (the earlier output items, then "
                            "the new ones) and remove previous_response_id",
    "background": "(run after the reply, fetch later) needs stored responses, and microvllm stores none: "
                  "remove background or set it to false",
    "conversation": "needs conversations stored on the server, and microvllm stores none: send the whole "
                    "conversation in input",
    "prompt": "(a stored prompt template) is not supported: send the text in instructions and input",
    "max_tool_calls": "is not supported: remove it",
}
# "include" values: the encrypted reasoning a stateless client asks for has nothing to hold here.
INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. The OpenAI fields first, then vLLM's extras."""

    model_config = ConfigDict(extra="allow")   # unknown fields are named in the log (check_supported)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True           # echoed; the model may still make one call or several
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None    # {"effort": ...}: given to the template as reasoning_effort
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = "disabled"
    store: bool = True                         # accepted; nothing is stored (vLLM without a store)
    stream: bool = False
    metadata: dict[str, str] | None = None     # echoed in the response
    user: str | None = None
    service_tier: str | None = "auto"
    prompt_cache_key: str | None = None        # vLLM ignores it too: the prefix cache needs no key
    previous_response_id: str | None = None
    background: bool = False
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: dict[str, Any] | None = None

    # ------------------------------------------------------------ checks
    def check_supported(self) -> list[str]:
        """Raise ``ValueError`` for a feature microvllm lacks (naming the field and what to
        change); return the names of fields it does not know (the server logs them)."""
        for name, why in REFUSED.items():
            if getattr(self, name) not in (None, False):
                raise ValueError(f"{name} {why}")
        if self.truncation not in (None, "disabled"):
            raise ValueError(f"truncation={self.truncation!r} is not supported: shorten the input, or set "
                             "truncation to 'disabled'")
        for value in self.include or []:
            if value not in INCLUDE_ACCEPTED:
                raise ValueError(f"include: {value!r} is not supported (microvllm returns no logprobs and runs no "
                                 "built-in tools in a response): remove it")
        if self.top_logprobs:
            raise ValueError("top_logprobs: a response carries no logprobs here: remove top_logprobs")
        return sorted([*(self.model_extra or {}), *(f"text.{key}" for key in self.text or {} if key != "format")])

    # -------------------------------------------------------- translation
    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request that asks for the same turn; ``ValueError`` naming the field."""
        response_format = self._response_format()
        tool_choice = self._chat_tool_choice()
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        constraints = [name for name, on in (("structured_outputs", self.structured_outputs is not None),
                                             ("text.format", response_format is not None),
                                             ("tool_choice", forced and bool(self.tools))) if on]
        if len(constraints) > 1:
            raise ValueError(f"{constraints[0]}: give one constraint on the output, not {len(constraints)}: "
                             f"{', '.join(constraints)}")
        effort = (self.reasoning or {}).get("effort")
        template_kwargs = {"reasoning_effort": effort} if effort is not None else {}   # as vLLM does
        extras = {name: getattr(self, name) for name in SAMPLING_EXTRAS if getattr(self, name) is not None}
        return ChatCompletionRequest(
            messages=[ChatMessage(**message) for message in self.chat_messages()],
            tools=self.chat_tools() or None, tool_choice=tool_choice,
            response_format=response_format, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            chat_template_kwargs=template_kwargs or None, **extras)

    def chat_messages(self) -> list[dict]:
        """``instructions`` and ``input`` as chat messages (see the module's table)."""
        messages: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        if not self.input:
            raise ValueError("input is empty: give a string or at least one input item")
        for index, item in enumerate(self.input):
            _add_item(messages, f"input[{index}]", item)
        return messages

    def chat_tools(self) -> list[dict]:
        """The flat function tools in the chat API's nested shape."""
        tools = []
        for index, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(f"tools[{index}] has type {kind!r}: microvllm serves function tools only "
                                 "({'type': 'function', 'name': ..., 'parameters': {...}}); built-in tools "
                                 "(web search, file search, code interpreter, MCP, ...) are not run here")
            if not isinstance(tool.get("name"), str):
                hint = " (that is the chat API's nested shape)" if "function" in tool else ""
                raise ValueError(f"tools[{index}] needs a string 'name'{hint}: a Responses tool is flat, "
                                 "{'type': 'function', 'name': ..., 'description': ..., 'parameters': {...}}")
            tools.append({"type": "function", "function": {
                key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}})
        return tools

    def _chat_tool_choice(self) -> str | dict:
        choice = self.tool_choice
        if isinstance(choice, str):
            return choice   # "auto", "none", "required"; anything else: the chat request names it
        name = choice.get("name") if choice.get("type") == "function" else None
        if name is None and isinstance(choice.get("function"), dict):   # the chat API's shape, accepted too
            name = choice["function"].get("name")
        if not isinstance(name, str):
            raise ValueError(f"tool_choice={choice!r} is not 'auto', 'none', 'required' or a function: "
                             "{'type': 'function', 'name': ...}")
        return {"type": "function", "function": {"name": name}}

    def _response_format(self) -> dict | None:
        """``text.format`` as the chat API's ``response_format``; None for plain text."""
        text_format = (self.text or {}).get("format") or {}
        kind = text_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            schema = text_format.get("schema")
            if not isinstance(schema, dict):
                raise ValueError("text.format: json_schema needs {'type': 'json_schema', 'name': ..., "
                                 "'schema': {...}} (the schema beside the name, not inside 'json_schema')")
            return {"type": "json_schema", "json_schema": {"name": text_format.get("name", "response"),
                                                           "schema": schema}}
        raise ValueError(f"text.format type {kind!r} is not one of text, json_object, json_schema")


def _add_item(messages: list[dict], where: str, item: dict) -> None:
    """Append one input item to ``messages``: a new message, or part of the assistant turn
    the previous message began (reasoning, then its text, then its calls)."""
    kind = item.get("type", "message" if "role" in item else None)
    turn = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise ValueError(f"{where}.role={role!r} is not one of {', '.join(MESSAGE_ROLES)}")
        text = _text_of(f"{where}.content", item.get("content"))
        if role == "assistant" and turn is not None and turn.get("content") is None and not turn.get("tool_calls"):
            turn["content"] = text   # the answer after its reasoning
        else:
            messages.append({"role": role, "content": text})
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise ValueError(f"{where}: encrypted reasoning is not supported (microvllm never makes it): send "
                             "the reasoning's content, or leave the reasoning item out")
        parts = item.get("content") or item.get("summary") or []
        text = "".join(part.get("text", "") for part in parts if isinstance(part, dict))
        if turn is not None and turn.get("reasoning") is None and turn.get("content") is None:
            turn["reasoning"] = text
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": text})
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
            raise ValueError(f"{where} must look like {{'type': 'function_call', 'call_id': ..., 'name': ..., "
                             "'arguments': '<json>'}} (strings)")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        if turn is not None:
            turn.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ValueError(f"{where}.call_id must be the call_id of the function_call it answers")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text_of(f"{where}.output", item.get("output"))})
    elif kind == "item_reference":
        raise ValueError(f"{where}: an item_reference needs stored items, and microvllm stores none: send the "
                         "item itself")
    else:
        raise ValueError(f"{where} has type {kind!r}: give a message ({{'role': ..., 'content': ...}}), "
                         "reasoning, function_call or function_call_output item")


def _text_of(where: str, content) -> str:
    """A message's content: a string, or text parts joined (as the chat path joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts ({{'type': 'input_text', 'text': ...}})")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ValueError(f"{where}[{index}] has type {kind!r}: only text parts (input_text, output_text) are "
                             "supported; these models read no images, files or audio")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{index}] is a text part without a string 'text': add the text")
        texts.append(part["text"])
    return "\n".join(texts)
