"""The step trace: what the engine decided at every step, recorded for the step explorer.

One `StepTrace` per `Engine.step()`; a `Trace` is the list of them plus the run's
settings. The engine builds a record only when tracing is on (it holds a
`TraceSink`, or None), so tracing off costs nothing. The format is plain data:
it round-trips through JSON, so a trace recorded once can be replayed by the
plots in `microvllm.viz` on any machine, without the model.

What one record holds, and *when* it is taken::

    Engine.step()
      Scheduler.schedule()         -> scheduled, preempted, waiting   (the plan)
      run the model, sample        -> new_tokens
      update_from_output()         -> finished (their blocks are freed here)
      snapshot of the block pool   -> block_tables, ref_cnts, block_hashes, free

So the block-pool fields describe the pool at the END of the step: a request that
finished in this step no longer holds blocks (they are free, and if full, still
cached); `block_tables` lists the requests still running.

Per physical block b (the pool has `num_blocks` blocks; block 0 is the null block,
never allocated, standing in where a sliding window released a block)::

    ref_cnts[b]      how many running requests hold b (0 for a free block)
    block_hashes[b]  short hex of b's prefix-cache hash if b is full and cached
    free[b]          b is in the free queue (ref count 0; may still be cached)

and what the pool did DURING the step (sorted block ids; one block can be in both,
e.g. freed by a preemption or a sliding window and handed out again at once)::

    allocated_blocks  left the free queue: fresh blocks, or cached free blocks revived
                      by a prefix-cache hit (ref count 0 -> 1)
    freed_blocks      joined the free queue (ref count -> 0): a request finished, was
                      preempted, or its sliding window moved past the block

(the null block reports ref count 0, no hash, free=False). `Trace.check_consistency`
states these rules as code. "step" arguments elsewhere are indices into
`Trace.steps`; `StepTrace.step` is the engine's own step counter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

TRACE_FORMAT = "microvllm-trace"
TRACE_VERSION = 1
KINDS = ("prefill", "decode")


@dataclass
class RequestStep:
    """One request's share of one step's batch.

    ``kind`` is "decode" when the step computes exactly the request's one newest
    (sampled) token, and "prefill" while it is still computing tokens it already
    knows: the prompt, or prompt + outputs after a preemption (see `step_kind`).
    ``prefix_hit_tokens`` is set only on the step the request was admitted or
    resumed (``is_new``): how many of its tokens came from the prefix cache.
    """

    request_id: str
    num_scheduled_tokens: int
    kind: str
    num_computed_tokens_before: int
    num_prompt_tokens: int
    prefix_hit_tokens: int | None = None
    is_new: bool = False
    # Speculative decoding: draft tokens among num_scheduled_tokens (checked after the
    # newest token), and how many of them the target accepted (None: no drafts).
    num_draft_tokens: int = 0
    num_accepted_tokens: int | None = None
    lora_name: str | None = None   # the LoRA adapter its tokens ran with (None: the base model)


@dataclass
class StepTrace:
    """Everything the step explorer shows for one engine step (see module docstring)."""

    step: int
    token_budget: int
    max_num_seqs: int
    scheduled: list[RequestStep] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)
    block_tables: dict[str, list[list[int]]] = field(default_factory=dict)
    ref_cnts: list[int] = field(default_factory=list)
    block_hashes: list[str | None] = field(default_factory=list)
    # The cache group whose prefix cache holds each block's hash (-1: no hash): a
    # hybrid's free cached blocks are KV blocks or state snapshots.
    block_cache_groups: list[int] = field(default_factory=list)
    free: list[bool] = field(default_factory=list)
    # KV connectors (notebook 19), each request id -> the blocks (first cache group) it holds
    # outside the running requests' tables: waiting for its KV to load
    # (WAITING_FOR_REMOTE_KVS), loaded and held until admitted ("pinned"), finished and held
    # until its KV is saved or sent (a delayed free). And the blocks the worker loaded
    # into the pool and saved out of it this step.
    kv_loading: dict[str, list[int]] = field(default_factory=dict)
    kv_pinned: dict[str, list[int]] = field(default_factory=dict)
    kv_sending: dict[str, list[int]] = field(default_factory=dict)
    kv_blocks_loaded: int = 0
    kv_blocks_saved: int = 0
    num_free_blocks: int = 0
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    allocated_blocks: list[int] = field(default_factory=list)
    freed_blocks: list[int] = field(default_factory=list)
    # Structured outputs: the fraction of the vocabulary each constrained request was
    # allowed to sample this step (its grammar's token mask), by request id.
    allowed_fraction: dict[str, float] = field(default_factory=dict)
    # Mixtures of experts: for each MoE layer (its decoder layer index, as a string), how many
    # (token, expert) pairs its router sent to each expert this step.
    expert_load: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)

    def owners(self, num_blocks: int | None = None) -> list[list[str]]:
        """For each physical block, the ids of the running requests holding it."""
        owners: list[list[str]] = [[] for _ in range(num_blocks or len(self.ref_cnts))]
        for request_id, groups in self.block_tables.items():
            for table in groups:
                for block_id in table:
                    if request_id not in owners[block_id]:
                        owners[block_id].append(request_id)
        for held in (self.kv_loading, self.kv_pinned, self.kv_sending):   # a KV connector's holders
            for request_id, blocks in held.items():
                for block_id in blocks:
                    if block_id and request_id not in owners[block_id]:
                        owners[block_id].append(request_id)
        return owners

    def state_pages(self, kv_cache_groups: list[str]) -> set[int]:
        """Blocks holding a linear-attention state (``mamba`` groups): held by a request's
        state group, or free but cached as a state snapshot."""
        state_groups = {g for g, kind in enumerate(kv_cache_groups) if kind == "mamba"}
        if not state_groups:
            return set()
        pages = {b for groups in self.block_tables.values() for g, table in enumerate(groups)
                 if g in state_groups for b in table}
        pages |= {b for b, g in enumerate(self.block_cache_groups) if g in state_groups}
        pages.discard(0)
        return pages


@dataclass
class Trace:
    """A recorded run: the engine's settings plus one `StepTrace` per step."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_groups: list[str] = field(default_factory=lambda: ["full_attention"])
    sliding_window: int | None = None
    null_block_id: int = 0
    prompts: dict[str, str] = field(default_factory=dict)
    steps: list[StepTrace] = field(default_factory=list)
    # When each request arrived: the number of the first step that could schedule it
    # (online serving: requests arrive over time; steps, not seconds, so that a trace
    # stays deterministic).
    arrival_steps: dict[str, int] = field(default_factory=dict)

    # -- a sequence of steps ------------------------------------------------
    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index):
        return self.steps[index]

    def __iter__(self) -> Iterator[StepTrace]:
        return iter(self.steps)

    # -- queries used by the plots --------------------------------------------
    def request_ids(self) -> list[str]:
        """Every request id, in order of first appearance (then prompts-only ids)."""
        seen: dict[str, None] = {}
        for s in self.steps:
            for rid in [r.request_id for r in s.scheduled] + list(s.block_tables) + (
                s.preempted + s.finished + s.waiting
            ):
                seen.setdefault(rid, None)
        for rid in self.prompts:
            seen.setdefault(rid, None)
        return list(seen)

    def first_token_steps(self) -> dict[str, int]:
        """The step at which each request got its first new token (its time to first token,
        in steps, is this minus its arrival step)."""
        first: dict[str, int] = {}
        for s in self.steps:
            for rid in s.new_tokens:
                first.setdefault(rid, s.step)
        return first

    def owner_of_blocks(self, step: int) -> list[list[str]]:
        """For each physical block at step *index* `step`, the request ids holding it."""
        return self.steps[step].owners(self.num_blocks)

    def preemption_steps(self) -> list[int]:
        """Indices of the steps in which at least one request was preempted."""
        return [i for i, s in enumerate(self.steps) if s.preempted]

    # -- JSON ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, **dataclasses.asdict(self)}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: object) -> "Trace":
        if not isinstance(data, dict):
            raise ValueError(f"trace: expected a JSON object, got {type(data).__name__}")
        data = dict(data)
        fmt, version = data.pop("format", TRACE_FORMAT), data.pop("version", TRACE_VERSION)
        if fmt != TRACE_FORMAT:
            raise ValueError(f"trace: 'format' is {fmt!r}, expected {TRACE_FORMAT!r}")
        if version != TRACE_VERSION:
            raise ValueError(f"trace: version {version!r} is not supported (this code reads {TRACE_VERSION})")
        trace = _decode(cls, data, "trace")
        trace.check_structure()
        return trace

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace: not valid JSON ({e}); was the file cut short?") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(Path(path).read_text())

    # -- checks -------------------------------------------------------------
    def check_structure(self) -> None:
        """Raise ValueError if the trace cannot be drawn (lengths, ids in range)."""
        n, groups = self.num_blocks, len(self.kv_cache_groups)
        if self.block_size <= 0 or n <= 0 or groups == 0:
            raise ValueError("trace: block_size and num_blocks must be > 0 and kv_cache_groups non-empty")
        if not 0 <= self.null_block_id < n:
            raise ValueError(f"trace: null_block_id {self.null_block_id} is not a block id below num_blocks={n}")
        previous = None
        for i, s in enumerate(self.steps):
            where = f"trace.steps[{i}] (step {s.step})"
            if previous is not None and s.step <= previous:
                raise ValueError(f"{where}: step numbers must increase, previous was {previous}")
            previous = s.step
            for name in ("ref_cnts", "block_hashes", "free"):
                if len(getattr(s, name)) != n:
                    raise ValueError(f"{where}: {name} has {len(getattr(s, name))} entries, expected num_blocks={n}")
            for r in s.scheduled:
                if r.kind not in KINDS:
                    raise ValueError(f"{where}: request {r.request_id!r} has kind {r.kind!r}, expected one of {KINDS}")
            for rid, tables in s.block_tables.items():
                if len(tables) != groups:
                    raise ValueError(f"{where}: request {rid!r} has {len(tables)} block tables, "
                                     f"expected one per kv_cache_group ({groups})")
                bad = [b for t in tables for b in t if not 0 <= b < n]
                if bad:
                    raise ValueError(f"{where}: request {rid!r} holds block ids {bad} outside 0..{n - 1}")

    def check_consistency(self) -> None:
        """Raise ValueError at the first step whose block accounting does not add up.

        Meant for engine tests: every trace the engine records must pass.
        """
        self.check_structure()
        null = self.null_block_id
        for s in self.steps:
            where = f"step {s.step}"
            holders = [0] * self.num_blocks
            for tables in s.block_tables.values():
                for table in tables:
                    for b in table:
                        holders[b] += 1
            for b in range(self.num_blocks):
                if b == null:
                    if s.free[b] or s.ref_cnts[b]:
                        raise ValueError(f"{where}: the null block {b} must never be free or counted")
                    continue
                if s.ref_cnts[b] != holders[b]:
                    raise ValueError(f"{where}: block {b} has ref count {s.ref_cnts[b]} but "
                                     f"{holders[b]} block tables hold it")
                if s.free[b] != (s.ref_cnts[b] == 0):
                    raise ValueError(f"{where}: block {b} has ref count {s.ref_cnts[b]} and "
                                     f"free={s.free[b]}: a block is free exactly when nobody holds it")
            if s.num_free_blocks != sum(s.free):
                raise ValueError(f"{where}: num_free_blocks={s.num_free_blocks} but {sum(s.free)} blocks are free")
            if s.num_scheduled_tokens > s.token_budget:
                raise ValueError(f"{where}: {s.num_scheduled_tokens} tokens scheduled, "
                                 f"over the budget {s.token_budget}")
            if len(s.scheduled) > s.max_num_seqs:
                raise ValueError(f"{where}: {len(s.scheduled)} requests scheduled, over max_num_seqs={s.max_num_seqs}")
            for r in s.scheduled:
                if r.kind == "decode" and r.num_scheduled_tokens - r.num_draft_tokens != 1:
                    raise ValueError(f"{where}: request {r.request_id!r} is a decode of "
                                     f"{r.num_scheduled_tokens - r.num_draft_tokens} tokens (+ "
                                     f"{r.num_draft_tokens} drafts); a decode computes exactly 1")
                if r.num_accepted_tokens is not None and not 0 <= r.num_accepted_tokens <= r.num_draft_tokens:
                    raise ValueError(f"{where}: request {r.request_id!r} accepted {r.num_accepted_tokens} "
                                     f"of {r.num_draft_tokens} drafts")


class TraceSink:
    """Where the engine records its steps when tracing is on.

    The engine holds ``trace_sink = TraceSink(...)`` or ``None``; with None it never
    builds a `StepTrace`, so tracing off costs nothing::

        if self.trace_sink is not None:
            self.trace_sink.record(StepTrace(...))
    """

    def __init__(self, **settings) -> None:
        self.trace = Trace(**settings)

    def record(self, step: StepTrace) -> None:
        self.trace.steps.append(step)


def step_kind(num_computed_tokens_before: int, num_scheduled_tokens: int, num_tokens: int,
              num_output_tokens: int, is_new: bool) -> str:
    """"decode" if this step computes exactly the newest sampled token, else "prefill".

    ``num_tokens`` counts prompt + outputs. A request resumed after preemption
    recomputes its known tokens, so its first step back is a prefill even when only
    one token is left after prefix-cache hits.
    """
    is_decode = (not is_new and num_output_tokens > 0 and num_scheduled_tokens == 1
                 and num_computed_tokens_before == num_tokens - 1)
    return "decode" if is_decode else "prefill"


def short_hash(value: object, digits: int = 8) -> str:
    """A short hex label for a block hash (bytes, int, str or anything with a repr)."""
    if isinstance(value, bytes):
        return value.hex()[:digits]
    if isinstance(value, int):
        return format(value & (16**digits - 1), f"0{digits}x")
    return hashlib.sha256(repr(value).encode()).hexdigest()[:digits]


# -- JSON decoding with errors that name the field ------------------------------
def _decode(cls, data: object, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}: missing the field '{f.name}'")
    return cls(**kwargs)


def _convert(value: object, tp, where: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _decode(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, where)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return {k: _convert(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if not ok:
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value
