"""Records one ``StepTrace`` per step of a Scheduler (the engine's, when ``trace=True``,
or the model-free driver behind ``microvllm.viz.demo_trace``).

It needs only the scheduler and its KV cache manager: it reads the plan, the
step's results and a snapshot of the block pool taken at the end of the step,
and never changes their state::

    plan = scheduler.schedule()
    scheduled = tracer.begin(plan)          # the plan's requests, before the model runs
    ... run the model, scheduler.update_from_output(...) ...
    tracer.record(plan, scheduled, core_outputs, stopped)
"""

from __future__ import annotations

from microvllm.core.kv_cache_spec import SlidingWindowSpec
from microvllm.trace import RequestStep, StepTrace, TraceSink, short_hash, step_kind


class StepTracer:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        windows = [s.sliding_window for s in manager.kv_cache_groups if isinstance(s, SlidingWindowSpec)]
        self.sink = TraceSink(
            block_size=manager.block_size, num_blocks=pool.num_blocks,
            max_num_batched_tokens=scheduler.max_num_batched_tokens, max_num_seqs=scheduler.max_num_seqs,
            kv_cache_groups=["sliding_window" if isinstance(s, SlidingWindowSpec) else "full_attention"
                             for s in manager.kv_cache_groups],
            sliding_window=windows[0] if windows else None, null_block_id=pool.null_block.block_id)

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
        requests = self.scheduler.requests
        scheduled = []
        for data, is_new in [(d, True) for d in plan.scheduled_new_reqs] + \
                            [(d, False) for d in plan.scheduled_cached_reqs]:
            rid, n = data.req_id, plan.num_scheduled_tokens[data.req_id]
            request = requests[rid]
            scheduled.append(RequestStep(
                request_id=rid, num_scheduled_tokens=n,
                kind=step_kind(data.num_computed_tokens, n, request.num_tokens,
                               request.num_output_tokens, is_new),
                num_computed_tokens_before=data.num_computed_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                prefix_hit_tokens=plan.num_prefix_hit_tokens.get(rid) if is_new else None,
                is_new=is_new))
        return scheduled

    def record(self, plan, scheduled: list[RequestStep], core_outputs, stopped: list[str],
               step: int | None = None) -> None:
        """Append the step's record. ``stopped``: ids finished after ``update_from_output``
        (stop strings); ``step``: the step's number, by default one past the last record."""
        if step is None:
            step = self.trace.steps[-1].step + 1 if self.trace.steps else 0
        scheduler, manager = self.scheduler, self.scheduler.kv_cache_manager
        pool = manager.block_pool
        new_tokens = {o.request_id: list(o.new_token_ids) for o in core_outputs if o.new_token_ids}
        finished = {o.request_id: o.finish_reason for o in core_outputs if o.finish_reason}
        finished.update({rid: "stop" for rid in stopped})
        self.sink.record(StepTrace(
            step=step, token_budget=scheduler.max_num_batched_tokens,
            max_num_seqs=scheduler.max_num_seqs, scheduled=scheduled,
            preempted=sorted(plan.preempted_req_ids), finished=list(finished),
            finish_reasons=finished, waiting=[r.request_id for r in scheduler.waiting],
            block_tables={r.request_id: [list(g) for g in manager.get_block_ids(r.request_id)]
                          for r in scheduler.running},
            ref_cnts=[b.ref_cnt for b in pool.blocks],
            block_hashes=[short_hash(b.block_hash) if b.block_hash is not None else None
                          for b in pool.blocks],
            free=[b.ref_cnt == 0 and not b.is_null for b in pool.blocks],
            num_free_blocks=pool.get_num_free_blocks(),
            new_tokens=new_tokens))
