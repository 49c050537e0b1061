"""The OpenAI API's request bodies as pydantic models (vLLM: ``entrypoints/openai/protocol.py``).

Each request model turns itself into ``SamplingParams`` (``to_sampling_params``);
the OpenAI fields come first, then vLLM's extra fields (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``logit_bias``, ``allowed_token_ids``, ...), which the
``openai`` client sends through ``extra_body``. ``SamplingParams`` and the engine do
every range check, so their message (which starts with the field's name) becomes the
HTTP 400's message.

Nothing is silently ignored (``check_supported``):

    honoured                    every field declared below
    refused with a 400          fields of features microvllm does not have (yet):
                                ``REFUSED`` names each with the reason
    unknown to both APIs        logged as ignored (vLLM logs them the same way)
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from microvllm.distributed.kv_transfer.kv_transfer_params import check_kv_transfer_params
from microvllm.sampling_params import SamplingParams, StructuredOutputsParams

# Fields of the OpenAI API or of vLLM's server that name a feature microvllm lacks.
REFUSED = {
    "functions": "(OpenAI's deprecated function calling) is not supported: use tools",
    "function_call": "(OpenAI's deprecated function calling) is not supported: use tool_choice",
    "suffix": "is not supported (fill-in-the-middle prompts; vLLM refuses it too): remove it",
    "best_of": "(generate several, return the best) is not implemented: use n, or remove it",
    "logits_processors": "(code in a request) is not accepted: remove it",
    "modalities": "audio output is not supported: remove it",
    "audio": "audio output is not supported: remove it",
    "prediction": "predicted outputs are not supported: remove it",
}
# vLLM's older names for structured outputs, still sent by older clients.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Values of refused fields that mean "off": a client that sends them asks for nothing.
_OFF_VALUES = (None, [], {}, "none", "auto", {"type": "text"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="allow")   # kept so that check_supported can name them

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                      # OpenAI's end-user id: recorded nowhere
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Disaggregated prefill (vLLM's NIXL protocol, what vllm-router sends): do_remote_decode
    # asks a prefill instance to keep the KV; do_remote_prefill tells a decode instance
    # where to read it (distributed/kv_transfer/kv_connector/p2p_connector.py).
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("*")
    @classmethod
    def _integers_fit_64_bits(cls, value, info):
        # JSON has integers of any size; the engine's wire format (msgpack) and its tensors
        # have 64 bits. A larger one anywhere in a field is the client's mistake: a 400
        # naming the field, not a 500 when the request is sent to the core.
        check_int64(value, info.field_name)
        return value

    @field_validator("kv_transfer_params")
    @classmethod
    def _well_formed_kv_transfer_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Untrusted input that steers a KV transfer: known keys, types, lengths, ranges.
        return None if value is None else check_kv_transfer_params(value)

    def check_supported(self) -> list[str]:
        """Raise ``ValueError`` for a field of a feature microvllm lacks (naming it);
        return the names of fields neither API knows (the caller logs them)."""
        extra = dict(self.model_extra or {})
        declared = {f: getattr(self, f, None) for f in REFUSED if f in type(self).model_fields}
        for name, value in {**extra, **declared}.items():
            if name in REFUSED and not _is_off(value):
                raise ValueError(f"{name} {REFUSED[name]}")
        return sorted(name for name in extra if name not in REFUSED)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the output must match: ``structured_outputs``, vLLM's older ``guided_*``
        fields, or (chat) ``response_format`` and a required tool call; at most one."""
        given = {}
        if self.structured_outputs is not None:
            unknown = sorted(set(self.structured_outputs) - set(StructuredOutputsParams.__slots__))
            if unknown:
                raise ValueError(f"structured_outputs has no field {', '.join(map(repr, unknown))}: give one of "
                                 f"{', '.join(StructuredOutputsParams.KINDS)} (and, for JSON, "
                                 "disable_any_whitespace)")
            try:
                given["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as error:
                raise ValueError(f"structured_outputs: {error}") from None
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given[name] = StructuredOutputsParams(**{kind: getattr(self, name)})
        given.update(self._more_structured_outputs())
        if len(given) > 1:
            raise ValueError(f"{sorted(given)[0]}: give one constraint, not {len(given)}: {', '.join(sorted(given))}")
        return next(iter(given.values()), None)

    def _more_structured_outputs(self) -> dict[str, StructuredOutputsParams]:
        return {}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = dict(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_outputs_params(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            extra_args=({"kv_transfer_params": self.kv_transfer_params}
                        if self.kv_transfer_params is not None else None))
        return SamplingParams(**values)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_int64(value, field: str) -> None:
    """``ValueError`` naming ``field`` if any integer in ``value`` (a list or dict of any
    depth, walked with an explicit stack) is outside 64 bits."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= INT64_MAX:
                shown = str(item) if len(str(item)) <= 24 else f"{str(item)[:20]}... ({len(str(item))} digits)"
                raise ValueError(f"{shown} in {field} is outside the 64-bit integer range "
                                 f"[{INT64_MIN}, {INT64_MAX}]: send a smaller number")
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _is_off(value) -> bool:
    return any(value == off for off in _OFF_VALUES)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of
    token ids, or a list of those. ``echo`` puts the prompt before the completion (with
    ``logprobs``, the prompt's logprobs too; ``max_tokens=0`` then scores the prompt
    alone, as lm-eval's loglikelihood tasks do)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs   # echo's logprobs cover the prompt too
        scoring_only = self.max_tokens == 0
        if scoring_only and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it is only allowed with echo=true "
                             "(to score the prompt); ask for at least 1 token")
        params = self._sampling_params(1 if scoring_only else self.max_tokens, self.logprobs)
        if prompt_logprobs is not None:
            params = params.clone(prompt_logprobs=prompt_logprobs)
        return params

    def prompts(self) -> list:
        """Every prompt of the request, as the engine takes them."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": list(prompt)}]
        return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


class ChatMessage(BaseModel):
    """One message; ``content`` may be null for an assistant message with ``tool_calls``."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None              # OpenAI's older name
    max_completion_tokens: int | None = None   # OpenAI's newer name; wins if both are given
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # false: one call at most (vLLM's rule: the first call only; a required array holds one)
    parallel_tool_calls: bool | None = True
    response_format: dict[str, Any] | None = None
    # Set by the server, never by the body: started with --enable-auto-tool-choice (and the
    # --tool-call-parser class, whose structural tag holds strict tools to their schemas).
    _auto_tool_choice: bool = PrivateAttr(default=False)
    _tool_parser: Any = PrivateAttr(default=None)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """As for any request; and, with nothing else asked for, ``tool_choice="auto"`` with
        a ``strict`` tool: the tool parser's structural tag (free text, but a call the
        model starts must be a valid call of one of the tools)."""
        given = super().structured_outputs_params()
        if (given is None and self.parses_tool_calls() and self._tool_parser is not None
                and any((tool.get("function") or {}).get("strict") is True for tool in self.tools or [])):
            tag = self._tool_parser.structural_tag(self.functions())
            if tag is not None:
                return StructuredOutputsParams(structural_tag=tag)
        return given

    def _more_structured_outputs(self) -> dict[str, StructuredOutputsParams]:
        given = {}
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            given["response_format"] = StructuredOutputsParams(json_object=True)
        elif kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format: json_schema needs {'json_schema': {'name': ..., "
                                 "'schema': {...}}}")
            given["response_format"] = StructuredOutputsParams(json=schema)
        elif kind != "text":
            raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
        schema = self.tool_call_schema()
        if schema is not None:
            given["tool_choice"] = StructuredOutputsParams(json=schema)
        return given

    def called_function(self) -> str | None:
        """The function ``tool_choice`` names (``{"type": "function", "function": {"name": ...}}``)."""
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if not isinstance(name, str):
                raise ValueError("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}")
            return name
        return None

    def enable_auto_tool_choice(self, tool_parser: type | None = None) -> None:
        """The server parses tool calls in the model's own format (``--enable-auto-tool-choice``)
        with ``tool_parser`` (its class)."""
        self._auto_tool_choice, self._tool_parser = True, tool_parser

    def parses_tool_calls(self) -> bool:
        """The model may call tools itself and a tool parser reads its calls."""
        return self._auto_tool_choice and bool(self.tools) and self.tool_choice in (None, "auto")

    def functions(self) -> dict[str, dict]:
        """The tools' functions: name -> parameters schema (``ValueError`` for a malformed tool)."""
        functions = {}
        for index, tool in enumerate(self.tools or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ..., "
                                 "'parameters': {...}}}}")
            functions[function["name"]] = function.get("parameters") or {"type": "object"}
        return functions

    def tool_call_schema(self) -> dict | None:
        """The JSON schema the output must follow when a tool call is required (vLLM's way:
        structured outputs): a named function's parameters, or for ``"required"`` a list
        of ``{"name", "parameters"}`` objects, one of the tools each (one object only with
        ``parallel_tool_calls: false``). None otherwise;
        ``"auto"`` with tools: None with ``--enable-auto-tool-choice`` (a tool parser reads
        the model's own format), else refused."""
        if self.tool_choice in (None, "none", "auto") and not self.tools:
            return None
        if self.tool_choice == "none":
            return None
        functions = self.functions()
        if not functions:
            raise ValueError(f"tool_choice={self.tool_choice!r} needs tools: list the functions in tools")
        if self.tool_choice in (None, "auto"):
            if self._auto_tool_choice:
                return None   # the model writes calls in its own format; the tool parser reads them
            raise ValueError("tool_choice='auto' (the default with tools) needs a parser for this model's own "
                             "tool-call format: start the server with --enable-auto-tool-choice "
                             "--tool-call-parser NAME, or use tool_choice='required' or name a function (the "
                             "output is then constrained to the tools' JSON schemas)")
        name = self.called_function()
        if name is not None:
            if name not in functions:
                raise ValueError(f"tool_choice names {name!r}, which is not in tools ({', '.join(functions)})")
            return functions[name]
        if self.tool_choice != "required":
            raise ValueError(f"tool_choice={self.tool_choice!r} is not none, auto, required or a named function")
        calls = {"type": "array", "minItems": 1,
                 "items": {"anyOf": [{"type": "object", "properties": {
                     "name": {"type": "string", "enum": [name]}, "parameters": parameters},
                     "required": ["name", "parameters"]} for name, parameters in functions.items()]}}
        if self.parallel_tool_calls is False:
            calls["maxItems"] = 1   # the model stops after one call instead of writing calls nobody gets
        return calls

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true: set logprobs to true, or remove top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered with the template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "microvllm"
    root: str | None = None
    parent: str | None = None   # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's; ``lora_int_id`` accepted and not needed)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
