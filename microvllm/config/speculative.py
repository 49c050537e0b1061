"""``SpeculativeConfig``: how drafts are proposed for the target to check (vLLM:
``vllm/config/speculative.py``). Given as vLLM takes it, a dict::

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    LLM(speculative_config={"method": "draft_model", "model": "path/to/small-model",
                            "num_speculative_tokens": 4})
    LLM(speculative_config={"method": "layer_skip", "num_draft_layers": 8,
                            "num_speculative_tokens": 4})

    method          who proposes the k draft tokens of each request, each step
      ngram           prompt lookup: the tokens that followed the last time the request's
                      own last n tokens appeared (no model at all)
      draft_model     a smaller model with the same vocabulary (its own KV cache)
      layer_skip      a self-draft: the target's first ``num_draft_layers`` layers, then its
                      final norm and LM head (LayerSkip / self-speculative decoding). The
                      draft's layers are the target's, so it shares the target's KV cache
    num_speculative_tokens   k: drafts per request per step (the target checks k + 1
                             positions in one forward)
    disable_by_batch_size    no drafts in a step of at least this many requests (vLLM's
                             name): a large batch already amortizes the weights' read, so
                             drafts there cost more than they save (notebook 14, §7)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "layer_skip")
# vLLM's other methods, named as such when asked for (each needs trained draft heads).
VLLM_ONLY_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix",
                     "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A resolved ``speculative_config`` (see the module docstring); frozen."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None      # ngram: shortest suffix looked up
    prompt_lookup_max: int | None = None      # ngram: longest suffix looked up (tried first)
    model: str | None = None                  # draft_model: the draft's folder
    num_draft_layers: int | None = None       # layer_skip: the target's first N layers
    disable_by_batch_size: int | None = None  # no drafts in steps with this many requests or more

    @property
    def uses_draft_model(self) -> bool:
        return self.method in ("draft_model", "layer_skip")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots to hold beyond this step's tokens: a draft model writes the KV of its k
        drafts (all but the last) before the scheduler has allocated them (vLLM: the
        same name); n-gram drafts need none."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    @classmethod
    def from_dict(cls, options: dict | str, num_target_layers: int | None = None) -> "SpeculativeConfig":
        """Check a user's ``speculative_config`` (a dict, or its JSON text from the command
        line) and fill its defaults as vLLM does; every error says what to change."""
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config={options!r} is not valid JSON ({error}): write e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(options, dict):
            raise TypeError(f"speculative_config={options!r} must be a dict such as "
                            '{"method": "ngram", "num_speculative_tokens": 4}')
        options = dict(options)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}: microvllm knows {sorted(known)}")
        method = options.get("method")
        if method is None:   # vLLM infers the method from the draft model
            method = "draft_model" if options.get("model") else None
        if method in VLLM_ONLY_METHODS:
            raise ValueError(f"speculative_config method {method!r} is a vLLM method that microvllm does not "
                             f"implement (it needs trained draft heads): use one of {METHODS}")
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r}: choose one of {METHODS}")
        options["method"] = method
        k = options.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r}: give the number of draft "
                             "tokens per step, an int >= 1 (4 is a good start)")
        limit = options.get("disable_by_batch_size")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 2):
            raise ValueError(f"speculative_config disable_by_batch_size={limit!r}: give a batch size >= 2 "
                             "from which on steps go without drafts, or leave it out")
        if method == "ngram":
            low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
            if low is None and high is None:
                low = high = 5      # vLLM's defaults
            low = high if low is None else low
            high = low if high is None else high
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
            assert isinstance(low, int) and isinstance(high, int)
            if low > high:
                raise ValueError(f"speculative_config prompt_lookup_min={low} > prompt_lookup_max={high}: "
                                 "the shortest suffix looked up cannot be longer than the longest")
            options.update(prompt_lookup_min=low, prompt_lookup_max=high)
        elif any(options.get(name) is not None for name in ("prompt_lookup_min", "prompt_lookup_max")):
            raise ValueError(f"prompt_lookup_min / prompt_lookup_max belong to method 'ngram', not {method!r}")
        if method == "draft_model" and not options.get("model"):
            raise ValueError('speculative_config method "draft_model" needs "model": the folder of a smaller '
                             'model with the target\'s vocabulary (or use "layer_skip" to draft with the '
                             "target's own first layers)")
        if method == "layer_skip":
            n = options.get("num_draft_layers")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config num_draft_layers={n!r}: give how many of the target's "
                                 "first layers draft, an int >= 1")
            if num_target_layers is not None and n >= num_target_layers:
                raise ValueError(f"speculative_config num_draft_layers={n} must be below the target's "
                                 f"{num_target_layers} layers (a draft as deep as the target saves nothing)")
        elif options.get("num_draft_layers") is not None:
            raise ValueError(f"num_draft_layers belongs to method 'layer_skip', not {method!r}")
        if method != "draft_model" and options.get("model") is not None:
            raise ValueError(f"speculative_config model= is for method 'draft_model', not {method!r}")
        return cls(**options)
