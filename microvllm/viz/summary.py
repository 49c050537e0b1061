"""What happened in one step, in words (the step explorer's caption)."""

from __future__ import annotations

from microvllm.trace import RequestStep, Trace


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
    drafts = [r for r in s.scheduled if r.num_draft_tokens]
    if drafts:
        lines.append("Drafts: " + "; ".join(describe_drafts(r) for r in drafts) + ".")
    if s.allowed_fraction:
        lines.append("Grammar masks: " + ", ".join(f"{rid} may sample {fraction:.1%} of the vocabulary"
                                                   for rid, fraction in s.allowed_fraction.items()) + ".")
    # In the order they happened: a preempted request's blocks are freed while the step is
    # planned, before the survivors get theirs; finished requests free theirs after the step.
    freed = freed_blocks_by_reason(trace, step)
    first = {why: blocks for why, blocks in freed.items() if why.endswith(" preempted")}
    for group in (first, None, {why: blocks for why, blocks in freed.items() if why not in first}):
        if group is None:
            if s.allocated_blocks:
                lines.append(f"Allocated: block(s) {_ids(s.allocated_blocks)}.")
        elif group:
            lines.append("Freed: " + "; ".join(f"block(s) {_ids(blocks)} ({why})" for why, blocks in group.items())
                         + ".")
    cached_free = sum(1 for b, free in enumerate(s.free) if free and s.block_hashes[b] is not None)
    shared = sum(1 for b, n in enumerate(s.ref_cnts) if n > 1)
    lines.append(f"Pool: {s.num_free_blocks} of {trace.num_blocks - 1} blocks free ({cached_free} still cached), "
                 f"{shared} shared by several requests.")
    return lines


def describe_drafts(r: RequestStep) -> str:
    """'r0 checked 4 drafts, kept 2; positions 31-32 (rejected) stay allocated, rewritten next step'."""
    who = f"request {r.request_id}" if r.request_id.isdigit() else r.request_id   # not "0 checked"
    text = f"{who} checked {r.num_draft_tokens} draft{'s' if r.num_draft_tokens > 1 else ''}"
    if r.num_accepted_tokens is None:
        return text
    rejected = r.num_draft_tokens - r.num_accepted_tokens
    text += f", kept {r.num_accepted_tokens}"
    if rejected:
        end = r.num_computed_tokens_before + r.num_scheduled_tokens
        where = f"position {end - 1}" if rejected == 1 else f"positions {end - rejected}-{end - 1}"
        text += f" ({where}: slots still allocated, rewritten next step)"
    return text


def scheduled_before(trace: Trace, step: int) -> set[str]:
    """Request ids scheduled in any earlier step."""
    return {r.request_id for s in trace.steps[:step] for r in s.scheduled}


def freed_blocks_by_reason(trace: Trace, step: int) -> dict[str, list[int]]:
    """Step *index* `step`'s freed blocks, grouped by why their last holder let go:
    it finished, it was preempted, or (still running) its sliding window moved past them."""
    s = trace[step]
    before = trace[step - 1].block_tables if step > 0 else {}
    holders: dict[int, list[str]] = {}
    for rid, tables in before.items():
        for table in tables:
            for b in table:
                holders.setdefault(b, []).append(rid)
    reasons: dict[str, list[int]] = {}
    for b in s.freed_blocks:
        rids = holders.get(b, [])
        if any(rid in s.finished for rid in rids):
            why = f"{', '.join(r for r in rids if r in s.finished)} finished"
        elif any(rid in s.preempted for rid in rids):
            why = f"{', '.join(r for r in rids if r in s.preempted)} preempted"
        elif trace.sliding_window and any(rid in s.block_tables for rid in rids):
            why = f"left the {trace.sliding_window}-token sliding window"
        elif not rids and b in s.allocated_blocks:
            why = "allocated and freed within this step"
        else:
            why = "released"
        reasons.setdefault(why, []).append(b)
    return reasons


def _ids(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks))
