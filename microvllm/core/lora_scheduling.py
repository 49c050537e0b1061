"""vLLM's ``max_loras`` rule: at most ``max_loras`` distinct LoRA adapters in one step
(the device has that many adapter slots; vLLM: ``vllm/v1/core/sched/scheduler.py``).

A waiting request whose adapter would be one too many is skipped this step, and the
requests behind it may still go ahead; the base model takes no slot::

    max_loras=2   running: A, B        waiting: [C, A', base]
                  this step may admit A' and base; C stays first in the queue
                  and runs once A's or B's requests have all finished

``with_max_loras(Scheduler)`` adds the rule around any scheduler's ``schedule()`` (the
engine's, or one written in exercise 05) without changing it: the skipped requests are
taken out of the queue while the plan is made, then put back where they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from microvllm.core.request import Request
    from microvllm.core.sched_output import SchedulerOutput
    from microvllm.core.scheduler import Scheduler


class MaxLoRAsScheduling:
    """The rule, in front of a scheduler class (``with_max_loras``)."""

    max_loras: int
    running: list[Request]

    def __init__(self, *args, max_loras: int, **kwargs) -> None:
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras={max_loras!r} must be an int >= 1")
        super().__init__(*args, **kwargs)
        self.max_loras = max_loras

    def schedule(self) -> SchedulerOutput:
        held, order = self._hold_back_over_max_loras()
        try:
            return super().schedule()   # type: ignore[misc]
        finally:
            self._put_back(held, order)

    def _hold_back_over_max_loras(self) -> tuple[list[Request], dict[str, int]]:
        """Take out of the queue the waiting requests whose adapter would exceed
        ``max_loras``. The running requests' adapters count whether or not they get tokens
        this step, and each waiting request kept counts before it is admitted: never more
        than max_loras, whatever the plan admits."""
        waiting = self.waiting   # type: ignore[attr-defined]
        order = {r.request_id: i for i, r in enumerate(waiting)}
        loras = {r.lora_int_id for r in self.running if r.lora_int_id}
        kept, held = [], []
        for request in waiting:
            lora_id = request.lora_int_id
            if lora_id and lora_id not in loras and len(loras) >= self.max_loras:
                held.append(request)
                continue
            if lora_id:
                loras.add(lora_id)
            kept.append(request)
        if held:
            waiting.clear()
            waiting.extend(kept)
        return held, order

    def _put_back(self, held: list[Request], order: dict[str, int]) -> None:
        """The held requests back in the queue where they were (vLLM puts its skipped
        requests back at the front: the same place, those before them were admitted).
        Requests the plan preempted stay first."""
        if not held:
            return
        waiting = self.waiting   # type: ignore[attr-defined]
        preempted = [r for r in waiting if r.request_id not in order]
        rest = sorted([r for r in waiting if r.request_id in order] + held, key=lambda r: order[r.request_id])
        waiting.clear()
        waiting.extend(preempted + rest)


def with_max_loras(scheduler_class: type[Scheduler]) -> type[Scheduler]:
    """``scheduler_class`` with the ``max_loras`` rule in front of it (built with a
    ``max_loras=`` keyword)."""
    if issubclass(scheduler_class, MaxLoRAsScheduling):
        return scheduler_class
    return type(f"MaxLoRAs{scheduler_class.__name__}", (MaxLoRAsScheduling, scheduler_class), {})
