"""What happened in one step, in words (the step explorer's caption)."""

from __future__ import annotations

from microvllm.trace import Trace


def describe_step(trace: Trace, step: int) -> list[str]:
    """A few short lines: the batch, who was admitted/preempted/finished, the pool."""
    s = trace[step]
    prefill = sum(1 for r in s.scheduled if r.kind == "prefill")
    lines = [f"Step {s.step} ({step + 1} of {len(trace)}): {s.num_scheduled_tokens}/{s.token_budget} tokens "
             f"for {len(s.scheduled)} request(s): {prefill} prefill, {len(s.scheduled) - prefill} decode."]
    admitted = []
    for r in s.scheduled:
        if not r.is_new:
            continue
        verb = "resumed" if r.request_id in scheduled_before(trace, step) else "admitted"
        hit = f", {r.prefix_hit_tokens} tokens from the prefix cache" if r.prefix_hit_tokens else ""
        admitted.append(f"{r.request_id} ({verb}{hit})")
    if admitted:
        lines.append("New in the batch: " + "; ".join(admitted) + ".")
    if s.preempted:
        lines.append("Preempted (blocks freed, back to waiting for recompute): " + ", ".join(s.preempted) + ".")
    if s.finished:
        lines.append("Finished: " + ", ".join(f"{rid} ({s.finish_reasons.get(rid, '?')})" for rid in s.finished)
                     + ": blocks freed, full ones stay cached.")
    if s.waiting:
        lines.append("Waiting: " + ", ".join(s.waiting[:12]) + (" …" if len(s.waiting) > 12 else "") + ".")
    cached_free = sum(1 for b, free in enumerate(s.free) if free and s.block_hashes[b] is not None)
    shared = sum(1 for b, n in enumerate(s.ref_cnts) if n > 1)
    lines.append(f"Pool: {s.num_free_blocks} of {trace.num_blocks - 1} blocks free ({cached_free} still cached), "
                 f"{shared} shared by several requests.")
    return lines


def scheduled_before(trace: Trace, step: int) -> set[str]:
    """Request ids scheduled in any earlier step."""
    return {r.request_id for s in trace.steps[:step] for r in s.scheduled}
