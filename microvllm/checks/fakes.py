"""Stand-ins the checkers drive the learner's code with: no model anywhere.

- ``make_request``: a ``Request`` with duck-typed sampling params (what the scheduler reads).
- ``ShadowKVCache``: what the runner's KV tensor would hold, as a dict
  ``(block id, slot) -> (token id, position)``; every key a query attends to is read back,
  so a wrong block table, a wrong prefix hit or a block handed to two requests at once
  shows up as a wrong read.
- ``FakeRunner``: plays the model runner against a ``SchedulerOutput`` and "samples"
  deterministic tokens (``feeder_token``), so reruns and recomputes agree.
- ``make_scheduler`` / ``run_steps``: the step loop, checking the token budget,
  ``max_num_seqs`` and ``check_invariants()`` after every schedule and update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microvllm.core import (
    FullAttentionSpec,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SlidingWindowSpec,
)


@dataclass
class FakeSamplingParams:
    """The fields the scheduler reads from SamplingParams."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


def make_request(request_id: str, prompt: list[int], block_size: int, *, eos_token_id: int | None = None,
                 cache_salt: str | None = None, **params) -> Request:
    return Request(request_id, prompt, FakeSamplingParams(**params), eos_token_id=eos_token_id,
                   block_size=block_size, cache_salt=cache_salt)


def first_needed_position(spec: KVCacheSpec, position: int) -> int:
    """The oldest key a query at ``position`` reads."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, position - spec.sliding_window + 1)
    return 0


class ShadowKVCache:
    """What the runner's KV tensor would hold: (block_id, slot) -> (token_id, position)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.states: dict[int, list[int]] = {}   # state page -> the tokens its state summarises

    def write(self, block_id: int, position: int, token_id: int) -> None:
        assert block_id != 0, f"position {position} is written into the null block"
        self.slots[(block_id, position % self.block_size)] = (token_id, position)

    def check_read(self, block_id: int, position: int, token_id: int, what: str) -> None:
        assert block_id != 0, f"{what}: key at position {position} is needed but its block is null"
        got = self.slots.get((block_id, position % self.block_size))
        assert got == (token_id, position), (
            f"{what}: block {block_id} slot {position % self.block_size} holds (token, position) "
            f"{got}, expected token {token_id} at position {position}: that block was handed out "
            "with the wrong content (a wrong prefix hit, or one block given to two requests)")

    def compute(self, groups: list[KVCacheSpec], block_tables, token_ids: list[int], start: int, num: int,
                what: str) -> None:
        """Write KV for positions start..start+num-1, then check every key they attend to."""
        bs = self.block_size
        for group_id, spec in enumerate(groups):
            table = block_tables[group_id]
            if isinstance(spec, MambaSpec):
                self.advance_state(table, token_ids, start, num, f"{what} group {group_id}")
                continue
            assert len(table) * bs >= start + num, (
                f"{what}: group {group_id} has {len(table)} blocks of {bs} slots, too few for "
                f"positions up to {start + num - 1}")
            for pos in range(start, start + num):
                self.write(table[pos // bs], pos, token_ids[pos])
            for pos in range(start, start + num):
                for key in range(first_needed_position(spec, pos), pos + 1):
                    self.check_read(table[key // bs], key, token_ids[key], f"{what} group {group_id} q={pos}")


    def advance_state(self, table, token_ids: list[int], start: int, num: int, what: str) -> None:
        """A state group (``MambaSpec``): the page of block (start-1)//B must hold the state
        of exactly this request's first ``start`` tokens (a start of 0 reads nothing); the
        step then writes the state after each block boundary it crosses into that block's
        page, and the state after its last token into the last block's page."""
        bs = self.block_size
        assert len(table) * bs >= start + num, (
            f"{what}: {len(table)} state entries of {bs} tokens, too few for positions up to {start + num - 1}")
        if start > 0:
            page = table[(start - 1) // bs]
            assert page != 0, f"{what}: the state after {start} tokens is needed but its page is null"
            held = self.states.get(page)
            assert held == token_ids[:start], (
                f"{what}: page {page} should hold the state of this request's first {start} tokens but "
                f"holds that of {held}: the state was lost, a wrong snapshot was hit, or one page was "
                "given to two requests")
        end = start + num
        for boundary in [*range((start // bs + 1) * bs, end, bs), end]:
            page = table[(boundary - 1) // bs]
            assert page != 0, f"{what}: the state after {boundary} tokens is written into the null block"
            self.states[page] = token_ids[:boundary]


def feeder_token(request_id: str, position: int, vocab: int = 50) -> int:
    """A deterministic 'sampled' token, so reruns (and recomputes) agree."""
    return (sum(map(ord, request_id)) * 31 + position * 7) % vocab + 10


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass
class FakeRunner:
    """Plays the model runner against a SchedulerOutput: keeps its own request states
    (as vLLM's InputBatch does), writes and reads the shadow KV, samples."""

    groups: list[KVCacheSpec]
    block_size: int
    shadow: ShadowKVCache = None
    states: dict[str, _RunnerRequest] = field(default_factory=dict)
    sample = staticmethod(feeder_token)

    def __post_init__(self):
        self.shadow = ShadowKVCache(self.block_size)

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.states.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, (
                f"request {new.req_id!r} was sent to the runner as new while it still runs")
            self.states[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                [list(ids) for ids in new.block_ids], new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens, (
                f"request {cached.req_id!r}: the plan says num_computed_tokens="
                f"{cached.num_computed_tokens} but the runner has computed {state.num_computed_tokens}")
            for table, ids in zip(state.block_ids, cached.new_block_ids):
                table.extend(ids)
        sampled = {}
        for rid, num in out.num_scheduled_tokens.items():
            state = self.states[rid]
            start = state.num_computed_tokens
            assert num >= 1 and start + num <= len(state.token_ids), (
                f"request {rid!r}: {num} tokens scheduled from position {start}, but it has only "
                f"{len(state.token_ids)} tokens (at least 1, at most the tokens not yet computed)")
            self.shadow.compute(self.groups, state.block_ids, state.token_ids, start, num, f"request {rid}")
            state.num_computed_tokens += num
            if state.num_computed_tokens == len(state.token_ids):
                token = self.sample(rid, len(state.token_ids))
                state.token_ids.append(token)
                sampled[rid] = [token]
        return sampled


def make_scheduler(groups=None, *, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=256, enable_chunked_prefill=True, enable_caching=True,
                   scheduler_class=Scheduler, kv_cache_manager_class=KVCacheManager):
    groups = groups if groups is not None else [FullAttentionSpec(block_size)]
    kv = kv_cache_manager_class(groups, num_blocks, block_size, enable_caching)
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill)
    return scheduler_class(config, kv), FakeRunner(groups, block_size)


@dataclass
class StepRecord:
    output: SchedulerOutput
    engine_outputs: list


def run_steps(scheduler, runner: FakeRunner, max_steps: int = 1000, until_done: bool = True,
              num_steps: int | None = None) -> list[StepRecord]:
    """Drive schedule -> runner -> update_from_output, checking limits and invariants every step."""
    records = []
    config = scheduler.scheduler_config
    for _ in range(num_steps if num_steps is not None else max_steps):
        if until_done and not scheduler.has_unfinished_requests():
            return records
        out = scheduler.schedule()
        scheduler.check_invariants()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()), (
            f"total_num_scheduled_tokens is {out.total_num_scheduled_tokens} but the requests' "
            f"tokens add up to {sum(out.num_scheduled_tokens.values())}")
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens, (
            f"the step scheduled {out.total_num_scheduled_tokens} tokens "
            f"({dict(out.num_scheduled_tokens)}) but the token budget max_num_batched_tokens is "
            f"{config.max_num_batched_tokens}")
        assert len(out.num_scheduled_tokens) <= config.max_num_seqs, (
            f"the step scheduled {len(out.num_scheduled_tokens)} requests but max_num_seqs is "
            f"{config.max_num_seqs}")
        sampled = runner.execute(out)
        engine_outputs = scheduler.update_from_output(out, sampled)
        scheduler.check_invariants()
        records.append(StepRecord(out, engine_outputs))
    if until_done:
        assert not scheduler.has_unfinished_requests(), (
            f"requests {sorted(scheduler.requests)} are not done after {max_steps} steps: the "
            "scheduler stopped making progress")
    return records


def outputs_by_request(records: list[StepRecord]) -> dict[str, list]:
    result: dict[str, list] = {}
    for record in records:
        for output in record.engine_outputs:
            result.setdefault(output.request_id, []).append(output)
    return result
