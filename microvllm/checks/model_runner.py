"""Checks for exercise 07 (model runner), part 2: ``ModelRunner._prepare_inputs``.

The runner is driven through its public ``execute_model(plan)`` with a fake model that
records the flat inputs it is given and "predicts" the index of each row, so the token
sampled for a request tells which row its logits came from. The checks do not care in which order
the runner lays out the requests (vLLM puts decodes first), only that every request's
rows are contiguous and right.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from microvllm.checks.report import (
    Case,
    CheckFailure,
    CheckResult,
    expect,
    expect_equal,
    property_settings,
    run_checks,
    run_property,
)
from microvllm.checks.slot_mapping import B, _slots
from microvllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from microvllm.sampling_params import SamplingParams
from microvllm.worker.model_runner import ModelInputs

_RESUMED_RULE = ("a request resumed after preemption arrives as a new request whose NewRequestData carries its "
                 "prompt and output tokens, recomputed in chunks: sample only when a chunk reaches "
                 "len(state.token_ids) (every known token), not the prompt's length; check_prepare_inputs tests it")
# Crashes of the engine cell with the learner's runner: (pattern in the error, what to change).
MODEL_RUNNER_HINTS = [
    (r"no sampled token for request", "the runner must sample for every request whose chunk reaches its last "
                                      "known token; " + _RESUMED_RULE),
]


def runner_hint(trace, wrong: list[str]) -> str:
    """What to look at when the engine cell's tokens differ for the prompts ``wrong``."""
    preempted = {request_id for step in (trace or []) for request_id in step.preempted}
    if wrong and set(wrong) <= preempted:
        return f"prompt{'s' if len(wrong) > 1 else ''} {', '.join(wrong)} {'were' if len(wrong) > 1 else 'was'} " \
               f"preempted and resumed: {_RESUMED_RULE}"
    return ("every row must come from its own request: input_ids, positions and the sampling rows "
            "(check_prepare_inputs shows which)")


class RecordingModel:
    """A stand-in model: records the flat inputs; the hidden state of row t of step s
    "predicts" token s * ROWS + t, so every sampled token is new and names its row."""

    ROWS = 1024

    def __init__(self, num_groups: int, vocab_size: int = 16 * 1024):
        self.layout = SimpleNamespace(num_groups=num_groups)
        self.vocab_size = vocab_size
        self.calls: list[dict] = []

    def __call__(self, input_ids, positions, kv_caches, metadata):
        self.calls.append(dict(input_ids=input_ids.tolist(), positions=positions.tolist(),
                               metadata=[_snapshot(m) for m in metadata]))
        return torch.arange(len(input_ids), dtype=torch.float32)[:, None]

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        step = len(self.calls) - 1
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].long() + step * self.ROWS] = 1.0
        return logits


def _snapshot(m) -> dict:
    return dict(num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                max_seq_len=m.max_seq_len, query_start_loc=m.query_start_loc.tolist(),
                seq_lens=m.seq_lens.tolist(), block_table=m.block_table.tolist(),
                slot_mapping=m.slot_mapping.tolist(), num_decodes=getattr(m, "num_decodes", None),
                dtypes={name: str(getattr(m, name).dtype).removeprefix("torch.")
                        for name in ("query_start_loc", "seq_lens")})


class _Plan:
    """Builds SchedulerOutputs step by step and remembers what the runner should know."""

    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.next_block = 1
        self.known: set[str] = set()
        self.num_prompt: dict[str, int] = {}

    def add(self, req_id: str, prompt_len: int, index: int, num_outputs: int = 0):
        """A request of ``prompt_len`` prompt tokens; ``num_outputs`` > 0: one resumed after
        preemption, whose NewRequestData carries the tokens it had generated before it."""
        self.tokens[req_id] = [index * 1_000_000 + i for i in range(prompt_len + num_outputs)]
        self.num_prompt[req_id] = prompt_len
        self.computed[req_id] = 0
        self.blocks[req_id] = [[] for _ in range(self.num_groups)]

    def step(self, scheduled: dict[str, int], hits: dict[str, int] | None = None):
        hits = hits or {}
        new, cached = [], []
        for req_id, num in scheduled.items():
            start = self.computed[req_id] + hits.get(req_id, 0)
            self.computed[req_id] = start
            needed = -(-(start + num) // B)
            fresh = []
            for group in self.blocks[req_id]:
                added = list(range(self.next_block, self.next_block + needed - len(group)))
                self.next_block += len(added)
                group.extend(added)
                fresh.append(tuple(added))
            if req_id in self.known:
                cached.append(CachedRequestData(req_id, tuple(fresh), start))
            else:
                prompt_len = self.num_prompt[req_id]
                new.append(NewRequestData(req_id, tuple(self.tokens[req_id][:prompt_len]),
                                          tuple(self.tokens[req_id][prompt_len:]), SamplingParams(temperature=0.0),
                                          tuple(tuple(g) for g in self.blocks[req_id]), start))
                self.known.add(req_id)
        return SchedulerOutput(tuple(new), tuple(cached), dict(scheduled), sum(scheduled.values()))

    def advance(self, scheduled: dict[str, int], sampled: dict[str, list[int]]):
        for req_id, num in scheduled.items():
            self.computed[req_id] += num
            if req_id in sampled:
                self.tokens[req_id].append(sampled[req_id][0])


def check_prepare_inputs(runner_class, *, max_examples: int = 30, quiet: bool = False) -> CheckResult:
    """Check ``_prepare_inputs`` of a ``ModelRunner`` subclass, through ``execute_model``."""

    def make(num_groups: int):
        model = RecordingModel(num_groups)
        runner = runner_class(model, [], block_size=B, max_num_seqs=8, max_num_batched_tokens=128,
                              max_model_len=96, eos_token_ids=set(), seed=0)
        runner._prepare_inputs = _returns_model_inputs(runner._prepare_inputs)
        return model, runner

    def run_step(model, runner, plan: _Plan, scheduled: dict[str, int], hits=None, story: str = ""):
        out = plan.step(scheduled, hits)
        result = runner.execute_model(out)
        call = model.calls[-1]
        sampled = {r: [t[0] % RecordingModel.ROWS] for r, t in result.sampled_token_ids.items()}
        _compare(plan, scheduled, call, sampled, story)
        plan.advance(scheduled, result.sampled_token_ids)

    def single_prefill():
        model, runner = make(1)
        plan = _Plan(1)
        plan.add("a", 5, 1)
        run_step(model, runner, plan, {"a": 5}, story="a new request, 5 prompt tokens")

    def prefix_hit():
        model, runner = make(1)
        plan = _Plan(1)
        plan.add("a", 11, 1)
        run_step(model, runner, plan, {"a": 3}, hits={"a": 8},
                 story="a new request of 11 tokens whose first 8 are prefix-cache hits (num_computed_tokens=8)")

    def chunks_then_decodes():
        model, runner = make(1)
        plan = _Plan(1)
        plan.add("a", 10, 1)
        story = "a 10-token prompt in chunks of 4, 4, 2, then two decodes"
        for num in (4, 4, 2, 1, 1):
            run_step(model, runner, plan, {"a": num}, story=story)

    def mixed_batch():
        model, runner = make(1)
        plan = _Plan(1)
        for index, (req_id, length) in enumerate((("b", 6), ("c", 3), ("a", 14))):
            plan.add(req_id, length, index + 1)
        run_step(model, runner, plan, {"b": 6, "c": 3}, story="b, c prefill")
        run_step(model, runner, plan, {"b": 1, "a": 4, "c": 1}, hits={"a": 8},
                 story="then a 4-token chunk of a (8 cached, 14 tokens: no sample yet) with b, c decoding")
        run_step(model, runner, plan, {"a": 2, "b": 1}, story="a's last chunk and b's decode")

    def resumed_after_preemption():
        model, runner = make(1)
        plan = _Plan(1)
        plan.add("a", 6, 1, num_outputs=5)
        story = ("request 'a' resumed after preemption: its NewRequestData carries 6 prompt tokens and the 5 "
                 "output tokens it had generated (11 known tokens), recomputed in chunks of 4, 4, 3, then a decode")
        for num in (4, 4, 3, 1):
            run_step(model, runner, plan, {"a": num}, story=story)

    def two_cache_groups():
        model, runner = make(2)
        plan = _Plan(2)
        plan.add("a", 7, 1)
        plan.add("b", 2, 2)
        run_step(model, runner, plan, {"a": 7, "b": 2}, story="two cache groups (each its own block table)")
        run_step(model, runner, plan, {"a": 1, "b": 1}, story="then a decode step")

    def random_steps():
        from hypothesis import given, strategies as st

        @property_settings(max_examples)
        @given(st.integers(1, 2), st.randoms(use_true_random=False))
        def test(num_groups, rng: random.Random):
            model, runner = make(num_groups)
            plan = _Plan(num_groups)
            lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 5))]
            # Some resumed after preemption: they arrive with the output tokens they had generated.
            outputs = [rng.randint(1, 10) if rng.random() < 0.3 else 0 for _ in lengths]
            names = [f"r{i}" for i in range(len(lengths))]
            for index, (name, length, num_outputs) in enumerate(zip(names, lengths, outputs)):
                plan.add(name, length, index + 1, num_outputs)
            story = (f"{len(names)} requests with prompts of {lengths} tokens (resumed with {outputs} output "
                     f"tokens), random chunks, {num_groups} group(s)")
            first = {}
            for _ in range(6):
                scheduled, hits = {}, {}
                for name in names:
                    left = len(plan.tokens[name]) - plan.computed[name]
                    if rng.random() < 0.2 or plan.computed[name] + left >= 90:
                        continue
                    if name not in first and left > B and rng.random() < 0.3:
                        hits[name] = B * rng.randint(1, (left - 1) // B)
                        left -= hits[name]
                    scheduled[name] = rng.randint(1, left)
                    first.setdefault(name, True)
                if scheduled:
                    run_step(model, runner, plan, scheduled, hits, story)

        run_property(test)

    cases = [
        Case("a single prompt", single_prefill),
        Case("a new request that starts after its prefix-cache hit", prefix_hit),
        Case("a prompt in chunks, then decodes", chunks_then_decodes),
        Case("a mixed batch: prefill chunks and decodes together", mixed_batch),
        Case("a request resumed after preemption: prompt + output tokens recomputed", resumed_after_preemption),
        Case("two cache groups get their own block tables and slots", two_cache_groups),
        Case(f"property: {max_examples} random multi-step schedules", random_steps),
    ]
    return run_checks("check_prepare_inputs", cases, quiet=quiet)


def _returns_model_inputs(prepare_inputs):
    """``prepare_inputs``, checked to return a ``ModelInputs`` before the runner uses it."""

    def checked(plan):
        inputs = prepare_inputs(plan)
        if type(inputs).__name__ == "ModelInputs" and not isinstance(inputs, ModelInputs):
            raise CheckFailure("_prepare_inputs returned a ModelInputs of another class of that name (its "
                               "module was imported or defined twice)",
                               hint="use microvllm.worker.model_runner.ModelInputs (the engine's), and do "
                                    "not redefine it or reload its module")
        expect(isinstance(inputs, ModelInputs),
               f"_prepare_inputs must return a ModelInputs, got a {type(inputs).__name__}",
               hint="end with return ModelInputs(req_ids=..., states=..., input_ids=..., positions=..., "
                    "attn_metadata=..., sampling_req_indices=..., logits_indices=...)")
        return inputs

    return checked


def _compare(plan: _Plan, scheduled: dict[str, int], call: dict, sampled: dict, story: str) -> None:
    input_ids, positions = call["input_ids"], call["positions"]
    total = sum(scheduled.values())
    where = f"{story}; this step schedules {scheduled}"
    expect_equal(len(input_ids), total, "input_ids must hold exactly the scheduled tokens", input=where,
                 hint="num_tokens = sum of num_scheduled_tokens over the batch")
    # Which request owns which rows: every token id is unique (prompts: 1_000_000 * k + i).
    owner_of = {t: r for r, tokens in plan.tokens.items() for t in tokens}
    for group_id, md in enumerate(call["metadata"]):
        qsl = md["query_start_loc"]
        expect(len(qsl) == len(scheduled) + 1 and qsl[0] == 0 and qsl[-1] == total,
               "query_start_loc must be [0, end of request 0, ..., num_tokens]", input=where, got=qsl,
               hint="the cumulative sum of the scheduled tokens, with a 0 in front")
        expect_equal(md["num_actual_tokens"], total, "num_actual_tokens", input=where)
        for name, dtype in md["dtypes"].items():   # the attention kernels index with int32
            expect_equal(dtype, "int32", f"{name} must be int32 (the contract's dtype)", input=where,
                         hint=f"build {name} with dtype=torch.int32: the attention kernels read it as int32")
        order = []
        for i in range(len(scheduled)):
            rows = input_ids[qsl[i]:qsl[i + 1]]
            owners = {owner_of.get(t) for t in rows}
            expect(len(owners) == 1 and None not in owners,
                   f"rows {qsl[i]}..{qsl[i + 1] - 1} must hold the tokens of one request",
                   input=where, got=f"input_ids {input_ids}",
                   hint="flatten request by request: each request's chunk is one contiguous run of rows")
            order.append(owners.pop())
        expect_equal(sorted(order), sorted(scheduled), "every scheduled request appears once", input=where)
        if md["num_decodes"] is not None:
            expect(all(scheduled[r] == 1 for r in order[:md["num_decodes"]]),
                   f"num_decodes={md['num_decodes']} but the first requests are not all decodes",
                   input=where, got=f"request order {order}")
        for i, req_id in enumerate(order):
            start, num = plan.computed[req_id], scheduled[req_id]
            rows = slice(qsl[i], qsl[i + 1])
            who = f"{where}; request {req_id!r} (rows {qsl[i]}..{qsl[i + 1] - 1}, num_computed_tokens={start})"
            expect_equal(qsl[i + 1] - qsl[i], num, "the request's number of rows", input=who)
            expect_equal(input_ids[rows], plan.tokens[req_id][start:start + num],
                         "input_ids: the tokens not yet computed", input=who,
                         hint="token_ids[num_computed_tokens : num_computed_tokens + num_scheduled]")
            expect_equal(positions[rows], list(range(start, start + num)), "positions", input=who,
                         hint="position of a row = the request's num_computed_tokens + its offset in the chunk")
            expect_equal(md["seq_lens"][i], start + num, "seq_lens: context length including this step",
                         input=who, hint="seq_len = num_computed_tokens + num_scheduled_tokens")
            table = plan.blocks[req_id][group_id]
            needed = -(-(start + num) // B)
            expect_equal(md["block_table"][i][:needed], table[:needed],
                         f"block table row of group {group_id}", input=who,
                         hint="gather each request's row of the persistent BlockTable, in batch order")
            expect_equal(md["slot_mapping"][rows], _slots(table, range(start, start + num)),
                         f"slot_mapping of group {group_id}", input=who,
                         hint="slot = block id of (position // block_size) * block_size + position % block_size")
        expect_equal(md["max_query_len"], max(scheduled.values()), "max_query_len", input=where)
        expect_equal(md["max_seq_len"], max(plan.computed[r] + n for r, n in scheduled.items()),
                     "max_seq_len", input=where)
    # The fake model predicts the index of the row it is given: the sampled token is the row.
    qsl, order = call["metadata"][0]["query_start_loc"], order
    for i, req_id in enumerate(order):
        seq_len, num_known = plan.computed[req_id] + scheduled[req_id], len(plan.tokens[req_id])
        num_prompt = plan.num_prompt[req_id]
        due = seq_len == num_known
        who = f"{where}; request {req_id!r}"
        # A resumed request knows more tokens than its prompt: comparing with the prompt's length
        # samples in the middle of the recomputed output (or not at its end).
        resumed = (f" The request was resumed after preemption: it knows {num_known} tokens ({num_prompt} prompt "
                   f"+ {num_known - num_prompt} output, all in state.token_ids); this chunk ends at token "
                   f"{seq_len}. Compare seq_len with len(state.token_ids), not with the prompt's length."
                   if num_known > num_prompt and seq_len >= num_prompt else "")
        if due:
            expect(req_id in sampled, "a request whose chunk reaches its last known token must sample",
                   input=who, hint="sample when seq_len == len(token_ids)." + resumed)
            expect_equal(sampled[req_id][0], qsl[i + 1] - 1,
                         "logits must come from the request's last row this step", input=who,
                         hint="logits_indices[i] = query_start_loc[i + 1] - 1")
        else:
            expect(req_id not in sampled, "a chunk that ends before the request's last known token must not "
                   "sample a token", input=who,
                   hint="only requests whose chunk reaches their last known token get logits." + resumed)
