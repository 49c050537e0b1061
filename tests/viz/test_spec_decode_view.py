"""Speculative decoding in the step pictures: drafts are part of their request's bar,
labelled with how many were accepted, and the slots of rejected drafts show in the
block table as still the request's."""

import math

import pytest

from microvllm.trace import RequestStep, StepTrace, Trace
from microvllm.viz import describe_step, plot_batch, plot_block_tables, plot_step
from microvllm.viz.batch import runner_order
from microvllm.viz.block_table import rejected_slots
from microvllm.viz.colors import DRAFT_HATCH, REJECTED_HATCH


def spec_trace(accepted: int | None = 1) -> Trace:
    """One step: r0 decodes its token at position 6 and checks 4 drafts (positions 7-10) in
    blocks of 4 tokens; r1 prefills 5 tokens beside it."""
    blocks = 8
    ref_cnts = [0, 1, 1, 1, 1, 1, 0, 0]
    step = StepTrace(
        step=3, token_budget=16, max_num_seqs=4,
        scheduled=[RequestStep("r1", 5, "prefill", 0, 5, prefix_hit_tokens=0, is_new=True),
                   RequestStep("r0", 5, "decode", 6, 4, num_draft_tokens=4, num_accepted_tokens=accepted)],
        block_tables={"r0": [[1, 2, 3]], "r1": [[4, 5]]}, ref_cnts=ref_cnts,
        block_hashes=[None] * blocks, free=[b != 0 and n == 0 for b, n in enumerate(ref_cnts)],
        num_free_blocks=2, new_tokens={"r0": [11] * (1 + (accepted or 0)), "r1": [12]})
    return Trace(block_size=4, num_blocks=blocks, max_num_batched_tokens=16, max_num_seqs=4, steps=[step])


def bars(ax):
    return {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith("batch-")}


def test_drafts_continue_their_requests_bar_hatched_and_labelled():
    trace = spec_trace(accepted=1)
    trace.check_consistency()
    ax = plot_batch(trace, 0).axes[0]
    found = bars(ax)
    assert set(found) == {"batch-r0-decode", "batch-r0-accepted", "batch-r0-rejected", "batch-r1-prefill"}
    own, accepted, rejected = found["batch-r0-decode"], found["batch-r0-accepted"], found["batch-r0-rejected"]
    assert (own.num_tokens, accepted.num_tokens, rejected.num_tokens) == (1, 1, 3)
    assert accepted.get_x() == pytest.approx(own.get_x() + own.get_width())         # one bar, end to end
    assert rejected.get_x() == pytest.approx(accepted.get_x() + accepted.get_width())
    assert accepted.get_hatch() == DRAFT_HATCH and rejected.get_hatch() == REJECTED_HATCH
    assert own.get_hatch() is None
    assert sum(p.num_tokens for gid, p in found.items() if gid.startswith("batch-r0")) == 5
    # With its drafts r0 is no one-token decode: the runner keeps the plan's order, r1 first.
    assert [r.request_id for r in runner_order(trace[0].scheduled)] == ["r1", "r0"]
    assert (found["batch-r1-prefill"].get_x(), own.get_x()) == (0, 5)
    labels = next(c for c in ax.collections if c.get_gid() == "batch-labels").labels
    assert labels == ["r1: prefill 5 (new)", "r0: decode 1 + 4 drafts, 1 accepted"]


def test_all_accepted_draws_no_rejected_part_and_unknown_fate_says_so():
    ax = plot_batch(spec_trace(accepted=4), 0).axes[0]
    assert "batch-r0-rejected" not in bars(ax) and bars(ax)["batch-r0-accepted"].num_tokens == 4
    labels = next(c for c in plot_batch(spec_trace(accepted=None), 0).axes[0].collections
                  if c.get_gid() == "batch-labels").labels
    assert labels[1] == "r0: decode 1 + 4 drafts"


def test_rejected_drafts_slots_are_marked_in_the_requests_block_table():
    trace = spec_trace(accepted=1)                 # drafts at positions 7, 8, 9, 10; 7 accepted
    ax = plot_block_tables(trace, 0).axes[0]
    (slots,) = [c for c in ax.collections if c.get_gid() == "tables-rejected"]
    row_of = {rid: y for y, rid in enumerate(trace[0].block_tables)}
    marked = []
    for path in slots.get_paths():
        box = path.get_extents()
        block, slot = math.floor(box.x0), round((box.x0 - math.floor(box.x0) - 0.05) / 0.9 * 4)
        marked.append((math.floor(box.y0), block * 4 + slot))
    assert marked == [(row_of["r0"], 8), (row_of["r0"], 9), (row_of["r0"], 10)]   # blocks 2 (logical), slots 0-2
    assert "rejected drafts" in ax.get_title()
    assert rejected_slots(spec_trace(accepted=4), 0, [("r0", 0), ("r1", 0)]) == []
    caption = describe_step(trace, 0)
    assert "Drafts: r0 checked 4 drafts, kept 1 (positions 8-10: slots still allocated, rewritten next step)." \
        in caption


def test_step_figure_legend_explains_drafts_only_when_there_are_some():
    def legend_texts(trace):
        return [t.get_text() for legend in plot_step(trace, 0).legends for t in legend.get_texts()]

    assert "rejected drafts (their slots)" in legend_texts(spec_trace())
    plain = spec_trace()
    plain[0].scheduled[1] = RequestStep("r0", 1, "decode", 6, 4)
    plain[0].scheduled[0].num_scheduled_tokens = 5
    assert "rejected drafts (their slots)" not in legend_texts(plain)


def test_consistency_counts_a_decode_without_its_drafts():
    trace = spec_trace()
    trace[0].scheduled[1].num_accepted_tokens = 5
    with pytest.raises(ValueError, match="accepted 5 of 4 drafts"):
        trace.check_consistency()
    trace[0].scheduled[1].num_accepted_tokens = 1
    trace[0].scheduled[1].num_draft_tokens = 3                    # 2 own tokens: not a decode
    with pytest.raises(ValueError, match="a decode of 2 tokens"):
        trace.check_consistency()


@pytest.mark.slow
def test_engine_trace_with_ngram_drafts_draws_every_token(tmp_path):
    """The real engine (tiny random Llama, n-gram drafts on prompts that repeat themselves):
    its trace passes the accounting checks, and every step's bars add up to its tokens."""
    from microvllm import LLM, SamplingParams
    from microvllm.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7)
    llm = LLM(str(folder), trace=True, block_size=4, max_num_batched_tokens=32, max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 4}, {"prompt_token_ids": [40, 41, 42] * 5}]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    trace = llm.trace
    trace.check_consistency()
    with_drafts = [i for i, s in enumerate(trace) if any(r.num_draft_tokens for r in s.scheduled)]
    assert with_drafts, "prompts that repeat themselves should get n-gram drafts"
    for i in with_drafts:
        s = trace[i]
        drawn = bars(plot_batch(trace, i).axes[0])
        assert sum(p.num_tokens for p in drawn.values()) == s.num_scheduled_tokens
        for r in (r for r in s.scheduled if r.num_draft_tokens):
            assert r.num_accepted_tokens is not None
            assert len(s.new_tokens[r.request_id]) == r.num_accepted_tokens + 1 or r.request_id in s.finished
