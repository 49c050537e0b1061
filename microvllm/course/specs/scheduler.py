"""Exercise 05: the scheduler's step."""

from microvllm.core.scheduler import Scheduler
from microvllm.course.exercise import Exercise, Part

EXERCISE = Exercise(
    number="05", slug="scheduler", title="The scheduler's step",
    lecture="05 · the scheduler and continuous batching",
    intro="""You write `Scheduler.schedule()`: one step's plan. One rule, no phases — every
request's `num_computed_tokens` catches up with its `num_tokens` under a token budget — gives
continuous batching, chunked prefill, mixed prefill + decode steps and preemption.""",
    setup="""
import microvllm.core.scheduler
from microvllm.core.kv_cache_manager import KVCacheBlocks, PoolTooSmallError
from microvllm.core.request import Request, RequestStatus
from microvllm.core.sched_output import SchedulerOutput
from microvllm.checks import check_scheduler, run_engine_with
""",
    parts=(Part(Scheduler, methods=("schedule",), intro="""Everything else is the engine's
`Scheduler`: use `self._cap_new_tokens`, `self._preempt`, `self._raise_stalled`,
`self._raise_no_progress` and `self._make_output` (read them with
`microvllm.core.scheduler.Scheduler._preempt??` and friends: the engine's class, imported
in the setup cell above)."""),),
    todos={
        "Scheduler.schedule": "schedule running requests (preempting the newest when allocate_slots "
                              "returns None), then waiting ones FCFS within the budget; "
                              "return self._make_output(...)",
    },
    contract="""
`schedule()` plans one step and returns `self._make_output(scheduled_new, scheduled_running,
new_blocks, num_scheduled_tokens, preempted, prefix_hits)` (which also advances
`num_computed_tokens`):

1. **Running requests first**, oldest first, while budget is left. Each gets
   `self._cap_new_tokens(request, request.num_computed_tokens, token_budget)` new tokens (0: skip
   it). Its slots come from `self.kv_cache_manager.allocate_slots(request, n)`; while that returns
   `None`, preempt the most recently admitted running request (`self.running.pop()`,
   `self._preempt(victim)`, remember it) and retry — if the victim is the request itself, stop
   scheduling running requests.
2. **Then waiting requests**, first come first served, only if nothing was preempted this step,
   while budget is left and `len(self.running) < self.max_num_seqs`: look up the prefix hit
   (`get_computed_blocks`); without chunked prefill a request whose remaining tokens exceed the
   budget waits (stop admitting); cap the new tokens from the hit on; `allocate_slots(request, n,
   num_hit_tokens, hit_blocks)` — `None` means the pool is full: stop admitting (no overtaking).
   An admitted request leaves `waiting`, joins `running` with status RUNNING and
   `num_computed_tokens = num_hit_tokens`; record `prefix_hits[id]`, and set
   `request.num_cached_tokens` to the hit on its first admission (while it is still -1).
3. Every scheduled request's tokens come out of `token_budget` and go into
   `num_scheduled_tokens[id]`; new blocks of running requests go into `new_blocks[id]`.
4. If nothing was scheduled and nothing preempted, never return an empty plan (the engine would
   spin): if requests run, `self._raise_stalled(self.running[0])` (a running request with nothing
   left to compute: its last step never delivered a token); else, if requests wait,
   `self._raise_no_progress(self.waiting[0])`.
""",
    hints=(
        """Read `schedule()`'s neighbours first: `_cap_new_tokens` already applies the budget and
`max_model_len`, `_preempt` frees the blocks and requeues the request at the front, `_make_output`
freezes the plan. `scheduled_running` is the running requests that got tokens, in `self.running`
order.""",
        """The shape of the preemption loop (the `...` are yours; the contract says whom to pick):
```python
blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
while blocks is None:
    victim = ...                       # which running request gives its blocks back?
    ...                                # preempt it, and remember it for the plan
    if victim is request:
        break
    blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
```
If `blocks` is still `None` after the loop, the request preempted itself: what happens to the
running requests after it this step?""",
        """Before you run this, predict each step's plan: why does `d` wait in step 0 although the budget
has room? Whom does step 1 preempt, and why that one? In step 5, `b` is preempted and frees 3 blocks,
and `d` needs only 2: why does `d` still not run?
```python
# Test case: paste it into a new cell and run it (it uses your Scheduler above)
from microvllm.checks.fakes import make_request, make_scheduler, run_steps
# 6 usable blocks of 4 tokens; four 8-token prompts (2 blocks each) that write 10 tokens each
scheduler, runner = make_scheduler(scheduler_class=Scheduler, num_blocks=7, max_num_batched_tokens=32)
for request_id in "abcd":
    scheduler.add_request(make_request(request_id, [ord(request_id)] * 8, 4, max_tokens=10))
plans = [record.output for record in run_steps(scheduler, runner, until_done=False, num_steps=6)]
scheduled = [dict(plan.num_scheduled_tokens) for plan in plans]
preempted = [sorted(plan.preempted_req_ids) for plan in plans]
assert scheduled == [{"a": 8, "b": 8, "c": 8}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1},
                     {"a": 1, "b": 1}, {"a": 1}], scheduled
assert preempted == [[], ["c"], [], [], [], ["b"]], preempted
```""",
    ),
    checks=("check_scheduler(Scheduler)",),
    engine_intro="""`components={"scheduler": Scheduler}` makes your `schedule()` plan every engine
step. Six prompts, a budget of 16 tokens (chunked prefill, mixed steps), 3 seats (queueing) and a
pool of 6 usable blocks (preemption, prefix hits): every plan is checked against `max_num_seqs` and
the budget before it runs, and must be the reference scheduler's, step by step — the same requests,
tokens, preemptions and prefix hits. The greedy tokens must equal the reference engine's too.""",
    engine='run_engine_with({"scheduler": Scheduler})',
    notes=("""## After the exercise: your scheduler under async scheduling

With `async_scheduling=True` the engine core plans step N+1 while step N's forward runs
(`microvllm/core/async_scheduler.py`; vLLM's `AsyncScheduler`). Your `schedule()` runs there
unchanged: `with_async_scheduling(Scheduler)` puts `AsyncScheduler`'s overrides in front of your
class. It never needs the token step N is still sampling, because the only place it asks "how
much is left?" is `self._cap_new_tokens`, and that counts `request.num_output_placeholders` — one
for each token a step in flight will sample — as if those tokens were there. The runner knows
them when N+1 runs (steps run in order), so the plan is right:

```python
from microvllm import LLM
LLM(components={"scheduler": Scheduler}, async_scheduling=True)   # your schedule(), two plans in flight
```""",),
)
