"""Records one ``StepTrace`` per engine step (only when ``trace=True``).

It reads the plan, the step's results and a snapshot of the block pool taken at
the end of the step; it never changes engine state.
"""

from __future__ import annotations

from microvllm.trace import RequestStep, StepTrace, TraceSink, short_hash, step_kind


class StepTracer:
    def __init__(self, engine):
        self.engine = engine
        config, layout = engine.config, engine.executor.kv_cache_layout
        windows = [g.sliding_window for g in layout.groups if g.sliding_window]
        self.sink = TraceSink(
            block_size=config.block_size, num_blocks=config.num_kv_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            kv_cache_groups=[g.kind for g in layout.groups],
            sliding_window=windows[0] if windows else None)

    @property
    def trace(self):
        return self.sink.trace

    def add_prompt(self, request_id: str, text: str | None) -> None:
        if text is not None:
            self.trace.prompts[request_id] = text

    def begin(self, plan) -> list[RequestStep]:
        """Describe the plan's requests as they are before the model runs."""
        requests = self.engine.scheduler.requests
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

    def record(self, plan, scheduled: list[RequestStep], core_outputs, stopped: list[str]) -> None:
        engine = self.engine
        scheduler, pool = engine.scheduler, engine.kv_cache_manager.block_pool
        new_tokens = {o.request_id: list(o.new_token_ids) for o in core_outputs if o.new_token_ids}
        finished = {o.request_id: o.finish_reason for o in core_outputs if o.finish_reason}
        finished.update({rid: "stop" for rid in stopped})
        manager = engine.kv_cache_manager
        self.sink.record(StepTrace(
            step=engine.num_steps, token_budget=engine.config.max_num_batched_tokens,
            max_num_seqs=engine.config.max_num_seqs, scheduled=scheduled,
            preempted=sorted(plan.preempted_req_ids), finished=list(finished),
            finish_reasons=finished, waiting=[r.request_id for r in scheduler.waiting],
            block_tables={r.request_id: [list(g) for g in manager.get_block_ids(r.request_id)]
                          for r in scheduler.running},
            ref_cnts=[b.ref_cnt for b in pool.blocks],
            block_hashes=[short_hash(b.block_hash) if b.block_hash is not None else None
                          for b in pool.blocks],
            free=[b.ref_cnt == 0 and b.block_id != 0 for b in pool.blocks],
            num_free_blocks=pool.get_num_free_blocks(),
            new_tokens=new_tokens))
