"""SamplingParams: how one request chooses its tokens and when it stops.

Same names and defaults as ``vllm.SamplingParams``, so that
``SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64)`` means the same
thing in both. Every value is checked here, at construction, so that a mistake
surfaces as a message about the parameter, not as a NaN deep inside the sampler.

How the sampler uses them, per generated token::

    logits --penalties--> --/temperature--> --top_k--> --top_p--> --min_p--> softmax --> draw
                          (0 = greedy: argmax of the penalized logits, the other knobs ignored)

How the engine uses the rest: ``max_tokens`` / ``min_tokens`` / ``stop`` /
``stop_token_ids`` / ``ignore_eos`` decide when a request ends; ``seed`` gives the
request its own random generator; ``logprobs`` asks for the top-N log-probabilities
of every generated token, ``prompt_logprobs`` for those of every prompt token.
"""

from __future__ import annotations

import difflib
import enum
import math
import numbers

# Below this temperature vLLM samples greedily: dividing by ~0 would overflow.
SAMPLING_EPS = 1e-5

# vLLM options that microvllm does not implement, to say so instead of "unknown".
VLLM_ONLY_OPTIONS = ("best_of", "logits_processors", "guided_decoding", "detokenize",
                     "spaces_between_special_tokens")


class RequestOutputKind(enum.IntEnum):
    """What a streamed request yields each step (vLLM's ``vllm.sampling_params.RequestOutputKind``)."""

    CUMULATIVE = 0   # every output holds all the tokens and text so far
    DELTA = 1        # each output holds only what is new since the last one
    FINAL_ONLY = 2   # one output, when the request finishes


class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``); exactly one of:

    json: a JSON schema (a dict, or its JSON text): the output is a JSON value it validates.
    regex: the whole output matches this regular expression.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's GBNF dialect).
    json_object: True: the output is some JSON object.
    structural_tag: xgrammar's structural tag (a dict, or its JSON text): free text, except
        that after a trigger (``"<tool_call>"``) the output must be one of the tags it lists,
        each a fixed begin, content under a schema, a fixed end. ``tool_choice="auto"`` with
        ``strict`` tools uses one (``ToolParser.structural_tag``).
    disable_any_whitespace: JSON without free whitespace between tokens (one compact
        layout; keeps a weak model from wandering in spaces and newlines).
    """

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
    __slots__ = (*KINDS, "disable_any_whitespace")

    def __init__(self, json: dict | str | None = None, regex: str | None = None,
                 choice: list[str] | None = None, grammar: str | None = None,
                 json_object: bool | None = None, disable_any_whitespace: bool = False,
                 structural_tag: dict | str | None = None):
        self.json, self.regex, self.choice, self.grammar, self.json_object = json, regex, choice, grammar, json_object
        self.structural_tag = structural_tag
        self.disable_any_whitespace = bool(disable_any_whitespace)
        given = [name for name in self.KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {given or 'none'}")
        for name in ("json", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (dict, str)):
                raise TypeError(f"structured_outputs.{name} must be a JSON object (a dict or its text), "
                                f"got {type(getattr(self, name)).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), str)
                                                    or not getattr(self, name)):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise TypeError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which one was given: one of ``KINDS``."""
        return next(name for name in self.KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """What the backend compiles, as text (a schema or a choice list as JSON)."""
        import json as json_module

        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json_module.dumps(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and all(
            getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __repr__(self) -> str:
        return f"StructuredOutputsParams({self.kind}={getattr(self, self.kind)!r})"


class SamplingParams:
    """Sampling parameters of one request (vLLM's names and defaults; all but n by keyword).

    n: output sequences per prompt.
    temperature: logits are divided by it; 0 means greedy (always the most likely token).
    top_p: keep the smallest set of tokens whose probability adds up to at least top_p.
    top_k: keep the k most likely tokens; 0 (or -1) keeps all.
    min_p: drop tokens less likely than min_p times the most likely one.
    presence_penalty: subtracted from the logit of every token already generated
        (in [-2, 2]; > 0 favours new tokens, < 0 repetition).
    frequency_penalty: subtracted once per earlier occurrence in the output (in [-2, 2]).
    repetition_penalty: a logit of a token seen in the prompt or the output is divided
        by it if positive, multiplied if negative (> 1 discourages repeats; 1 is off).
    seed: gives the request its own random generator, so that its samples depend on
        nothing else in the batch.
    max_tokens: most tokens to generate (None: until the model's max_model_len).
    min_tokens: eos and stop_token_ids cannot be generated before this many tokens.
    stop: strings that end the output (not included unless include_stop_str_in_output).
    stop_token_ids: token ids that end the output, besides eos.
    ignore_eos: keep generating after eos.
    logprobs: return the log-probabilities of the top-N tokens at each step.
    prompt_logprobs: return the log-probabilities of each prompt token and the top-N
        there (the first prompt token has none: nothing predicts it). 0 is on, as in
        vLLM: each prompt token's own log-probability, with no alternatives; None is off.
    skip_special_tokens: leave special tokens (``<|im_end|>``) out of the text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    logit_bias: ``{token_id: bias}`` added to those logits before sampling (OpenAI's).
    allowed_token_ids: only these ids may be sampled.
    bad_words: words that must not be generated: the last token of each word's
        tokenization is banned wherever the output already ends with the others.
    truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last
        max_model_len - 1).
    structured_outputs: a ``StructuredOutputsParams``: the output must match a JSON
        schema, a regex, a grammar or one of several choices (constrained decoding).
    output_kind: what ``AsyncLLM.generate`` yields each step: CUMULATIVE (all the text
        so far) or DELTA (only the new tokens and text); FINAL_ONLY (the end only).
    extra_args: a dict for plugins (vLLM's): a KV connector reads ``kv_transfer_params``
        there (disaggregated prefill, ``distributed/kv_transfer/``).
    """

    FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
              "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
              "skip_special_tokens", "include_stop_str_in_output",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs",
              "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "output_kind",
              "structured_outputs", "extra_args")
    # bad_words_token_ids: the engine tokenizes bad_words at the door (it has the tokenizer).
    __slots__ = (*FIELDS, "bad_words_token_ids")

    def __init__(self, n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 max_tokens: int | None = 16, min_tokens: int = 0,
                 stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None,
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, prompt_logprobs: int | None = None,
                 logit_bias: dict[int, float] | None = None, allowed_token_ids: list[int] | None = None,
                 bad_words: list[str] | None = None, truncate_prompt_tokens: int | None = None,
                 output_kind: "RequestOutputKind | int" = 0,
                 structured_outputs: StructuredOutputsParams | None = None,
                 extra_args: dict | None = None, **unknown_kwargs):
        if unknown_kwargs:
            raise TypeError(_unknown_kwargs_message(unknown_kwargs))
        self.n = n
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.seed = seed
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop = _as_list("stop", stop, str)
        self.stop_token_ids = _as_list("stop_token_ids", stop_token_ids, int)
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        self.prompt_logprobs = prompt_logprobs
        # vLLM's extra_args: what a plugin reads (a KV connector: "kv_transfer_params").
        self.extra_args = extra_args
        self.logit_bias = _as_bias(logit_bias)
        self.allowed_token_ids = None if allowed_token_ids is None else _as_list(
            "allowed_token_ids", allowed_token_ids, int)
        self.bad_words = _as_list("bad_words", bad_words, str)
        self.truncate_prompt_tokens = truncate_prompt_tokens
        self.output_kind = RequestOutputKind(output_kind) if output_kind in set(RequestOutputKind) else output_kind
        self.structured_outputs = structured_outputs
        self.bad_words_token_ids: list[list[int]] = []
        self._verify()
        if self.top_k == -1:
            self.top_k = 0  # vLLM's older spelling of "off"; 0 is the one it uses now

    @property
    def greedy(self) -> bool:
        """True when sampling always takes the most likely token."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def _verify(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}: ask for 1 or more outputs")
        _check_number("temperature", self.temperature)
        if math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}: "
                             "use 0 for greedy decoding, 1.0 for the model's distribution")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:  # also False for NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}: "
                             "use 1.0 to keep every token, e.g. 0.9 to keep the top 90% of mass")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (or -1) to keep every token, or a positive count, "
                             f"got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}: "
                             "use 0 to turn it off, e.g. 0.05 to drop tokens 20x less likely than the best")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -2**63 <= self.seed < 2**64:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}: "
                                 "ask for 1 or more tokens (None means up to max_model_len)")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}: "
                             "lower min_tokens or raise max_tokens")
        for stop_string in self.stop:
            if not isinstance(stop_string, str):
                raise TypeError(f"stop must be a string or a list of strings, got an item "
                                f"{stop_string!r} of type {type(stop_string).__name__}")
            if stop_string == "":
                raise ValueError("stop contains an empty string, which would stop at once: "
                                 "remove it (stop=None means no stop strings)")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids item", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {token_id}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    raise ValueError(f"{name} must be >= 0 (how many top tokens to return), "
                                     f"got {value}: use None for no {name}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:  # also False for NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}: use 0 to turn it off")
        for token_id in self.allowed_token_ids if self.allowed_token_ids is not None else ():
            _check_int("allowed_token_ids item", token_id)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids is empty, so no token could be sampled: give at least "
                             "one id (None allows every token)")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias key", token_id)
            _check_number(f"logit_bias[{token_id}]", bias)
            if not -100 <= bias <= 100:  # also False for NaN
                raise ValueError(f"logit_bias[{token_id}]={bias} must be in [-100, 100] (OpenAI's range)")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be non-empty strings, got {word!r}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1 (keep the last k prompt tokens) "
                                 f"or -1 (the last max_model_len - 1), got {self.truncate_prompt_tokens}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams(json=... | regex=... | "
                            f"choice=[...] | grammar=... | json_object=True), got {self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                             f"got {self.output_kind!r}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty}: use 1.0 to turn it off, e.g. 1.2 to discourage repeats")

    @property
    def has_penalties(self) -> bool:
        """True when a penalty changes the logits (the sampler then needs the token history)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> "SamplingParams":
        """A validated copy, with ``changes`` applied (the engine gives each sample of an
        ``n > 1`` request ``clone(n=1, seed=seed + index)``)."""
        values = {name: getattr(self, name) for name in self.FIELDS}
        values = {**values, **changes}
        for name in ("stop", "stop_token_ids", "bad_words"):  # copies, not shared lists
            values[name] = list(values[name])
        clone = SamplingParams(values.pop("n"), **values)
        clone.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        return clone

    def verify(self) -> None:
        """Check every value again: raises if one was set to something invalid after
        construction (``params.temperature = -1``). The engine calls it at the door."""
        self._verify()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"SamplingParams({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.FIELDS)


def _as_list(name: str, value: object, item_type: type) -> list:
    """None -> [], one item -> [item], a list or tuple -> a list copy."""
    if value is None:
        return []
    if isinstance(value, item_type) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"{name} must be a {item_type.__name__} or a list of them, "
                    f"got {value!r} of type {type(value).__name__}")


def _as_bias(value: object) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (JSON keys are strings: ``{"50256": -100}``) -> ``{id: bias}``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias must be a dict {{token_id: bias}}, got {type(value).__name__}")
    bias = {}
    for key, item in value.items():
        if isinstance(key, str):
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias has a key {key!r} that is not a token id: keys are token ids")
            key = int(key)
        bias[key] = item
    return bias


def _check_int(name: str, value: object) -> None:
    # bool is a subclass of int in Python, but seed=True is a mistake, not a seed.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} of type {type(value).__name__}")


def _unknown_kwargs_message(unknown_kwargs: dict) -> str:
    name = next(iter(unknown_kwargs))
    if name in VLLM_ONLY_OPTIONS:
        hint = "a vLLM option that microvllm does not implement: remove it"
    else:
        close = difflib.get_close_matches(name, SamplingParams.FIELDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "check the spelling"
    return (f"SamplingParams got an unknown argument {name!r} ({hint}). "
            f"Valid arguments: {', '.join(SamplingParams.FIELDS)}")


# generation_config.json keys a model's authors set as its recommended sampling, and
# the SamplingParams field each becomes (vLLM reads the same ones).
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                          "max_new_tokens": "max_tokens"}


def default_sampling_params(folder) -> SamplingParams:
    """``SamplingParams`` with the values the folder's generation_config.json sets among
    ``GENERATION_CONFIG_KEYS``; vLLM's defaults for everything else (and with no file)."""
    import json
    from pathlib import Path

    path = Path(folder) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    values = {field: config[key] for key, field in GENERATION_CONFIG_KEYS.items()
              if config.get(key) is not None}
    return SamplingParams(**values)
