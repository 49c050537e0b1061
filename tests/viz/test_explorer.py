"""StepExplorer: the slider redraws the figure and the caption, fast enough to drag."""

import base64
import time

import pytest
from matplotlib.figure import Figure

from microvllm.trace import Trace
from microvllm.viz import StepExplorer, demo_trace, large_demo_trace


def first_preemption_and_resume(trace):
    """(index of the first step that preempts, the request it preempts, the step index
    and prefix-hit tokens of that request's return)."""
    preempted_at = trace.preemption_steps()[0]
    rid = trace[preempted_at].preempted[0]
    resumed_at, resumed = next((i, r) for i in range(preempted_at + 1, len(trace))
                               for r in trace[i].scheduled if r.request_id == rid)
    assert resumed.is_new and resumed.prefix_hit_tokens > 0
    return preempted_at, rid, resumed_at, resumed.prefix_hit_tokens


def test_moving_the_slider_changes_the_picture_and_the_caption():
    trace = demo_trace("preemption")
    preempted_at, rid, resumed_at, hits = first_preemption_and_resume(trace)
    assert 0 < preempted_at < resumed_at
    explorer = StepExplorer(trace)
    first_png, first_caption = bytes(explorer.image.value), explorer.caption.value
    assert first_png.startswith(b"\x89PNG") and first_caption.startswith(f"Step 0 (1 of {len(trace)})")
    explorer.slider.value = preempted_at                      # what dragging the slider does
    assert bytes(explorer.image.value) != first_png
    assert f"Preempted (blocks freed, back to waiting for recompute): {rid}." in explorer.caption.value
    assert explorer.figure.step == preempted_at and explorer.step == preempted_at
    explorer.show_step(resumed_at)                            # and the other way round
    assert explorer.slider.value == resumed_at
    assert f"{rid} (resumed, {hits} tokens from the prefix cache)" in explorer.caption.value


def test_play_button_and_slider_cover_every_step():
    explorer = StepExplorer(demo_trace("chunked"))
    assert (explorer.play.min, explorer.play.max) == (0, len(explorer.trace) - 1)
    assert (explorer.slider.min, explorer.slider.max) == (0, len(explorer.trace) - 1)


def test_from_json_and_static_figures(tmp_path):
    trace = demo_trace("sliding_window")
    trace.save(tmp_path / "run.json")
    explorer = StepExplorer.from_json(tmp_path / "run.json", step=3)
    assert explorer.trace == trace and explorer.step == 3
    figure = explorer.show_static()
    assert isinstance(figure, Figure) and figure is not explorer.figure.figure
    assert "Block pool after step 3" in figure.axes[0].get_title()
    assert "after step 9" in explorer.show_static(9).axes[0].get_title()


def test_display_carries_the_widget_and_a_static_png():
    explorer = StepExplorer(demo_trace("prefix"))
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]) == bytes(explorer.image.value)
    assert bundle["text/plain"] == f"StepExplorer over {len(explorer.trace)} steps (needs a live kernel to move)"


def test_redraw_is_fast_for_hundreds_of_steps_and_blocks():
    trace = large_demo_trace()
    assert len(trace) >= 200 and trace.num_blocks >= 200
    explorer = StepExplorer(trace)
    wall, cpu = [], []
    for step in (40, 80, 120, 160, 200, 240):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        explorer.slider.value = step
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    print(f"\nStepExplorer redraw over {len(trace)} steps, {trace.num_blocks} blocks: "
          f"mean {sum(wall) / len(wall):.3f} s wall, {sum(cpu) / len(cpu):.3f} s CPU, max {max(wall):.3f} s wall")
    assert sum(cpu) / len(cpu) < 1.0          # generous: ~0.25 s on an idle laptop-class core
    assert max(wall) < 5.0                    # shared CI machines are noisy


def test_an_empty_trace_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="no steps"):
        StepExplorer(Trace(block_size=4, num_blocks=8, max_num_batched_tokens=16, max_num_seqs=2))
