"""AsyncScheduler: plan step N+1 while step N's forward runs (vLLM:
``vllm/v1/core/sched/async_scheduler.py``).

Without it, the engine core waits for each step's sampled tokens before it plans the
next, and the device idles while the scheduler thinks. With it, the core keeps two
plans in flight (``EngineCore.step_with_batch_queue``): it plans N+1 as soon as N is
sent off, so the scheduler's work hides behind N's forward.

Planning N+1 needs what N will produce. The scheduler does not know the token yet, so
it counts a *placeholder* for it: each request that samples in a plan gets
``num_output_placeholders += 1``, and ``_cap_new_tokens`` counts the placeholders as
tokens. The runner does know the token when N+1 runs (steps run in order, and the
runner appends each sampled token to its own copy of the request), so N+1 computes it::

    plan   request a (prompt 4)            num_tokens  computed  placeholders
    N      prefill 0..3 -> samples o0      4           0 -> 4    0 -> 1
    N+1    decode o0 (not known yet)       4           4 -> 5    1 -> 2   planned while N runs
           update(N): o0 arrives           5                     2 -> 1
    N+2    decode o1                       5           5 -> 6    1 -> 2   planned while N+1 runs

What it costs: a request that stops at N (EOS, a stop token) was already planned into
N+1; that row is computed and thrown away. A request whose ``max_tokens`` the steps in
flight already reach is not planned again (``_cap_new_tokens`` below).

A learner's scheduler runs under it unchanged: ``schedule()`` asks ``_cap_new_tokens``
how much each request may compute, and that is where the placeholders count
(``EngineCore`` puts this class in front of the learner's: ``with_async_scheduling``).
"""

from __future__ import annotations

from microvllm.core.request import Request
from microvllm.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """A scheduler whose plans may run ahead of the tokens they compute."""

    def _cap_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        # The steps in flight already take it to max_tokens or max_model_len: nothing more.
        pending, max_tokens = request.num_output_placeholders, request.max_tokens
        if pending and (request.num_tokens + pending >= self.max_model_len or (
                max_tokens is not None and request.num_output_tokens + pending >= max_tokens)):
            return 0
        return super()._cap_new_tokens(request, num_computed_tokens, token_budget)

    def _make_output(self, *args, **kwargs):
        output = super()._make_output(*args, **kwargs)
        for request_id in output.num_scheduled_tokens:
            request = self.requests[request_id]
            if not request.is_prefill_chunk:   # it samples in this plan: one token not known yet
                request.num_output_placeholders += 1
        return output

    def _sampled_this_step(self, request: Request, token_ids: list[int] | None) -> bool:
        # The request's state has moved on (a later plan advanced it, or preempted it):
        # the runner's answer says whether this step sampled for it.
        return bool(token_ids)


def with_async_scheduling(scheduler_class: type[Scheduler]) -> type[Scheduler]:
    """``scheduler_class`` with ``AsyncScheduler``'s overrides in front of it: the engine's
    own ``AsyncScheduler``, or the learner's ``schedule()`` under async scheduling."""
    if issubclass(scheduler_class, AsyncScheduler):
        return scheduler_class
    if scheduler_class is Scheduler:
        return AsyncScheduler
    return type(f"Async{scheduler_class.__name__}", (AsyncScheduler, scheduler_class), {})
