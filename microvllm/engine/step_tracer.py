"""Records one ``StepTrace`` per step of a Scheduler (the engine's, when ``trace=True``,
or the model-free driver behind ``microvllm.viz.demo_trace``).

It needs only the scheduler and its KV cache manager: it reads the plan, the
step's results and a snapshot of the block pool taken at the end of the step,
and never changes their state::

    plan = scheduler.schedule()
    scheduled = tracer.begin(plan)          # the plan's requests, before the model runs
    ... run the model, scheduler.update_from_output(...) ...
    tracer.record(plan, scheduled, core_outputs, stopped)

Blocks allocated and freed during the step are found by comparing three
snapshots of the block tables and ref counts (see `pool_changes`)::

    end of the previous step --schedule()--> after schedule --update_from_output()--> end of step
                  (window releases, preemptions, then      (finished requests free
                   allocations and prefix-cache hits)      their blocks: frees only)
"""

from __future__ import annotations

from microvllm.core.kv_cache_spec import SlidingWindowSpec
from microvllm.trace import RequestStep, StepTrace, TraceSink, short_hash, step_kind

Tables = dict[str, list[list[int]]]          # request id -> one block-id list per cache group


class StepTracer:
    def __init__(self, scheduler, vocab_size: int | None = None):
        self.scheduler = scheduler
        self.vocab_size = vocab_size   # for the share of the vocabulary a grammar mask allows
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        windows = [s.sliding_window for s in manager.kv_cache_groups if isinstance(s, SlidingWindowSpec)]
        self.sink = TraceSink(
            block_size=manager.block_size, num_blocks=pool.num_blocks,
            max_num_batched_tokens=scheduler.max_num_batched_tokens, max_num_seqs=scheduler.max_num_seqs,
            kv_cache_groups=[spec.kind for spec in manager.kv_cache_groups],
            sliding_window=windows[0] if windows else None, null_block_id=pool.null_block.block_id)
        self._after_schedule: tuple[Tables, list[int]] | None = None
        self._kv_moved = (0, 0)   # a KV connector's blocks loaded and saved, at the last record
        self._kv_moved_before = (0, 0)   # ... and at the one before it (redo_last)

    def _snapshot(self) -> tuple[Tables, list[int]]:
        """The running requests' block tables and every block's ref count, now."""
        manager = self.scheduler.kv_cache_manager
        tables = {r.request_id: [list(g) for g in manager.get_block_ids(r.request_id)]
                  for r in self.scheduler.running}
        return tables, [b.ref_cnt for b in manager.block_pool.blocks]

    @property
    def trace(self):
        return self.sink.trace

    def add_prompt(self, request_id: str, text: str | None) -> None:
        """A request arrived (called when it is added): its text and arrival step."""
        if text is not None:
            self.trace.prompts[request_id] = text
        steps = self.trace.steps
        self.trace.arrival_steps[request_id] = steps[-1].step + 1 if steps else 0

    def begin(self, plan) -> list[RequestStep]:
        """Describe the plan's requests as they are before the model runs."""
        self._after_schedule = self._snapshot()
        requests = self.scheduler.requests
        scheduled = []
        for data, is_new in [(d, True) for d in plan.scheduled_new_reqs] + \
                            [(d, False) for d in plan.scheduled_cached_reqs]:
            rid, n = data.req_id, plan.num_scheduled_tokens[data.req_id]
            request = requests[rid]
            num_drafts = len(plan.scheduled_spec_decode_tokens.get(rid, ()))
            scheduled.append(RequestStep(
                request_id=rid, num_scheduled_tokens=n, num_draft_tokens=num_drafts,
                kind=step_kind(data.num_computed_tokens, n - num_drafts, request.num_tokens,
                               request.num_output_tokens, is_new),
                num_computed_tokens_before=data.num_computed_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                prefix_hit_tokens=plan.num_prefix_hit_tokens.get(rid) if is_new else None,
                is_new=is_new, lora_name=getattr(request, "lora_name", None)))
        return scheduled

    def record(self, plan, scheduled: list[RequestStep], core_outputs, stopped: list[str],
               step: int | None = None, sampled_token_ids: dict[str, list[int]] | None = None,
               expert_load: dict[str, list[int]] | None = None) -> None:
        """Append the step's record. ``stopped``: ids finished after ``update_from_output``
        (stop strings); ``step``: the step's number, by default one past the last record;
        ``sampled_token_ids``: the runner's tokens (with drafts: the accepted ones + 1);
        ``expert_load``: the runner's per-expert counts of a mixture-of-experts model."""
        if step is None:
            step = self.trace.steps[-1].step + 1 if self.trace.steps else 0
        scheduler, manager = self.scheduler, self.scheduler.kv_cache_manager
        pool = manager.block_pool
        tables, ref_cnts = self._snapshot()
        before = (self.trace.steps[-1].block_tables, self.trace.steps[-1].ref_cnts) if self.trace.steps \
            else ({}, [0] * pool.num_blocks)
        allocated, freed = pool_changes(before, self._after_schedule or before, ref_cnts, pool.null_block.block_id)
        new_tokens = {o.request_id: list(o.new_token_ids) for o in core_outputs if o.new_token_ids}
        sampled = sampled_token_ids or {}
        for entry in scheduled:   # accepted drafts: every sampled token but the target's own last one
            if entry.num_draft_tokens and sampled.get(entry.request_id):
                entry.num_accepted_tokens = len(sampled[entry.request_id]) - 1
        finished = {o.request_id: o.finish_reason for o in core_outputs if o.finish_reason}
        finished.update({rid: "stop" for rid in stopped})
        self.sink.record(StepTrace(
            step=step, token_budget=scheduler.max_num_batched_tokens,
            max_num_seqs=scheduler.max_num_seqs, scheduled=scheduled,
            preempted=sorted(plan.preempted_req_ids), finished=list(finished),
            finish_reasons=finished, waiting=[r.request_id for r in scheduler.waiting],
            block_tables=tables, ref_cnts=ref_cnts,
            block_hashes=[short_hash(b.block_hash) if b.block_hash is not None else None
                          for b in pool.blocks],
            block_cache_groups=[b.kv_cache_group_id if b.block_hash is not None else -1 for b in pool.blocks],
            free=[b.ref_cnt == 0 and not b.is_null for b in pool.blocks],
            num_free_blocks=pool.get_num_free_blocks(),
            new_tokens=new_tokens, allocated_blocks=allocated, freed_blocks=freed,
            allowed_fraction=allowed_fractions(plan, self.vocab_size),
            expert_load=dict(expert_load or {}), **self._kv_connector_state()))

    def redo_last(self, *args, **kwargs) -> None:
        """Replace the last record with one made now, from the same arguments as
        ``record`` (more of its requests finished since: stop strings the front end found)."""
        popped = self.trace.steps.pop()
        self._kv_moved = self._kv_moved_before
        self.record(*args, **{"step": popped.step, **kwargs})

    def _kv_connector_state(self) -> dict:
        """What a KV connector holds now and moved this step (empty without one)."""
        scheduler, manager = self.scheduler, self.scheduler.kv_cache_manager
        connector = scheduler.connector
        if connector is None:
            return {}
        loaded, saved = getattr(connector, "num_blocks_loaded", 0), getattr(connector, "num_blocks_saved", 0)
        before = self._kv_moved_before = self._kv_moved
        self._kv_moved = (loaded, saved)
        return dict(
            kv_loading={rid: list(manager.get_block_ids(rid)[0]) for rid in scheduler.waiting_for_remote_kvs},
            kv_pinned={rid: list(blocks.get_block_ids()[0]) for rid, blocks in scheduler.kv_pinned.items()},
            kv_sending={rid: list(blocks.get_block_ids()[0]) for rid, blocks in scheduler.kv_sending.items()},
            kv_blocks_loaded=loaded - before[0], kv_blocks_saved=saved - before[1])


def pool_changes(before: tuple[Tables, list[int]], after_schedule: tuple[Tables, list[int]],
                 ref_cnts_at_end: list[int], null_block_id: int) -> tuple[list[int], list[int]]:
    """(allocated, freed) block ids of one step, from three snapshots (module docstring).

    An entry is (request, group, logical index) -> block. During schedule() every
    release (sliding window, preemption) happens before any prefix-cache hit takes
    a reference, and the pool hands out only free blocks, so:

        freed while scheduling  a block whose every entry before the step was dropped
        allocated               a block in a new entry that was free before the step
                                or was freed while scheduling
        freed at the end        in use after schedule(), free at the end (finished requests)
    """
    def entries(tables: Tables) -> set[tuple[str, int, int, int]]:
        return {(rid, g, j, b) for rid, groups in tables.items() for g, table in enumerate(groups)
                for j, b in enumerate(table) if b != null_block_id}

    (tables_before, ref_before), (tables_mid, ref_mid) = before, after_schedule
    old, mid = entries(tables_before), entries(tables_mid)
    kept = {e[3] for e in old & mid}
    freed = {e[3] for e in old - mid} - kept
    allocated = {e[3] for e in mid - old if ref_before[e[3]] == 0 or e[3] in freed}
    freed |= {b for b, (n_mid, n_end) in enumerate(zip(ref_mid, ref_cnts_at_end)) if n_mid > 0 and n_end == 0}
    return sorted(allocated), sorted(freed)


def allowed_fraction_of(bitmask, vocab_size: int) -> list[float]:
    """Per row of a grammar bitmask: the fraction of the vocabulary it allows."""
    from microvllm.structured_output.bitmask import unpack

    return [round(float(row.float().mean()), 6) for row in unpack(bitmask, vocab_size)]


def allowed_fractions(plan, vocab_size: int | None) -> dict[str, float]:
    if plan.grammar_bitmask is None:
        return {}
    vocab = vocab_size or plan.grammar_bitmask.shape[-1] * 32
    return dict(zip(plan.structured_output_request_ids, allowed_fraction_of(plan.grammar_bitmask, vocab)))
