"""Fault isolation: an exception in one request's step fails that request, not the engine.

A step runs many requests in one forward pass and one sampling call. When it raises,
the exception does not say whose fault it was, so the engine finds out the way a
person would: it undoes the step (``Scheduler.undo_failed_step``: every request of
the step is recomputed later, nothing is lost) and runs those requests again with at
most one *suspect* among them per step::

    step 7    a b c      raises      undo; suspects = [a, b, c] (all back in waiting)
    step 8    a          ok          a sampled a token: cleared
    step 9    a b        raises      b is the step's only suspect: b fails (its blocks
                                     are freed, its caller hears why); undo a
    step 10   a c        ok          c cleared; no suspects left: normal steps again

A fault that is not a request's (every step raises) blames the requests one at a
time; the engine stays consistent and usable throughout. What it cannot recover
from (a dead tensor-parallel worker, Ctrl-C, a failure inside the scheduler itself)
is not caught here: the caller stops.

How "one suspect per step" is enforced: undone requests wait at the front of the
queue, and while a suspect runs uncleared the scheduler may admit no one else
(its ``max_num_seqs`` is lowered to the number already running); once the suspect
has sampled a token, one more may join. Normal limits return when no suspect is left.
"""

from __future__ import annotations

from microvllm.core.sched_output import SchedulerOutput


class FaultIsolation:
    def __init__(self) -> None:
        self.suspects: dict[str, None] = {}   # request ids, in the order they are retried
        self._max_num_seqs: int | None = None  # the scheduler's own limit, while lowered

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def limit_admissions(self, scheduler) -> None:
        """Before ``schedule()``: while suspects remain, admit a waiting request only when
        no uncleared suspect is running (so a step holds at most one suspect)."""
        if not self.suspects:
            if self._max_num_seqs is not None:
                scheduler.max_num_seqs, self._max_num_seqs = self._max_num_seqs, None
            return
        if self._max_num_seqs is None:
            self._max_num_seqs = scheduler.max_num_seqs
        for request_id in [r for r in self.suspects if r not in scheduler.requests]:
            del self.suspects[request_id]      # finished or aborted meanwhile
        running = {r.request_id for r in scheduler.running}
        suspect_running = any(r in running for r in self.suspects)
        scheduler.max_num_seqs = min(self._max_num_seqs, len(running) + (0 if suspect_running else 1))

    def blame(self, plan: SchedulerOutput) -> str | None:
        """A step of ``plan`` raised: the request to fail, or None when it cannot be told
        yet (then every request of the step becomes a suspect, retried one at a time)."""
        in_step = list(plan.num_scheduled_tokens)
        suspects_in_step = [r for r in in_step if r in self.suspects]
        if len(in_step) == 1:
            culprit = in_step[0]
        elif len(suspects_in_step) == 1:
            culprit = suspects_in_step[0]
        else:
            self.suspects.update(dict.fromkeys(in_step))
            return None
        self.suspects.pop(culprit, None)
        return culprit

    def passed(self, sampled_request_ids) -> None:
        """After a step that succeeded: suspects that sampled a token in it are cleared."""
        for request_id in sampled_request_ids:
            self.suspects.pop(request_id, None)
