"""SamplingMetadata: one step's sampling parameters, as batched tensors.

The runner computes logits for a batch; row i belongs to the i-th request of this
step. The sampler must treat every row by its own request's rules without a Python
loop over rows, so the per-request ``SamplingParams`` become one column each::

    request        A (greedy)   B (t=0.8, top_k=50)   C (t=1.0, top_p=0.9, seed=7)
    row            0            1                     2
    temperature    [0.0,        0.8,                  1.0]
    top_k          [0,          50,                   0  ]   (0 = off)
    top_p          [1.0,        1.0,                  0.9]   (1.0 = off)
    generators     {                                  2: C's own torch.Generator}
    presence_penalties / frequency_penalties / repetition_penalties: one column each
                   (0 / 0 / 1 = off), with each row's prompt and output token ids

A filter whose column is all "off" is left out (None) so that the sampler skips it.

Built fresh every step with ``SamplingMetadata.from_params`` (cheap: a few small
tensors). The per-request generators are *not* rebuilt: each seeded request owns
one for its whole life (create it with ``make_generator(params.seed)`` when the
request arrives), so its random stream continues from step to step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from microvllm.sample.logits_processors import bad_words_banned_ids
from microvllm.sampling_params import SamplingParams


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A random generator on ``device``, seeded with ``seed`` (None: a random seed)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplingMetadata:
    """Everything the sampler needs about the rows of one step's logits.

    ``temperature`` is 0.0 on greedy rows (temperature 0 or top_k 1); the sampler
    takes the argmax there. ``all_greedy`` / ``all_random`` let it skip work.
    ``generators`` maps a row to its request's own generator (seeded, non-greedy
    rows only); every other random row uses the sampler's shared generator.
    ``max_num_logprobs`` is the largest ``logprobs`` asked for in the batch (None:
    nobody asked). ``min_tokens_banned_ids`` maps a row that has produced fewer than
    ``min_tokens`` tokens to the ids it must not sample yet (eos, stop_token_ids).
    The penalty columns are None when no row has a penalty; otherwise
    ``prompt_token_ids`` / ``output_token_ids`` hold each row's token history.
    """

    temperature: torch.Tensor                  # [num_reqs] float32
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None                 # [num_reqs] int64, 0 = off
    top_p: torch.Tensor | None                 # [num_reqs] float32, 1.0 = off
    min_p: torch.Tensor | None                 # [num_reqs] float32, 0.0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    min_tokens_banned_ids: dict[int, set[int]] = field(default_factory=dict)
    presence_penalties: torch.Tensor | None = None   # [num_reqs] float32, 0.0 = off
    frequency_penalties: torch.Tensor | None = None  # [num_reqs] float32, 0.0 = off
    repetition_penalties: torch.Tensor | None = None  # [num_reqs] float32, 1.0 = off
    prompt_token_ids: list[list[int]] | None = None
    output_token_ids: list[list[int]] | None = None
    # Sparse per-row rules (sample/logits_processors.py); empty when no row has one.
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    bad_words_banned_ids: dict[int, set[int]] = field(default_factory=dict)
    # Structured outputs: row grammar_rows[i] may sample only what bitmask row i allows
    # (structured_output/bitmask.py). Applied after the raw logprobs are taken, as every
    # rule above is: logprobs describe the model, not the grammar.
    grammar_bitmask: torch.Tensor | None = None      # [len(grammar_rows), words] int32
    grammar_rows: list[int] = field(default_factory=list)

    @classmethod
    def from_params(cls, params: list[SamplingParams],
                    generators: list[torch.Generator | None] | None = None, *,
                    num_output_tokens: list[int] | None = None,
                    eos_token_ids: set[int] | frozenset[int] = frozenset(),
                    token_ids: list[list[int]] | None = None,
                    num_prompt_tokens: list[int] | None = None,
                    grammar_bitmask: torch.Tensor | None = None,
                    grammar_rows: list[int] | None = None,
                    device: str | torch.device = "cpu") -> "SamplingMetadata":
        """Batch the parameters of this step's requests, in row order.

        generators[i]: request i's own generator (None if it has no seed).
        num_output_tokens[i]: tokens request i has generated so far (for min_tokens).
        eos_token_ids: the model's eos ids, banned with stop_token_ids before min_tokens
            (unless the request sets ignore_eos).
        token_ids[i], num_prompt_tokens[i]: request i's prompt + output ids so far and
            where its prompt ends (read only when a request has a penalty).
        grammar_bitmask, grammar_rows: the step's token bitmask of the structured rows
            and which row each of its rows masks (the engine's ``plan.grammar_bitmask``).
        """
        num_reqs = len(params)
        generators = generators if generators is not None else [None] * num_reqs
        if len(generators) != num_reqs:
            raise ValueError(f"got {len(generators)} generators for {num_reqs} requests: "
                             "pass one per request, None for requests without a seed")
        greedy = [p.greedy for p in params]
        temperature = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        random_params = [p for p, g in zip(params, greedy) if not g]

        def column(values: list, off_value, dtype: torch.dtype) -> torch.Tensor | None:
            # Leave the filter out when no random row uses it.
            if all(value == off_value for value, g in zip(values, greedy) if not g):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        banned: dict[int, set[int]] = {}
        if num_output_tokens is not None:
            for row, (p, num_tokens) in enumerate(zip(params, num_output_tokens)):
                if num_tokens < p.min_tokens:
                    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                    if ids:
                        banned[row] = ids

        penalties = {}
        if any(p.has_penalties for p in params):
            if token_ids is None or num_prompt_tokens is None:
                raise ValueError("a request has a presence, frequency or repetition penalty: pass "
                                 "token_ids= and num_prompt_tokens= (each request's history)")
            # Penalties apply to greedy rows too, so every row gets its value here.
            penalties = dict(
                presence_penalties=torch.tensor([float(p.presence_penalty) for p in params], device=device),
                frequency_penalties=torch.tensor([float(p.frequency_penalty) for p in params], device=device),
                repetition_penalties=torch.tensor([float(p.repetition_penalty) for p in params],
                                                  device=device),
                prompt_token_ids=[ids[:n] for ids, n in zip(token_ids, num_prompt_tokens)],
                output_token_ids=[ids[n:] for ids, n in zip(token_ids, num_prompt_tokens)])

        bad_words = {}
        if token_ids is not None and num_prompt_tokens is not None:
            for row, (p, ids, n) in enumerate(zip(params, token_ids, num_prompt_tokens)):
                if getattr(p, "bad_words_token_ids", None):
                    bad_words[row] = bad_words_banned_ids(p.bad_words_token_ids, ids[n:])

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            all_greedy=not random_params,
            all_random=not any(greedy),
            top_k=column([p.top_k for p in params], 0, torch.int64),
            top_p=column([float(p.top_p) for p in params], 1.0, torch.float32),
            min_p=column([float(p.min_p) for p in params], 0.0, torch.float32),
            generators={row: g for row, g in enumerate(generators)
                        if g is not None and not greedy[row]},
            max_num_logprobs=max(asked) if asked else None,
            min_tokens_banned_ids=banned,
            **penalties,
            logit_bias={row: p.logit_bias for row, p in enumerate(params) if getattr(p, "logit_bias", None)},
            allowed_token_ids={row: p.allowed_token_ids for row, p in enumerate(params)
                               if getattr(p, "allowed_token_ids", None) is not None},
            bad_words_banned_ids={row: ids for row, ids in bad_words.items() if ids},
            grammar_bitmask=grammar_bitmask,
            grammar_rows=list(grammar_rows or ()),
        )

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    def to(self, device: torch.device | str) -> "SamplingMetadata":
        """A copy whose tensors are on ``device`` (the generators stay: each is made on
        the device it draws for). Returns ``self`` when nothing moves."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)
                 and getattr(self, f.name).device != torch.device(device)}
        return dataclasses.replace(self, **moved) if moved else self
