"""What a step's picture tells a room: who is in which queue, in which colour, readable from afar."""

import math

import pytest
from matplotlib.colors import to_hex
from matplotlib.text import Text

from microvllm.viz import StepExplorer, plot_queues, plot_step, request_colors
from microvllm.viz.demo import KINDS, demo_trace
from microvllm.viz.queues import LANES
from microvllm.viz.step_figure import PRESETS, look

TRACES = {kind: demo_trace(kind) for kind in KINDS}


def collection(ax, gid):
    (found,) = [c for c in ax.collections if c.get_gid() == gid]
    return found


def step_requests(s):
    return set(s.block_tables) | {r.request_id for r in s.scheduled} | set(s.waiting) | set(s.finished) | \
        set(s.preempted)


@pytest.mark.parametrize("kind, step", [(kind, i) for kind, trace in TRACES.items() for i in range(len(trace))])
def test_queue_lanes_are_the_legend_of_every_request_in_the_step(kind, step):
    trace = TRACES[kind]
    s = trace[step]
    ax = plot_queues(trace, step, max_chips=50).axes[0]
    palette = request_colors(trace)
    shown = {}
    for lane in LANES:
        ids = collection(ax, f"queue-{lane}").labels
        chips = collection(ax, f"queue-{lane}-chips")
        faces = [to_hex(c) for c in chips.get_facecolors()] if ids else []
        assert faces == [palette[rid] for rid in ids]                # chip colour = the request's colour
        shown[lane] = ids
    assert shown["waiting"] == s.waiting                              # the scheduler's queue, in order
    assert shown["finished"] == s.finished
    assert shown["preempted"] == s.preempted
    assert shown["running"] == list(s.block_tables)
    assert {rid for ids in shown.values() for rid in ids} == step_requests(s)


def test_long_queues_say_how_many_are_not_shown():
    from microvllm.viz.demo import large_demo_trace

    trace = large_demo_trace(num_requests=60, num_blocks=64)
    step = max(range(len(trace)), key=lambda i: len(trace[i].waiting))
    waiting = trace[step].waiting
    assert len(waiting) > 12
    ax = plot_queues(trace, step).axes[0]
    assert collection(ax, "queue-waiting").labels == waiting[:12]
    assert collection(ax, "queue-waiting-note").labels == [f"+{len(waiting) - 12} more"]


def test_the_waiting_queue_matches_the_schedulers_at_every_step(monkeypatch):
    """The tracer copies scheduler.waiting at the end of each step: check it against a replay."""
    from microvllm.engine.step_tracer import StepTracer

    queues = []
    record = StepTracer.record

    def spy(self, *args, **kwargs):
        record(self, *args, **kwargs)
        queues.append([r.request_id for r in self.scheduler.waiting])

    monkeypatch.setattr(StepTracer, "record", spy)
    trace = demo_trace("preemption")
    assert [s.waiting for s in trace] == queues
    assert any(len(q) > 1 for q in queues)
    assert trace.preemption_steps()


def all_text_px(fig):
    """(pixel height, text) of every visible piece of text in a drawn figure."""
    fig.canvas.draw()
    scale = fig.dpi / 72
    found = [(t.get_fontsize() * scale, t.get_text()) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.axes is None or
             (t.get_visible() and t.get_text().strip() and t.axes.get_visible())]
    for labels in fig.findobj(lambda a: hasattr(a, "labels") and hasattr(a, "get_sizes") and a.get_visible()):
        sizes = list(labels.get_sizes()) * (len(labels.labels) if len(labels.get_sizes()) == 1 else 1)
        found += [(math.sqrt(size) * scale, text) for size, text in zip(sizes, labels.labels) if text.strip()]
    return found


@pytest.mark.parametrize("kind", ["preemption", "sliding_window"])
def test_projector_preset_has_no_text_under_14_px_and_fits_a_1080p_screen(kind):
    trace = TRACES[kind]
    explorer = StepExplorer(trace, preset="projector")
    for step in (0, len(trace) // 2, trace.preemption_steps()[0] if trace.preemption_steps() else 3):
        explorer.show_step(step)
        fig = explorer.figure.figure
        width, height = fig.canvas.get_width_height()
        assert width <= 1600 and height <= 1080                     # shown 1:1 in a browser on 1920 x 1080
        texts = all_text_px(fig)
        assert len(texts) > 50
        smallest = min(texts)
        assert smallest[0] >= 14 - 1e-6, f"text {smallest[1]!r} is {smallest[0]:.1f} px high"
    default = min(all_text_px(StepExplorer(trace).figure.figure))
    assert default[0] < 14                                          # the test can fail: the default is smaller


def test_projector_hides_labels_too_small_to_enlarge_on_a_big_trace():
    from microvllm.viz import large_demo_trace

    trace = large_demo_trace(num_requests=60, num_blocks=128)
    step = max(range(len(trace)), key=lambda i: len(trace[i].scheduled))
    explorer = StepExplorer(trace, preset="projector", step=step)
    fig = explorer.figure.figure
    assert min(all_text_px(fig))[0] >= 14 - 1e-6
    ids = collection(explorer.figure.tables_ax, "tables-ids")
    assert not ids.get_visible()                         # 20+ rows of block ids: too small, hidden
    assert collection(explorer.figure.queues_ax, "queue-running").get_visible()


def test_scale_multiplies_pixels_and_text():
    trace = TRACES["prefix"]
    small, big = StepExplorer(trace), StepExplorer(trace, scale=1.5)
    w, h = small.figure.figure.canvas.get_width_height()
    assert big.figure.figure.canvas.get_width_height() == (round(1.5 * w), round(1.5 * h))
    assert min(all_text_px(big.figure.figure))[0] == pytest.approx(1.5 * min(all_text_px(small.figure.figure))[0])
    projector = StepExplorer(trace, preset="projector", scale=1.25)
    assert min(all_text_px(projector.figure.figure))[0] >= 1.25 * 14 - 1e-6
    assert look("projector", 2).min_text_px == 28 and PRESETS["notebook"].min_text_px is None
    with pytest.raises(ValueError, match="choose one of"):
        StepExplorer(trace, preset="beamer")
    with pytest.raises(ValueError, match="scale"):
        StepExplorer(trace, scale=0)


def test_show_static_keeps_the_preset():
    trace = TRACES["chunked"]
    fig = StepExplorer(trace, preset="projector").show_static(2)
    assert min(all_text_px(fig))[0] >= 14 - 1e-6
    assert plot_step(trace, 2).dpi == 100                          # as before: a static figure at 100 dpi


def test_explorer_takes_an_llm_or_its_trace(tmp_path):
    from microvllm import LLM, SamplingParams
    from microvllm.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7)
    llm = LLM(str(folder), trace=True, block_size=4, max_model_len=64)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert StepExplorer(llm).trace is llm.trace
    assert StepExplorer(llm.trace, step=1).step == 1
    with pytest.raises(TypeError, match="trace=True"):
        StepExplorer(LLM(str(folder), block_size=4, max_model_len=64))
    with pytest.raises(TypeError, match="needs a Trace"):
        StepExplorer("run.json")


def test_projector_screenshot(request):
    """Save the projector preset's PNG (what the widget shows) under tests/artifacts/ (ignored by git)."""
    from pathlib import Path

    trace = TRACES["sliding_window"]
    step = next(i for i, s in enumerate(trace) if s.freed_blocks and not s.finished)   # the window frees blocks
    explorer = StepExplorer(trace, preset="projector", step=step)
    artifacts = Path(request.config.rootpath) / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / "step_explorer_projector.png").write_bytes(explorer.image.value)
    pool = explorer.figure.pool_ax
    assert len(collection(pool, "pool-freed").get_paths()) == len(trace[step].freed_blocks) > 0


def test_caption_says_which_blocks_were_allocated_and_why_blocks_were_freed():
    from microvllm.viz import describe_step

    trace = TRACES["sliding_window"]
    window = next(i for i, s in enumerate(trace) if s.freed_blocks and not s.finished)
    s = trace[window]
    assert f"Freed: block(s) {', '.join(map(str, s.freed_blocks))} (left the 8-token sliding window)." \
        in describe_step(trace, window)
    trace = TRACES["preemption"]
    step = trace.preemption_steps()[0]
    s = trace[step]
    lines = describe_step(trace, step)
    allocated = f"Allocated: block(s) {', '.join(map(str, s.allocated_blocks))}."
    freed = f"Freed: block(s) {', '.join(map(str, s.freed_blocks))} ({s.preempted[0]} preempted)."
    assert allocated in lines and freed in lines
    assert lines.index(freed) < lines.index(allocated), lines   # the victim's blocks go first
